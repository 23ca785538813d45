#!/usr/bin/env python3
"""Token ids of a GGUF file's own tokenizer as Hugging Face transformers builds it from the
file (AutoTokenizer.from_pretrained(..., gguf_file=...)), for a fixed set of texts: what
tests/common/tokenizer/gguf_model_tokens_test.cc compares kvcm's GGUF tokenizer against.

Needs transformers, gguf and sentencepiece (no torch); the output is committed:

  /some/venv/bin/pip install transformers==5.24.0 gguf==0.19.0 sentencepiece protobuf
  /some/venv/bin/python3 tests/reference/gguf_tokens_reference.py \\
      --gguf "$(scripts/get-model.sh gemma3-270m)" --out tests/reference/gemma3_270m_tokens.json
"""

import argparse
import json
import os

from transformers import AutoTokenizer

TEXTS = [
    "The capital of France is",
    "Hello, world!",
    " leading space",
    "  two leading spaces",
    "trailing space ",
    "a  b   c    d     e",
    "tabs\tand\t\ttabs",
    "line one\nline two\n\nline four\n\n\n",
    "\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n",
    " " * 40 + "forty spaces",
    "def f(x):\n    return x * 2\n\n\nclass A:\n        pass\n",
    "<table><caption>html</caption><thead></thead></table>",
    "<h2>Title</h2>\n<p>Paragraph</p>",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after a bos",
    "Москва — столица России.",
    "北京是中国的首都。東京は日本の首都です。",
    "emoji: 🙂🚀👩‍👩‍👧 and ©®™",
    "mixed ▁ lower one eighth block ▁▁",
    "numbers 1234567890 3.14159 -42 1e10",
    "\u00e9\u0301 combining, \u200b zero width, \u00a0 no-break space",
    "rare bytes \x01\x02\x7f",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "",
]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    folder, name = os.path.split(os.path.abspath(args.gguf))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    out = {
        "generator": "tests/reference/gguf_tokens_reference.py",
        "gguf": name,
        "transformers": __import__("transformers").__version__,
        "cases": [],
    }
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out["cases"].append({
            "text": text,
            "ids": ids,
            "decoded": tokenizer.decode(ids, skip_special_tokens=True),
        })
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
