# Writes the seed corpus of the gguf fuzz target (tests/common/gguf/fuzz/gguf/) with the
# reference implementation's writer (the gguf package, BUILD_DIR/venv-reference):
#   build/venv-reference/bin/python3 tests/common/gguf/fuzz/make_seeds.py tests/common/gguf/fuzz/gguf
# A file with every value type and a tensor of every type kvcm dequantizes, one with only
# tokenizer-like metadata, and one with a single tensor.
import gguf, numpy as np, sys
from gguf import GGUFWriter, GGMLQuantizationType as Q
out = sys.argv[1]
rng = np.random.default_rng(20261201)
def w(name, f):
    wr = GGUFWriter(f"{out}/{name}", "llama")
    f(wr)
    wr.write_header_to_file(); wr.write_kv_data_to_file(); wr.write_tensors_to_file(); wr.close()
def all_types(wr):
    wr.add_uint32("llama.block_count", 2)
    wr.add_int8("i8", -3)
    wr.add_uint16("u16", 7); wr.add_int64("i64", -9); wr.add_uint64("u64", 9)
    wr.add_float32("f32", 0.5); wr.add_float64("f64", 0.25); wr.add_bool("b", True)
    wr.add_array("tokens", ["<s>", "a", "Ġb", "é"])
    wr.add_array("types", [1, 2, 3, 1])
    wr.add_array("scores", [0.0, -1.0, -2.0, -3.0])
    x = rng.standard_normal((2, 32)).astype(np.float32)
    wr.add_tensor("t.f32", x)
    wr.add_tensor("t.f16", x.astype(np.float16))
    for t in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.BF16):
        q = gguf.quants.quantize(x, t)
        wr.add_tensor(f"t.{t.name.lower()}", q, raw_shape=q.shape, raw_dtype=t)
    for t in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        bs, ts = gguf.GGML_QUANT_SIZES[t]
        raw = rng.integers(0, 256, ts, dtype=np.uint8)
        raw[0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        wr.add_tensor(f"t.{t.name.lower()}", raw, raw_shape=raw.shape, raw_dtype=t)
def metadata_only(wr):
    wr.add_uint32("llama.block_count", 1); wr.add_uint32("llama.context_length", 64)
    wr.add_uint32("llama.embedding_length", 8); wr.add_uint32("llama.attention.head_count", 2)
    wr.add_string("tokenizer.ggml.model", "gpt2")
    wr.add_array("tokenizer.ggml.tokens", ["a", "b", "ab", "<|end|>"])
    wr.add_array("tokenizer.ggml.merges", ["a b"])
    wr.add_array("nested", [[1, 2], [3]])
def one_tensor(wr):
    wr.add_tensor("token_embd.weight", rng.standard_normal((4, 8)).astype(np.float32))
w("all_types.gguf", all_types)
w("metadata_only.gguf", metadata_only)
w("one_tensor.gguf", one_tensor)
