#!/usr/bin/env python3
"""Reference outputs of the real models scripts/get-model.sh fetches (SmolLM2-135M-Instruct
as a Q4_1 GGUF; Gemma 3 270M as a Q4_K_M GGUF) from Hugging Face transformers, for
tests/services/executor/model/real_model_test.cc and tests/services/router/real_model_router_test.cc
to compare kvcm against.

transformers loads the GGUF itself (from_pretrained(..., gguf_file=...)): it dequantizes
every tensor with the gguf package, undoes the Q/K row order that GGUF conversion applies for
RoPE, and runs in float32. For each prompt this writes the prompt's token ids (transformers'
tokenizer, converted from the GGUF's own vocabulary), the greedy continuation, and the
logits of the last prompt position (the 64 largest, 64 at ids drawn with a fixed seed, and
the log-sum-exp of the whole row) and of every greedy step (the 8 largest), and what a server
answers: the greedy tokens before the first EOS and their text.

It needs torch, which the test suite does not install (the wheel is over 700 MB): the
outputs are committed as tests/reference/smollm2_reference.json and this script
regenerates them:

  python3 -m venv /some/venv && /some/venv/bin/pip install torch accelerate transformers==5.24.0 \\
      gguf==0.19.0 numpy
  /some/venv/bin/python3 tests/reference/real_model_reference.py \\
      --gguf "$(scripts/get-model.sh)" --out tests/reference/smollm2_reference.json
  /some/venv/bin/python3 tests/reference/real_model_reference.py --add-special-tokens \\
      --prompts plain,code,non_latin,window --gguf "$(scripts/get-model.sh gemma3-270m)" \\
      --out tests/reference/gemma3_270m_reference.json

SmolLM2 adds no BOS; Gemma's prompts start with <bos> (--add-special-tokens, as its
tokenizer.ggml.add_bos_token says). The Gemma 3 270M file is the base model and carries no
chat template, so its prompts are plain text; "long" is left out (the base model's greedy
answer to it is <eos> at once) and "window", the same text twice, is longer than its
512-token sliding window, so the window layers' attention and the cache's window release are
exercised.
"""

import argparse
import json
import os

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

SEED = 20261201
NEW_TOKENS = 24

LONG = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based inks and a wooden screw press into a "
    "system that could produce books at a scale no scribe could match. Before him, books "
    "in Europe were copied by hand, mostly in monasteries, and a single Bible could take a "
    "year to finish. Woodblock printing had been known in East Asia for centuries, and "
    "movable type made of ceramic and later of metal had been used in China and Korea, but "
    "the many characters of those scripts made it laborious. The Latin alphabet, with its "
    "few dozen letters, suited movable type far better. Within fifty years of Gutenberg's "
    "first Bible, presses were at work in more than two hundred European cities, and "
    "millions of books had been printed. Prices fell, literacy rose, and ideas travelled "
    "faster than ever before: the Reformation, the scientific revolution and the rise of "
    "newspapers all depended on cheap print. Printers also standardised spelling and "
    "grammar, since a single edition reached readers across a whole region. Over the "
    "following centuries the press itself changed: iron frames replaced wood, steam power "
    "replaced muscle, and rotary presses printed on continuous rolls of paper. In the "
    "twentieth century offset lithography and then digital printing took over, yet the "
    "basic idea of composing a page from reusable pieces of type survives in every font on "
    "a computer screen. Historians still debate how much of the change was caused by the "
    "press alone and how much by the economic and religious currents of the time. Some "
    "argue that the press merely sped up changes already under way, pointing to the growth "
    "of universities, trade fairs and paper mills in the century before Gutenberg; others "
    "hold that the sudden abundance of identical copies made possible a new kind of "
    "scholarship, in which readers in distant cities could compare the same page, cite it "
    "precisely and correct its errors in later editions. Either way, the printed book became "
    "the model for how knowledge was stored and shared for the next five hundred years. "
    "Write a short summary of this text:"
)

PROMPTS = {
    "plain": {"text": "The capital of France is"},
    "chat": {"chat": [{"role": "user", "content": "What is the capital of France?"}]},
    "chat_system": {
        "chat": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Name three primary colours."},
            {"role": "assistant", "content": "Red, yellow, blue."},
            {"role": "user", "content": "And secondary ones?"},
        ]
    },
    "code": {"text": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"},
    "non_latin": {"text": "Москва — столица России. 北京是中国的首都。東京は"},
    "long": {"text": LONG},
    "window": {"text": LONG + " " + LONG},
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--prompts", default="plain,chat,chat_system,code,non_latin,long",
                        help="comma-separated names from PROMPTS")
    parser.add_argument("--add-special-tokens", action="store_true",
                        help="encode prompts with the tokenizer's BOS")
    args = parser.parse_args()
    names = args.prompts.split(",")

    folder, name = os.path.split(os.path.abspath(args.gguf))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    rng = np.random.default_rng(SEED)
    vocab = model.config.vocab_size

    out = {
        "generator": "tests/reference/real_model_reference.py",
        "gguf": name,
        "seed": SEED,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "new_tokens": NEW_TOKENS,
        "prompts": [],
    }
    for key in names:
        spec = PROMPTS[key]
        if "chat" in spec:
            text = tokenizer.apply_chat_template(
                spec["chat"], add_generation_prompt=True, tokenize=False)
        else:
            text = spec["text"]
        ids = tokenizer(text, add_special_tokens=args.add_special_tokens)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double().numpy()
            # An explicit attention mask: without one, generate() masks every prompt token
            # equal to the pad id, and a chat prompt holds <|im_end|>, which is also EOS.
            generated = model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NEW_TOKENS, do_sample=False,
                output_logits=True, return_dict_in_generate=True, eos_token_id=None,
                pad_token_id=tokenizer.eos_token_id)
        new = generated.sequences[0, len(ids):].tolist()
        top = np.argsort(-logits, kind="stable")[:64]
        sampled = rng.choice(vocab, size=64, replace=False)
        steps = []
        for step_logits in generated.logits:
            row = step_logits[0].double().numpy()
            best = np.argsort(-row, kind="stable")[:8]
            steps.append({"ids": best.tolist(), "logits": row[best].tolist()})
        # What a server answers: the tokens before the first EOS, decoded without specials.
        eos = tokenizer.eos_token_id
        answer = new[:new.index(eos)] if eos in new else new
        lse = float(np.log(np.sum(np.exp(logits - logits.max()))) + logits.max())
        out["prompts"].append({
            "name": key,
            "text": text,
            "chat": spec.get("chat"),
            "prompt_ids": ids,
            "greedy": new,
            "answer_ids": answer,
            "answer_text": tokenizer.decode(answer, skip_special_tokens=True),
            "answer_ends_at_eos": eos in new,
            "last_top_ids": top.tolist(),
            "last_top_logits": logits[top].tolist(),
            "last_sampled_ids": sampled.tolist(),
            "last_sampled_logits": logits[sampled].tolist(),
            "last_logsumexp": lse,
            "steps": steps,
        })
        print(f"{key}: {len(ids)} prompt tokens, greedy {tokenizer.decode(new)!r}")
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
