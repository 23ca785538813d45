"""The reference side of tests/common/gguf: what the `gguf` Python package (llama.cpp's own
reader, writer and quantization code) computes, written for the C++ tests to compare.

  quants SEED OUT          random blocks of every type: gguf.quants.dequantize of random
                           bytes and gguf.quants.quantize of random floats, as records
                           (see write_record)
  write SEED GGUF JSON     a GGUF written by gguf.GGUFWriter (every value type, nested
                           arrays, tensors of several types, alignment 64) and, in JSON, what
                           was written
  dump GGUF JSON [NAME OUT]...
                           what gguf.GGUFReader reads from GGUF, in the same JSON; each NAME
                           OUT pair also writes tensor NAME dequantized by
                           gguf.quants.dequantize to OUT as raw float32

JSON values are exact: integers as numbers, floats as the hex of their IEEE bits
(float32: 8 digits, float64: 16), strings as strings, arrays as
{"element_type": T, "elements": [...]}; each value is {"type": T, "value": V} with T
gguf's GGUFValueType number. Tensor data is hex.
"""

import json
import struct
import sys
import warnings

import numpy as np

import gguf
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

DEQUANT_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K,
                 Q.Q5_K, Q.Q6_K]
QUANT_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]

# Byte offsets of each type's fp16 scale fields inside a block (ggml-common.h's block_*).
FP16_FIELDS = {
    Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0],
    Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [128 + 64 + 16],
}


def write_record(out, kind, qtype, n_elements, src, dst):
    """kind 0: src raw blocks, dst float32 (dequantize); kind 1: src float32, dst bytes."""
    src = np.ascontiguousarray(src).tobytes()
    dst = np.ascontiguousarray(dst).tobytes()
    out.write(struct.pack("<IIQQ", kind, int(qtype), n_elements, len(src)))
    out.write(src)
    out.write(struct.pack("<Q", len(dst)))
    out.write(dst)


def random_scales(rng, n):
    """Finite, sensible fp16 scales: mostly magnitudes 1e-4..4 of either sign, some zeros and
    fp16 subnormals (the conversion's edge)."""
    mag = np.exp(rng.uniform(np.log(1e-4), np.log(4.0), n)).astype(np.float32)
    s = np.where(rng.random(n) < 0.5, -mag, mag)
    kind = rng.random(n)
    s = np.where(kind < 0.03, 0.0, s)
    s = np.where((kind >= 0.03) & (kind < 0.06), rng.uniform(-6e-5, 6e-5, n), s)
    return s.astype(np.float16)


def random_blocks(rng, qtype, n_blocks):
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for off in FP16_FIELDS.get(qtype, []):
        raw[:, off:off + 2] = random_scales(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    return raw


def random_floats(rng, n_blocks, block_size):
    """Normal values with a different scale per block, and blocks of the edge cases."""
    scales = np.exp(rng.uniform(np.log(1e-3), np.log(1e3), (n_blocks, 1)))
    x = (rng.standard_normal((n_blocks, block_size)) * scales).astype(np.float32)
    if n_blocks >= 8:
        x[0] = 0.0                                   # all zero: d = 0
        x[1] = 1.25                                  # constant
        x[2] = 0.0
        x[2, 3] = -7.0                               # one negative extreme
        x[3] = np.linspace(-1.0, 1.0, block_size)    # evenly spaced: ties in rounding
        x[4] = rng.integers(-127, 128, block_size)   # integers: exact Q8_0 levels
        x[5] = -np.abs(x[5])                         # all negative
        x[6] = rng.uniform(-1e-6, 1e-6, block_size)  # tiny: fp16 subnormal scales
        x[7] = np.abs(x[7])                          # all positive
    return x.reshape(-1)


def cmd_quants(seed, path):
    rng = np.random.default_rng(seed)
    with open(path, "wb") as out:
        for qtype in DEQUANT_TYPES:
            block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
            if qtype in (Q.F16, Q.BF16):
                # Every 16-bit pattern (inf, NaN, subnormals included), in random order.
                raw = rng.permutation(np.arange(65536, dtype=np.uint32)).astype(np.uint16)
                raw = raw.view(np.uint8).reshape(-1, 2)
            elif qtype == Q.F32:
                raw = rng.integers(0, 2**32, size=4096, dtype=np.uint32).view(np.uint8)
                raw = raw.reshape(-1, 4)
            else:
                raw = random_blocks(rng, qtype, 512 if block_size == 256 else 2048)
            n = raw.shape[0] * block_size
            floats = gguf.quants.dequantize(raw.reshape(-1), qtype).astype(np.float32)
            assert floats.size == n
            write_record(out, 0, qtype, n, raw, floats)
        for qtype in QUANT_TYPES:
            block_size, _ = gguf.GGML_QUANT_SIZES[qtype]
            x = random_floats(rng, 1024 if block_size == 32 else 32, 32)
            if qtype == Q.F16:
                # Around fp16's range ends: the largest finite, the overflow to infinity,
                # subnormals, signed zero.
                x[:12] = [65504.0, 65519.0, 65520.0, 70000.0, -65536.0, 6e-8, 3e-8, 2.9e-8,
                          -0.0, 6.1035156e-05, 6.097555e-05, 1e-10]
            elif qtype == Q.BF16:
                x[:6] = np.array([0x7FC00001, 0x7F800001, 0xFF800000, 0x7F7FFFFF, 0x00000001,
                                  0x3F808000], dtype=np.uint32).view(np.float32)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with np.errstate(all="ignore"):
                    q = gguf.quants.quantize(x, qtype)
            write_record(out, 1, qtype, x.size, x, np.ascontiguousarray(q).view(np.uint8))


def f32_hex(v):
    return struct.pack("<f", v).hex()


def encode(vtype, value):
    """{"type", "value"} of a Python value written as vtype."""
    vtype = V(vtype)
    if vtype == V.ARRAY:
        raise AssertionError("use encode_array")
    if vtype == V.FLOAT32:
        return {"type": int(vtype), "value": "%08x" % struct.unpack("<I", struct.pack("<f", value))[0]}
    if vtype == V.FLOAT64:
        return {"type": int(vtype), "value": "%016x" % struct.unpack("<Q", struct.pack("<d", value))[0]}
    if vtype == V.BOOL:
        return {"type": int(vtype), "value": bool(value)}
    if vtype == V.STRING:
        return {"type": int(vtype), "value": value}
    return {"type": int(vtype), "value": int(value)}


def encode_array(element_type, elements):
    """elements: encoded values."""
    return {"type": int(V.ARRAY),
            "value": {"element_type": int(element_type), "elements": elements}}


def cmd_write(seed, gguf_path, json_path):
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(gguf_path, "llama")
    kvs = [("general.architecture", encode(V.STRING, "llama"))]
    writer.add_custom_alignment(64)
    kvs.append(("general.alignment", encode(V.UINT32, 64)))

    def add(key, vtype, value, adder):
        adder(key, value)
        kvs.append((key, encode(vtype, value)))

    add("test.uint8", V.UINT8, int(rng.integers(0, 256)), writer.add_uint8)
    add("test.int8", V.INT8, int(rng.integers(-128, 128)), writer.add_int8)
    add("test.uint16", V.UINT16, int(rng.integers(0, 2**16)), writer.add_uint16)
    add("test.int16", V.INT16, int(rng.integers(-2**15, 2**15)), writer.add_int16)
    add("test.uint32", V.UINT32, int(rng.integers(0, 2**32)), writer.add_uint32)
    add("test.int32", V.INT32, int(rng.integers(-2**31, 2**31)), writer.add_int32)
    add("test.uint64", V.UINT64, 2**64 - 1 - int(rng.integers(0, 1000)), writer.add_uint64)
    add("test.int64", V.INT64, -2**63 + int(rng.integers(0, 1000)), writer.add_int64)
    f32 = float(np.float32(rng.standard_normal()))
    add("test.float32", V.FLOAT32, f32, writer.add_float32)
    add("test.float64", V.FLOAT64, float(rng.standard_normal()), writer.add_float64)
    add("test.bool_true", V.BOOL, True, writer.add_bool)
    add("test.bool_false", V.BOOL, False, writer.add_bool)
    add("test.string", V.STRING, "héllo wörld ✓ 𝄞", writer.add_string)
    # (add_string skips an empty string; add_key_value writes it.)
    writer.add_key_value("test.empty_string", "", V.STRING)
    kvs.append(("test.empty_string", encode(V.STRING, "")))

    # Typed arrays of every scalar type.
    ranges = {V.UINT8: (0, 2**8), V.INT8: (-2**7, 2**7), V.UINT16: (0, 2**16),
              V.INT16: (-2**15, 2**15), V.UINT32: (0, 2**32), V.INT32: (-2**31, 2**31),
              V.UINT64: (0, 2**63), V.INT64: (-2**63, 2**63 - 1)}
    for vtype, (lo, hi) in ranges.items():
        values = [int(v) for v in rng.integers(lo, hi, size=int(rng.integers(1, 20)))]
        key = "test.array_" + vtype.name.lower()
        writer.add_key_value(key, values, V.ARRAY, sub_type=vtype)
        kvs.append((key, encode_array(vtype, [encode(vtype, v) for v in values])))
    f32s = [float(v) for v in rng.standard_normal(7).astype(np.float32)]
    writer.add_key_value("test.array_float32", f32s, V.ARRAY, sub_type=V.FLOAT32)
    kvs.append(("test.array_float32", encode_array(V.FLOAT32, [encode(V.FLOAT32, v) for v in f32s])))
    f64s = [float(v) for v in rng.standard_normal(5)]
    writer.add_key_value("test.array_float64", f64s, V.ARRAY, sub_type=V.FLOAT64)
    kvs.append(("test.array_float64", encode_array(V.FLOAT64, [encode(V.FLOAT64, v) for v in f64s])))
    bools = [bool(v) for v in rng.integers(0, 2, size=9)]
    writer.add_key_value("test.array_bool", bools, V.ARRAY, sub_type=V.BOOL)
    kvs.append(("test.array_bool", encode_array(V.BOOL, [encode(V.BOOL, v) for v in bools])))
    strings = ["", "a", "Ġthe", "日本語", "<|im_start|>", "tab\there"]
    writer.add_array("test.array_string", strings)
    kvs.append(("test.array_string", encode_array(V.STRING, [encode(V.STRING, s) for s in strings])))
    # Arrays of arrays (gguf types the inner elements from Python: int -> int32).
    nested = [[1, 2, 3], [-4], [5, 6]]
    writer.add_array("test.nested_int32", nested)
    kvs.append(("test.nested_int32", encode_array(V.ARRAY, [
        encode_array(V.INT32, [encode(V.INT32, v) for v in inner]) for inner in nested])))
    nested_s = [["x", "yz"], ["é"]]
    writer.add_array("test.nested_string", nested_s)
    kvs.append(("test.nested_string", encode_array(V.ARRAY, [
        encode_array(V.STRING, [encode(V.STRING, v) for v in inner]) for inner in nested_s])))
    deep = [[[1], [2, 3]], [[4]]]
    writer.add_array("test.nested_deep", deep)
    kvs.append(("test.nested_deep", encode_array(V.ARRAY, [
        encode_array(V.ARRAY, [encode_array(V.INT32, [encode(V.INT32, v) for v in inner])
                               for inner in middle]) for middle in deep])))

    tensors = []

    def add_tensor(name, qtype, shape):
        """shape in numpy order (rows first); gguf writes ne[0] = shape[-1]."""
        x = rng.standard_normal(shape).astype(np.float32)
        if qtype == Q.F32:
            data = x
            writer.add_tensor(name, data)
        elif qtype == Q.F16:
            data = x.astype(np.float16)
            writer.add_tensor(name, data)
        else:
            data = gguf.quants.quantize(x, qtype)
            writer.add_tensor(name, data, raw_dtype=qtype)
        tensors.append({"name": name, "type": int(qtype), "dims": list(reversed(shape)),
                        "data": np.ascontiguousarray(data).tobytes().hex()})

    add_tensor("embd.weight", Q.Q8_0, (5, 64))
    add_tensor("norm.weight", Q.F32, (3,))
    add_tensor("blk.0.q.weight", Q.Q4_0, (2, 3, 32))
    add_tensor("blk.0.k.weight", Q.Q4_1, (2, 1, 2, 64))
    add_tensor("blk.0.v.weight", Q.F16, (7, 5))
    add_tensor("blk.0.o.weight", Q.BF16, (2, 33))
    add_tensor("blk.0.up.weight", Q.Q5_0, (1, 32))
    add_tensor("blk.0.down.weight", Q.Q5_1, (3, 32))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with open(json_path, "w", encoding="utf-8") as out:
        json.dump({"alignment": 64,
                   "metadata": [{"key": k, **v} for k, v in kvs],
                   "tensors": tensors}, out, ensure_ascii=False)


def decode_parts(parts, i, vtype):
    """The encoded value of type vtype whose parts start at parts[i]; returns (value, next i)."""
    vtype = V(vtype)
    if vtype == V.STRING:
        return encode(V.STRING, bytes(parts[i + 1]).decode("utf-8")), i + 2
    if vtype == V.ARRAY:
        element_type = V(int(parts[i][0]))
        count = int(parts[i + 1][0])
        i += 2
        elements = []
        for _ in range(count):
            e, i = decode_parts(parts, i, element_type)
            elements.append(e)
        return encode_array(element_type, elements), i
    v = parts[i][0]
    if vtype in (V.FLOAT32, V.FLOAT64):
        return encode(vtype, float(v)), i + 1
    if vtype == V.BOOL:
        return encode(vtype, bool(v)), i + 1
    return encode(vtype, int(v)), i + 1


def cmd_dump(gguf_path, json_path, dequant):
    reader = gguf.GGUFReader(gguf_path)
    metadata = []
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue  # the header, which GGUFReader lists as fields
        value, end = decode_parts(field.parts, 3, int(field.parts[2][0]))
        assert end == len(field.parts), key
        metadata.append({"key": key, **value})
    tensors = []
    for t in reader.tensors:
        tensors.append({"name": t.name, "type": int(t.tensor_type),
                        "dims": [int(d) for d in t.shape],
                        "offset": int(t.field.parts[-1][0]),
                        "n_elements": int(t.n_elements), "n_bytes": int(t.n_bytes),
                        "data_offset": int(t.data_offset),
                        "data": bytes(t.data.reshape(-1).view(np.uint8)).hex()
                        if t.n_bytes <= 1 << 16 else None})
    with open(json_path, "w", encoding="utf-8") as out:
        json.dump({"alignment": int(reader.alignment), "data_offset": int(reader.data_offset),
                   "metadata": metadata, "tensors": tensors}, out, ensure_ascii=False)
    by_name = {t.name: t for t in reader.tensors}
    for name, out_path in dequant:
        t = by_name[name]
        floats = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        floats.reshape(-1).tofile(out_path)


def main(argv):
    if len(argv) >= 3 and argv[0] == "quants":
        print("gguf_reference.py quants seed", argv[1])
        cmd_quants(int(argv[1]), argv[2])
    elif len(argv) == 4 and argv[0] == "write":
        print("gguf_reference.py write seed", argv[1])
        cmd_write(int(argv[1]), argv[2], argv[3])
    elif len(argv) >= 3 and argv[0] == "dump" and len(argv) % 2 == 1:
        cmd_dump(argv[1], argv[2], list(zip(argv[3::2], argv[4::2])))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
