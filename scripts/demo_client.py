#!/usr/bin/env python3
"""The demo's client: real HTTP requests to kvcm-router, standard library only.

  demo_client.py URL [--kill-pid PID]

Sends concurrent requests that share a long system prompt, through TGI's /generate (one of
them streaming, printed as it arrives) and OpenAI's /v1/chat/completions, optionally kills
an executor (SIGKILL) at the streaming request's first token, while they generate (and fails
if none was generating then), and prints each answer, time to first token,
tokens/s and the router's prefix-cache figures. The TGI requests carry the conversation in
the model's chat format (ChatML, as SmolLM2's template writes it), so that both APIs share
the system prompt's blocks.
"""
import argparse
import json
import os
import signal
import sys
import threading
import time
import urllib.request

SYSTEM = ("You are a helpful assistant who answers in one or two short sentences, plainly "
          "and without lists. The user asks general questions about the world, science and "
          "everyday life.")
QUESTIONS = ["What is the capital of France?", "Why is the sky blue?",
             "What do bees make?", "What is the largest planet?",
             "How many legs does a spider have?",
             "What is the boiling point of water?"]
MAX_NEW_TOKENS = 48


def chatml(question):
    """The conversation as SmolLM2's chat template renders it (add_generation_prompt)."""
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
            "<|im_start|>assistant\n")


def post(url, body, timeout=120):
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=timeout)


def generate(url, question, results, index):
    start = time.monotonic()
    body = {"inputs": chatml(question),
            "parameters": {"max_new_tokens": MAX_NEW_TOKENS, "details": True}}
    with post(url + "/generate", body) as reply:
        answer = json.load(reply)
    elapsed = time.monotonic() - start
    results[index] = (question, answer["generated_text"],
                      answer["details"]["generated_tokens"], elapsed)


def chat(url, question, results, index):
    """The same through OpenAI's chat completions API (the router renders the template)."""
    start = time.monotonic()
    body = {"model": "demo", "max_tokens": MAX_NEW_TOKENS, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": question}]}
    with post(url + "/v1/chat/completions", body) as reply:
        answer = json.load(reply)
    elapsed = time.monotonic() - start
    usage = answer["usage"]
    results[index] = (question + " [openai]", answer["choices"][0]["message"]["content"],
                      usage["completion_tokens"], elapsed)


def stream(url, question, results, index, first_token=None):
    """Prints the answer as it arrives; sets first_token (a threading.Event) at its first."""
    start = time.monotonic()
    first = None
    tokens = 0
    text = ""
    body = {"inputs": chatml(question), "parameters": {"max_new_tokens": MAX_NEW_TOKENS}}
    print(f"  streaming {question!r}: ", end="", flush=True)
    with post(url + "/generate_stream", body) as reply:
        for raw in reply:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if first is None:
                first = time.monotonic() - start
                if first_token is not None:
                    first_token.set()
            tokens += 1
            piece = event["token"]["text"]
            text += piece
            print(repr(piece)[1:-1], end="", flush=True)
    print()
    results[index] = (question, text, tokens, time.monotonic() - start, first)


def metric(url, name, labels=""):
    with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name + labels + " ") or line.startswith(name + "{" + labels):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--kill-pid", type=int, default=0)
    args = parser.parse_args()
    url = args.url

    results = [None] * len(QUESTIONS)
    # One request first: its prompt's blocks are committed and cached for the others.
    generate(url, QUESTIONS[0], results, 0)
    first_token = threading.Event()
    threads = [threading.Thread(target=stream, args=(url, QUESTIONS[1], results, 1, first_token))]
    # The others through both APIs: TGI's /generate and OpenAI's /v1/chat/completions.
    threads += [threading.Thread(target=generate if i % 2 == 0 else chat,
                                 args=(url, q, results, i))
                for i, q in enumerate(QUESTIONS) if i >= 2]
    started = time.monotonic()
    for t in threads:
        t.start()
    generating = None
    if args.kill_pid:
        # At the streaming request's first token: every request has been sent, and that one
        # has its other tokens still to come, so the kill lands mid-generation by design.
        if not first_token.wait(timeout=120):
            print("  the streaming request produced no token in 120 s", file=sys.stderr)
            return 1
        os.kill(args.kill_pid, signal.SIGKILL)
        generating = sum(t.is_alive() for t in threads)
        print(f"\n  killed executor pid {args.kill_pid} with SIGKILL while "
              f"{generating} requests were generating")
    for t in threads:
        t.join()
    wall = time.monotonic() - started

    print()
    print("Answers:")
    total_tokens = 0
    for result in results:
        question, text, tokens, elapsed = result[:4]
        total_tokens += tokens
        print(f"  {question:<44} {tokens:3d} tokens in {elapsed * 1000:7.1f} ms: "
              f"{text.strip()[:100]!r}")
    if results[1] is not None and results[1][4] is not None:
        print(f"  time to first token (streaming request): {results[1][4] * 1000:.1f} ms")
    print(f"  {total_tokens - results[0][2]} tokens from {len(threads)} concurrent requests in "
          f"{wall:.2f} s: {(total_tokens - results[0][2]) / wall:.0f} tokens/s (two executors of one "
          f"CPU thread each, one of them killed)")
    cached = metric(url, "kvcm_router_prompt_tokens_total", 'source="cached"')
    computed = metric(url, "kvcm_router_prompt_tokens_total", 'source="computed"')
    if cached + computed > 0:
        print(f"  prefix cache: {cached:.0f} of {cached + computed:.0f} prompt tokens were "
              f"cached ({100 * cached / (cached + computed):.0f}% hit ratio)")
    ok = (metric(url, "kvcm_router_requests_total", 'api="tgi",outcome="ok"') +
          metric(url, "kvcm_router_requests_total", 'api="openai",outcome="ok"'))
    recomputed = metric(url, "kvcm_router_recomputed_committed_tokens_total")
    print(f"  requests ok: {ok:.0f}; recomputed committed tokens: {recomputed:.0f}")
    if generating == 0:
        print("demo: the executor was killed after every request had finished", file=sys.stderr)
        return 1
    return 0 if all(r is not None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
