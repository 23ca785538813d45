"""Renders chat templates with Hugging Face transformers, the reference for common/chat.

Usage: render_reference.py CASES_JSON OUT_JSON
       render_reference.py --gguf-template GGUF OUT   (writes tokenizer.chat_template)

CASES_JSON: {"cases": [{"template": PATH, "messages": [...], "add_generation_prompt": bool,
             "bos_token": str, "eos_token": str, "extra": {...}}]}
OUT_JSON:   {"results": [{"ok": true, "text": str} |
                         {"ok": false, "type": exception class, "error": message}]}

Each case goes through transformers.utils.chat_template_utils.render_jinja_template (what
apply_chat_template(tokenize=False) calls), with the messages' null members dropped as
apply_chat_template drops them.
"""

import json
import sys

from transformers.utils.chat_template_utils import render_jinja_template


def render(case, templates):
    path = case["template"]
    if path not in templates:
        with open(path, "rb") as f:
            data = f.read()
        try:
            templates[path] = data.decode("utf-8")
        except UnicodeDecodeError as e:
            templates[path] = e
    if isinstance(templates[path], Exception):
        return {"ok": False, "type": "UnicodeDecodeError", "error": str(templates[path])}
    messages = [{k: v for k, v in m.items() if v is not None} for m in case["messages"]]
    kwargs = dict(case.get("extra", {}))
    tools = kwargs.pop("tools", None)
    documents = kwargs.pop("documents", None)
    try:
        rendered, _ = render_jinja_template(
            conversations=[messages],
            tools=tools,
            documents=documents,
            chat_template=templates[path],
            add_generation_prompt=case["add_generation_prompt"],
            bos_token=case["bos_token"],
            eos_token=case["eos_token"],
            **kwargs,
        )
        return {"ok": True, "text": rendered[0]}
    except Exception as e:  # every error is a result to compare
        return {"ok": False, "type": type(e).__name__, "error": str(e)}


def gguf_template(gguf_path, out_path):
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    field = reader.fields["tokenizer.chat_template"]
    with open(out_path, "w", encoding="utf-8", newline="") as f:
        f.write(bytes(field.parts[field.data[0]]).decode("utf-8"))


def main():
    if sys.argv[1] == "--gguf-template":
        gguf_template(sys.argv[2], sys.argv[3])
        return
    with open(sys.argv[1], encoding="utf-8") as f:
        cases = json.load(f)["cases"]
    templates = {}
    results = [render(case, templates) for case in cases]
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump({"results": results}, f, ensure_ascii=False)


if __name__ == "__main__":
    main()
