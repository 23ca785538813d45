#!/usr/bin/env python3
"""Drives a running kvcm-router with the official, unmodified Python clients.

Hugging Face's `text-generation` (Client.generate, generate_stream, with details) and
`openai` (completions.create and chat.completions.create, streaming and not; models.list),
installed from PyPI by
scripts/python-env.sh. Every call must succeed through the clients' own response models
(pydantic), which is what "works unchanged" means; what came back is printed as one JSON
object on the last line, and tests/services/router/official_clients_test.cc checks it
against the model run alone.

    build/venv/bin/python3 tests/clients/official_clients.py --url http://127.0.0.1:3000 \
        --prompt "Hello" --max-new-tokens 8 --too-long "$(printf 'x%.0s' {1..100})" \
        --chat "Hi"
"""

import argparse
import importlib.metadata
import json
import sys

import openai
import text_generation
from text_generation.errors import ValidationError


def tgi_calls(url, prompt, max_new_tokens, too_long):
    client = text_generation.Client(url, timeout=60)
    out = {}

    reply = client.generate(prompt, max_new_tokens=max_new_tokens, decoder_input_details=True,
                            top_n_tokens=2)
    details = reply.details
    out["generate"] = {
        "generated_text": reply.generated_text,
        "finish_reason": details.finish_reason.value,
        "generated_tokens": details.generated_tokens,
        "ids": [t.id for t in details.tokens],
        "logprobs": [t.logprob for t in details.tokens],
        "prefill_ids": [t.id for t in details.prefill],
        "prefill_logprobs": [t.logprob for t in details.prefill],
        "top_tokens": [[t.id for t in step] for step in (details.top_tokens or [])],
    }

    events = list(client.generate_stream(prompt, max_new_tokens=max_new_tokens))
    out["generate_stream"] = {
        "ids": [e.token.id for e in events],
        "logprobs": [e.token.logprob for e in events],
        "generated_text": events[-1].generated_text,
        "finish_reason": events[-1].details.finish_reason.value,
        "intermediate_texts_null": all(e.generated_text is None for e in events[:-1]),
    }

    sampled = [client.generate(prompt, do_sample=True, seed=42, temperature=0.8, top_p=0.9,
                               max_new_tokens=max_new_tokens) for _ in range(2)]
    out["sampled"] = {
        "ids": [[t.id for t in r.details.tokens] for r in sampled],
        "seeds": [r.details.seed for r in sampled],
    }

    best = client.generate(prompt, do_sample=True, best_of=2, max_new_tokens=max_new_tokens)
    out["best_of"] = {
        "generated_text": best.generated_text,
        "seed": best.details.seed,
        "others": [{"generated_text": o.generated_text, "seed": o.seed}
                   for o in (best.details.best_of_sequences or [])],
    }

    try:
        client.generate(too_long, max_new_tokens=2)
        out["too_long"] = {"raised": None}
    except ValidationError as error:
        out["too_long"] = {"raised": type(error).__name__, "message": str(error)}
    return out


def openai_calls(url, prompt, chat, max_new_tokens):
    client = openai.OpenAI(base_url=url + "/v1", api_key="kvcm-does-not-check", max_retries=0,
                           timeout=60)
    out = {}
    model = client.models.list().data[0].id
    out["model"] = model

    completions = []
    for _ in range(2):
        c = client.completions.create(model=model, prompt=prompt, max_tokens=max_new_tokens,
                                      temperature=0, logprobs=2)
        completions.append({
            "text": c.choices[0].text,
            "finish_reason": c.choices[0].finish_reason,
            "token_logprobs": c.choices[0].logprobs.token_logprobs,
            "top_logprobs": [len(t) for t in c.choices[0].logprobs.top_logprobs],
            "prompt_tokens": c.usage.prompt_tokens,
            "completion_tokens": c.usage.completion_tokens,
            "cached_tokens": c.usage.prompt_tokens_details.cached_tokens,
        })
    out["completions"] = completions

    text = ""
    usage = None
    for chunk in client.completions.create(model=model, prompt=prompt,
                                           max_tokens=max_new_tokens, temperature=0,
                                           stream=True,
                                           stream_options={"include_usage": True}):
        for choice in chunk.choices:
            text += choice.text
        if chunk.usage is not None:
            usage = chunk.usage
    out["completions_stream"] = {
        "text": text,
        "completion_tokens": usage.completion_tokens if usage else None,
        "cached_tokens": usage.prompt_tokens_details.cached_tokens if usage else None,
    }

    several = client.completions.create(model=model, prompt=prompt, max_tokens=max_new_tokens,
                                        temperature=0.8, seed=3, n=2)
    out["n"] = {"indices": [c.index for c in several.choices],
                "texts": [c.text for c in several.choices],
                "completion_tokens": several.usage.completion_tokens}

    messages = [{"role": "user", "content": chat}]
    reply = client.chat.completions.create(model=model, messages=messages,
                                           max_tokens=max_new_tokens, temperature=0)
    out["chat"] = {"content": reply.choices[0].message.content,
                   "role": reply.choices[0].message.role,
                   "finish_reason": reply.choices[0].finish_reason,
                   "prompt_tokens": reply.usage.prompt_tokens,
                   "completion_tokens": reply.usage.completion_tokens}
    content = ""
    roles = []
    usage = None
    for chunk in client.chat.completions.create(model=model, messages=messages,
                                                max_tokens=max_new_tokens, temperature=0,
                                                stream=True,
                                                stream_options={"include_usage": True}):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            if choice.delta.role:
                roles.append(choice.delta.role)
        if chunk.usage is not None:
            usage = chunk.usage
    out["chat_stream"] = {"content": content, "roles": roles,
                          "completion_tokens": usage.completion_tokens if usage else None}

    try:
        client.completions.create(model=model, prompt=prompt, max_tokens=2, n=99)
        out["bad_request"] = {"raised": None}
    except openai.BadRequestError as error:
        out["bad_request"] = {"raised": type(error).__name__, "status": error.status_code,
                              "param": (error.body or {}).get("param")}
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--too-long", required=True, help="a prompt over --max-input-tokens")
    parser.add_argument("--chat", required=True, help="a user message for chat completions")
    args = parser.parse_args()
    report = {
        "versions": {name: importlib.metadata.version(name)
                     for name in ("text-generation", "openai")},
        "tgi": tgi_calls(args.url, args.prompt, args.max_new_tokens, args.too_long),
        "openai": openai_calls(args.url, args.prompt, args.chat, args.max_new_tokens),
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
