#!/usr/bin/env python3
"""Reference implementation of kvcm's chained block hash (common/block/block_hash.h).

Independent of the C++ code: it follows the documented byte encoding, so other languages
(a Python router, an indexer consuming KV events) can compute the same hashes. Prints the
vectors that tests/common/block/block_hash_test.cc checks.

  python3 tools/block_hash_reference.py        # xxh3 vectors need `pip install xxhash`,
                                               # fast128 vectors `pip install mmh3`
"""
import hashlib
import struct


def u32(x):
    return struct.pack("<I", x)


def encode_root(salt: bytes) -> bytes:
    return b"kvcm.root.v1" + u32(len(salt)) + salt


def encode_block(parent: bytes, tokens, extra_keys=()) -> bytes:
    out = parent + u32(len(tokens)) + b"".join(struct.pack("<i", t) for t in tokens)
    out += u32(len(extra_keys))
    for key in extra_keys:
        out += u32(len(key)) + key
    return out


def encode_root_v2(salt: bytes) -> bytes:
    return b"kvcm.root.v2" + u32(len(salt)) + salt


def xxh3_v2_block(parent: bytes, tokens, extra_keys=()) -> bytes:
    """kXxh3V2's block hash: the version-2 message, seed 1 when there are extra keys."""
    import xxhash

    if not extra_keys:
        message = parent[:16] + b"".join(struct.pack("<i", t) for t in tokens)
        return xxhash.xxh3_128_digest(message) + bytes(16)
    message = parent[:16] + encode_block(b"", tokens, extra_keys)
    return xxhash.xxh3_128_digest(message, seed=1) + bytes(16)


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def fast128(data: bytes) -> bytes:
    import mmh3  # MurmurHash3 x64 128, seed 0

    return mmh3.hash_bytes(data) + bytes(16)


def xxh3(data: bytes) -> bytes:
    import xxhash  # XXH3 128, seed 0, canonical (big-endian) digest

    return xxhash.xxh3_128_digest(data) + bytes(16)


def main():
    root = sha256(encode_root(b""))
    print("sha256 root           ", root.hex())
    print("sha256 root salt=llama", sha256(encode_root(b"llama")).hex())
    b0 = sha256(encode_block(root, [1, 2, 3, 4]))
    print("sha256 block0 [1,2,3,4]", b0.hex())
    print("sha256 block1 [5,6,7,-1] extra=img", sha256(encode_block(b0, [5, 6, 7, -1], [b"img"])).hex())
    try:
        xroot = xxh3(encode_root(b""))
        print("xxh3 root              ", xroot.hex())
        print("xxh3 block0 [1,2,3,4]  ", xxh3(encode_block(xroot, [1, 2, 3, 4])).hex())
        vroot = xxh3(encode_root_v2(b""))
        print("xxh3_v2 root           ", vroot.hex())
        print("xxh3_v2 root salt=llama", xxh3(encode_root_v2(b"llama")).hex())
        v0 = xxh3_v2_block(vroot, [1, 2, 3, 4])
        print("xxh3_v2 block0 [1,2,3,4]", v0.hex())
        print("xxh3_v2 block1 [5,6,7,-1] extra=img", xxh3_v2_block(v0, [5, 6, 7, -1], [b"img"]).hex())
        v16 = xxh3_v2_block(vroot, list(range(100, 116)))
        print("xxh3_v2 block0 [100..115]", v16.hex())
    except ImportError:
        print("xxh3: install xxhash to print these")
    try:
        froot = fast128(encode_root(b""))
        print("fast128 root           ", froot.hex())
        print("fast128 block0 [1,2,3,4]", fast128(encode_block(froot, [1, 2, 3, 4])).hex())
    except ImportError:
        print("fast128: install mmh3 to print these")


if __name__ == "__main__":
    main()
