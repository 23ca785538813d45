#!/usr/bin/env python3
"""Tiny random models written by Hugging Face transformers itself (save_pretrained), with
their logits, for tests/services/executor/model/transformers_models_test.cc: a check of kvcm's
loaders that does not go through kvcm's own writer (tools/make_tiny_model).

  llama       LlamaForCausalLM: grouped-query attention, llama3 RoPE scaling
  llama-bias  LlamaForCausalLM with attention_bias (q, k, v and o) and tied embeddings
  qwen2       Qwen2ForCausalLM (bias on q, k and v), tied embeddings
  qwen3       Qwen3ForCausalLM (per-head q/k RMSNorm, no bias): head_dim 16 with hidden 32
              and 4 heads (head_dim != hidden / heads), grouped-query attention (2 KV heads)
  qwen3-mha   Qwen3ForCausalLM: 2 heads of 8 with hidden 48, no GQA, tied embeddings
  qwen3-bias  Qwen3ForCausalLM with attention_bias (q, k, v and o), 4 query heads on one KV
              head, head_dim = hidden / heads
  mistral-window  MistralForCausalLM with a sliding window of 5 tokens on every layer
  qwen2-window    Qwen2ForCausalLM with use_sliding_window: layer 0 full, layer 1 a window of
                  4 (max_window_layers 1; transformers writes it as layer_types)
  qwen3-window    Qwen3ForCausalLM with a window of 3 tokens on both layers
  gemma3      Gemma3ForCausalLM (gemma3_text): layers sliding (window 4), full, sliding;
              head_dim 16 with hidden 32 and 4 heads, 2 KV heads, query_pre_attn_scalar 24,
              full layers' RoPE theta 10000 with linear scaling x2, sliding layers' 100,
              tied embeddings
  gemma3-mha  Gemma3ForCausalLM: 2 heads of 16 on 2 KV heads (no GQA), 4 layers with
              sliding_window_pattern 2 (sliding with a window of 3, full, sliding, full),
              query_pre_attn_scalar 10, untied embeddings
The prompt and its continuation (18 tokens) are several windows long.

transformers 5 writes its own config spelling (dtype, rope_parameters), which kvcm must read.
Weights are drawn with a fixed seed at a scale that makes the logits far from ties. For
each model, tests/reference/transformers/NAME/ holds what save_pretrained wrote, and
tests/reference/transformers_reference.json the logits of every position of a fixed token
sequence and the greedy continuation.

It needs torch, which the suite does not install; the outputs are committed and this script
regenerates them:

  /some/venv/bin/pip install torch transformers==5.24.0
  /some/venv/bin/python3 tests/reference/transformers_models.py --out tests/reference
"""

import argparse
import json
import os
import shutil

import torch
import transformers
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

SEED = 20261202
NEW_TOKENS = 6

COMMON = dict(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1,
              eos_token_id=2)

MODELS = {
    "llama": (LlamaForCausalLM, LlamaConfig(
        **COMMON, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64})),
    "llama-bias": (LlamaForCausalLM, LlamaConfig(
        **COMMON, attention_bias=True, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(
        **COMMON, tie_word_embeddings=True, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(
        **dict(COMMON, head_dim=16), tie_word_embeddings=False, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3-mha": (Qwen3ForCausalLM, Qwen3Config(
        **dict(COMMON, hidden_size=48, num_attention_heads=2, num_key_value_heads=2),
        tie_word_embeddings=True, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "qwen3-bias": (Qwen3ForCausalLM, Qwen3Config(
        **dict(COMMON, num_key_value_heads=1), attention_bias=True, tie_word_embeddings=False,
        use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "mistral-window": (MistralForCausalLM, MistralConfig(
        **COMMON, sliding_window=5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "qwen2-window": (Qwen2ForCausalLM, Qwen2Config(
        **COMMON, tie_word_embeddings=True, use_sliding_window=True, sliding_window=4,
        max_window_layers=1, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3-window": (Qwen3ForCausalLM, Qwen3Config(
        **dict(COMMON, head_dim=16), tie_word_embeddings=False, use_sliding_window=True,
        sliding_window=3, max_window_layers=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig(
        **dict(COMMON, head_dim=16, num_hidden_layers=3), query_pre_attn_scalar=24,
        sliding_window=4, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})),
    "gemma3-mha": (Gemma3ForCausalLM, Gemma3TextConfig(
        **dict(COMMON, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
               head_dim=16), query_pre_attn_scalar=10, sliding_window=3,
        sliding_window_pattern=2, tie_word_embeddings=False,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="tests/reference")
    args = parser.parse_args()
    torch.manual_seed(SEED)
    prompt = torch.randint(3, 259, (12,), generator=torch.Generator().manual_seed(SEED)).tolist()
    reference = {"generator": "tests/reference/transformers_models.py", "seed": SEED,
                 "torch": torch.__version__, "transformers": transformers.__version__,
                 "prompt": prompt, "models": {}}
    for name, (cls, config) in MODELS.items():
        model = cls(config).to(torch.float32).eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "norm" in pname:
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                else:
                    p.copy_(0.3 * torch.randn_like(p))
        folder = os.path.join(args.out, "transformers", name)
        shutil.rmtree(folder, ignore_errors=True)
        model.save_pretrained(folder)
        with torch.no_grad():
            ids = torch.tensor([prompt])
            logits = model(ids).logits[0]
            generated = model.generate(ids, attention_mask=torch.ones_like(ids),
                                       max_new_tokens=NEW_TOKENS, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)
        top2 = torch.topk(logits, 2, dim=-1).values
        reference["models"][name] = {
            "logits": [[round(float(v), 7) for v in row] for row in logits],
            "greedy": generated[0, len(prompt):].tolist(),
            "smallest_margin": float((top2[:, 0] - top2[:, 1]).min()),
        }
        print(name, sorted(os.listdir(folder)), "greedy", reference["models"][name]["greedy"])
    with open(os.path.join(args.out, "transformers_reference.json"), "w") as f:
        json.dump(reference, f)
        f.write("\n")


if __name__ == "__main__":
    main()
