#!/usr/bin/env python3
"""Dynamo's standalone KV indexer over two real kvcm nodes on loopback (docs/cluster.md,
"A worked example: two nodes and Dynamo's indexer").

    two_node_test.py --bin-dir BUILD_DIR/bin [--seed N] [--keep]

Makes a tiny model (kvcm-make-tiny-model), starts two kvcm-launch nodes (block size 16, each
its own run directory, HTTP port 0, --kv-events-endpoint and --kv-events-replay-endpoint on
tcp://127.0.0.1:0 on B, fixed free ports on A, which is restarted), reads each node's endpoints from its cache manager's log line, starts
`python -m dynamo.indexer` (tests/cluster/dynamo_indexer.py) and registers both before any
request, then checks:
  1. a long prompt through node A: A scores its full blocks, B nothing;
  2. the same prompt through node B: both score;
  3. many distinct prompts through A (a small pool): A's score for the first prompt drops;
  4. A's cache manager killed (SIGKILL; kvcm-launch restarts it): A is cleared, with the
     indexer still subscribed (no re-registration), and A's new blocks score again.
Every wait is bounded; the seed is printed; exit status 1 when a check fails.
"""

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dynamo_indexer import Indexer, Lines, free_port  # noqa: E402

BLOCK = 16
MODEL_NAME = "tiny"
TIMEOUT_S = 60


class Node:
    """One kvcm-launch stack; its output read line by line."""

    def __init__(self, name, bin_dir, model_dir, work_dir, num_blocks,
                 pub="tcp://127.0.0.1:0", replay="tcp://127.0.0.1:0", extra_args=()):
        self.name = name
        self.log_path = os.path.join(work_dir, f"launch-{name}.log")
        argv = [os.path.join(bin_dir, "kvcm-launch"), "--model", model_dir, "--threads", "1",
                "--block-size", str(BLOCK), "--num-blocks", str(num_blocks),
                "--run-dir", os.path.join(work_dir, f"run-{name}"), "--port", "0",
                "--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay,
                *extra_args]
        print(f"node {name}: {' '.join(argv)}", flush=True)
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, env=dict(os.environ, TMPDIR=work_dir))
        self.lines = Lines(self.process)
        self.cm_pid = None
        self.pub = self.replay = self.url = None

    def await_ready(self):
        """Reads the cache manager's pid and endpoints, then the launcher's ready line: the
        node answers a generation request from then on (docs/operations.md, "kvcm-launch").
        The router's own "ready http=" line comes earlier, before any executor registered."""
        while self.url is None or self.pub is None:
            line = self.lines.wait_for("", TIMEOUT_S)
            self._parse(line)

    def _parse(self, line):
        m = re.search(r"started cache-manager \(pid (\d+)\)", line)
        if m:
            self.cm_pid = int(m.group(1))
        m = re.search(r"vLLM-format KV events on (tcp://\S+) topic=\S* replay=(\S+)", line)
        if m:
            self.pub, self.replay = m.group(1), m.group(2)
        m = re.search(r"kvcm-launch: ready http=(\S+)", line)
        if m:
            self.url = m.group(1)

    def await_line(self, pattern, timeout_s=TIMEOUT_S):
        deadline = time.monotonic() + timeout_s
        while True:
            line = self.lines.wait_for("", max(deadline - time.monotonic(), 0.01))
            self._parse(line)
            if re.search(pattern, line):
                return line

    def post(self, path, body):
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return json.load(response)

    def generate(self, text):
        return self.post("/generate", {"inputs": text, "parameters": {"max_new_tokens": 2}})

    def tokenize(self, text):
        return [t["id"] for t in self.post("/tokenize", {"inputs": text})]

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def parse_args(doc, add_args=None):
    """The cluster scripts' common flags (--bin-dir, --seed, --keep) and `add_args`'s; prints
    the seed."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--bin-dir", required=True)
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    if add_args is not None:
        add_args(parser)
    args = parser.parse_args()
    print(f"seed {args.seed}", flush=True)
    return args


def make_work(args, prefix):
    """A fresh work directory and a tiny model in it (kvcm-make-tiny-model, args.seed)."""
    work = tempfile.mkdtemp(prefix=prefix)
    model = os.path.join(work, "tiny")
    subprocess.run([os.path.join(args.bin_dir, "kvcm-make-tiny-model"), f"--output={model}",
                    f"--seed={args.seed}"], check=True, timeout=TIMEOUT_S)
    return work, model


def finish(args, work, checks):
    """Removes the work directory (unless --keep), prints the tally; the exit status."""
    if args.keep:
        print(f"work directory {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    failed = checks.count(False)
    print(f"{len(checks) - failed} passed, {failed} failed", flush=True)
    return 1 if failed or not checks else 0


def prompt_text(rng, n):
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))


def prime(indexer, node, instance, rng):
    """Sends fresh prompts through `node` until the indexer scores one: its subscriber is
    connected (a PUB socket drops what it sends before that, and an event missed then comes
    back by replay only once a later one shows the gap). A condition, not a fixed wait."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        text = prompt_text(rng, 40)
        tokens = node.tokenize(text)
        want = {instance: len(tokens) // BLOCK * BLOCK}
        node.generate(text)
        if indexer.await_scores(tokens, MODEL_NAME, want, timeout_s=2) == want:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the indexer never scored a prompt through node {node.name}")


def main():
    args = parse_args(__doc__)
    rng = random.Random(args.seed)
    work, model = make_work(args, "kvcm-dyn-")
    nodes, indexer, checks = [], None, []

    def check(what, got, ok):
        checks.append(ok)
        print(f"{'PASS' if ok else 'FAIL'}: {what}: {got}", flush=True)

    try:
        # A's event ports fixed: a restarted cache manager binds them again, where the
        # indexer is subscribed (port 0 would pick new ones). B's picked by the node.
        a = Node("a", args.bin_dir, model, work, num_blocks=48,
                 pub=f"tcp://127.0.0.1:{free_port()}", replay=f"tcp://127.0.0.1:{free_port()}")
        b = Node("b", args.bin_dir, model, work, num_blocks=256)
        nodes = [a, b]
        for n in nodes:
            n.await_ready()
            print(f"node {n.name}: http={n.url} pub={n.pub} replay={n.replay} "
                  f"cache-manager pid {n.cm_pid}", flush=True)
        indexer = Indexer(BLOCK)
        for i, n in enumerate(nodes, start=1):
            indexer.register(i, n.pub, n.replay, MODEL_NAME)
        for i, n in enumerate(nodes, start=1):
            prime(indexer, n, i, rng)

        # 1. A long prompt through A: 6 full blocks (BOS and 100 bytes: 101 tokens).
        first = prompt_text(rng, 100)
        # /tokenize gives the prompt's ids as the cache holds them, the model's BOS
        # (config.json's bos_token_id) first.
        with open(os.path.join(model, "config.json")) as f:
            bos = json.load(f)["bos_token_id"]
        tokens = a.tokenize(first)
        check("/tokenize's ids begin with BOS", tokens[:1], tokens[:1] == [bos])
        full = len(tokens) // BLOCK * BLOCK
        print(f"prompt 1: {len(tokens)} tokens, {full // BLOCK} full blocks", flush=True)
        a.generate(first)
        got = indexer.await_scores(tokens, MODEL_NAME, {1: full})
        check("after A, A scores its full blocks, B none", got, got == {1: full})
        if got != {1: full}:
            print(f"query: {indexer.query_raw(tokens, MODEL_NAME)}\nindexer: "
                  f"{''.join(indexer.lines.seen[-40:])}", flush=True)
            drain = time.monotonic() + 1
            while time.monotonic() < drain:
                try:
                    indexer.lines.wait_for("\n", 0.2)
                except RuntimeError:
                    break
            print("".join(indexer.lines.seen[-40:]), flush=True)

        # 2. The same prompt through B: both.
        b.generate(first)
        got = indexer.await_scores(tokens, MODEL_NAME, {1: full, 2: full})
        check("after B, both score", got, got == {1: full, 2: full})

        # 3. Eviction on A: distinct prompts fill A's 48 blocks over and over.
        for _ in range(16):
            a.generate(prompt_text(rng, 100))
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            got = indexer.query(tokens, MODEL_NAME)
            if got.get(1, 0) < full or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        check("after 16 other prompts on A, A's score drops, B's stays", got,
              got.get(1, 0) < full and got.get(2) == full)

        # 4. A's cache manager SIGKILLed; kvcm-launch restarts it; A is cleared.
        a.generate(first)
        got = indexer.await_scores(tokens, MODEL_NAME, {1: full, 2: full})
        check("prompt 1 again through A scores A again", got, got == {1: full, 2: full})
        old = a.cm_pid
        os.kill(old, signal.SIGKILL)
        a.await_line(r"started cache-manager \(pid (\d+)\)")
        print(f"node a: cache manager {old} killed, restarted as {a.cm_pid}", flush=True)
        # The node answers again once its executor has attached the new pool and registered
        # with the router in the new epoch (until then a request may find no executor).
        a.await_line(r"\[executor-0\] .*registered with the router as executor")
        # The restarted cache manager goes on above the sequence numbers it sent before
        # (its run directory's vllm-events.seq), so Dynamo, still subscribed, applies its
        # AllBlocksCleared: A is cleared with no step of the operator's.
        got = indexer.await_scores(tokens, MODEL_NAME, {2: full})
        check("after A's restart, A is cleared, B stays", got, got == {2: full})
        fresh = prompt_text(rng, 100)
        fresh_tokens = a.tokenize(fresh)
        a.generate(fresh)
        got = indexer.await_scores(fresh_tokens, MODEL_NAME, {1: full})
        check("a new prompt through the restarted A scores A", got, got == {1: full})
        a.generate(first)
        got = indexer.await_scores(tokens, MODEL_NAME, {1: full, 2: full})
        check("the restarted A's new blocks score again", got, got == {1: full, 2: full})
    finally:
        if indexer is not None:
            indexer.stop()
        for n in nodes:
            n.stop()
    return finish(args, work, checks)


if __name__ == "__main__":
    sys.exit(main())
