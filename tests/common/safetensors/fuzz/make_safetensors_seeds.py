# Writes the seed corpus of the safetensors fuzz target
# (tests/common/safetensors/fuzz/safetensors/): small files in the layout of
# common/safetensors/safetensors.h, with every dtype kvcm converts, metadata, a scalar, an
# empty tensor, a gap between tensors and integer dtypes.
#   python3 tests/common/safetensors/fuzz/make_safetensors_seeds.py tests/common/safetensors/fuzz/safetensors
import json
import struct
import sys

SIZES = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U8": 1, "BOOL": 1, "F64": 8, "I32": 4}


def write(path, tensors, metadata=None, gap=0):
    header, data = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape in tensors:
        n = SIZES[dtype]
        for d in shape:
            n *= d
        begin = len(data)
        data += bytes((begin + i * 7 + 1) % 251 for i in range(n))
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, len(data)]}
        data += b"\0" * gap
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


out = sys.argv[1]
write(f"{out}/f32_with_metadata.safetensors",
      [("model.embed_tokens.weight", "F32", [8, 4]), ("model.norm.weight", "F32", [4])],
      metadata={"format": "pt"})
write(f"{out}/half_types.safetensors",
      [("a.f16", "F16", [2, 8]), ("b.bf16", "BF16", [16]), ("c.f64", "F64", [2])], gap=4)
write(f"{out}/scalar_empty_integers.safetensors",
      [("scalar", "F32", []), ("empty", "F32", [0, 3]), ("ids", "I64", [3]),
       ("mask", "BOOL", [5]), ("bytes", "U8", [2, 2]), ("i", "I32", [1])],
      metadata=None)
