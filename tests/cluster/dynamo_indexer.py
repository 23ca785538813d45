#!/usr/bin/env python3
"""NVIDIA Dynamo's standalone KV indexer (ai-dynamo-runtime, `python -m dynamo.indexer`) over
kvcm nodes' vLLM-format KV event endpoints, offline on loopback (docs/cluster.md).

    dynamo_indexer.py --block-size 16 --model-name M \
        --node 1=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558 --node 2=PUB,REPLAY \
        --query '[1, 2, 3, ...]'
        prints {"instance id": matched tokens} for each query, one JSON line each

    dynamo_indexer.py selftest
        two fake publishers (fake_publisher.py, a development aid, not kvcm): a prompt
        published on node 1 scores node 1 only, then on node 2 scores both.

Import Indexer for tests. Every wait is bounded; the indexer is stopped at exit.
Pitfalls (ai-dynamo-runtime 1.6.1): the indexer's HTTP server binds 0.0.0.0 whatever is
asked (there is no host option) and `--port 0` logs ":0" without the port it got, so a free
port is picked here first; /query counts tokens (matched blocks x block size), its "scores"
only the device tier (medium "GPU"): a shm-pool node's "CPU" blocks show only under
"instances" (query() reads those); a node whose events carry another block_size is dropped
with only a WARN; a subscriber recovers what it missed only when a later batch shows it a
gap, so events published before /register come back only after the node's next batch.
"""

import argparse
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import urllib.request

TIMEOUT_S = 30
# Dynamo's event plane and its siblings on loopback (nothing leaves this machine). 1.6.1
# reads DYN_TCP_RPC_HOST and DYN_TCP_RESPONSE_STREAM_HOST for the request plane and the
# response stream (not DYN_RPC_HOST or DYN_RESPONSE_HOST, which it ignores).
LOOPBACK_ENV = {
    "DYN_EVENT_PLANE_HOST": "127.0.0.1",
    "DYN_TCP_RPC_HOST": "127.0.0.1",
    "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
    "DYN_SYSTEM_HOST": "127.0.0.1",
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lines:
    """A process's output lines, read on a thread of their own (select on a buffered pipe
    misses lines already read into its buffer)."""

    def __init__(self, process):
        self.queue = queue.Queue()
        self.seen = []
        threading.Thread(target=self._read, args=(process.stdout,), daemon=True).start()

    def _read(self, stream):
        for line in stream:
            self.queue.put(line)
        self.queue.put(None)

    def wait_for(self, needle, timeout_s=TIMEOUT_S):
        """The next line holding needle; RuntimeError after timeout_s or at the end."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                line = self.queue.get(timeout=max(left, 0))
            except queue.Empty:
                line = None
            if line is None:
                raise RuntimeError(f"no line with {needle!r} in {timeout_s} s; output: "
                                   f"{''.join(self.seen)}")
            self.seen.append(line)
            if needle in line:
                return line


class Indexer:
    """One `python -m dynamo.indexer` process and its HTTP API."""

    def __init__(self, block_size, python=sys.executable):
        self.block_size = block_size
        self.port = free_port()
        env = dict(os.environ, **LOOPBACK_ENV, NO_COLOR="1")
        self.process = subprocess.Popen(
            [python, "-m", "dynamo.indexer", "--block-size", str(block_size),
             "--port", str(self.port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines = Lines(self.process)
        try:
            self.lines.wait_for("HTTP server listening")
        except BaseException:
            self.stop()
            raise
        self.url = f"http://127.0.0.1:{self.port}"

    def _post(self, path, body):
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return json.load(response)

    def register(self, instance_id, endpoint, replay_endpoint, model_name):
        reply = self._post("/register", {
            "instance_id": instance_id, "endpoint": endpoint,
            "replay_endpoint": replay_endpoint, "model_name": model_name,
            "block_size": self.block_size})
        if reply.get("status") != "ok":
            raise RuntimeError(f"register {instance_id}: {reply}")

    def unregister(self, instance_id, model_name):
        """Drops the node and what the index holds of it (a restarted node: see
        docs/cluster.md, "Pitfalls")."""
        reply = self._post("/unregister", {"instance_id": instance_id, "model_name": model_name})
        if reply.get("status") != "ok":
            raise RuntimeError(f"unregister {instance_id}: {reply}")

    def query_raw(self, token_ids, model_name):
        """/query's reply: {"scores": {id: {dp rank: tokens}} (the device tier only),
        "instances": {id: {"longest_matched", "gpu", "cpu", "disk", "dp"}}, ...}."""
        return self._post("/query", {"token_ids": token_ids, "model_name": model_name})

    def query(self, token_ids, model_name):
        """{instance id (int): longest matched prefix in tokens, any tier}; nodes without a
        match absent. Not "scores": those count the device tier only, and a kvcm node with a
        shm pool publishes medium "CPU" (the host tier)."""
        reply = self.query_raw(token_ids, model_name)
        return {int(i): t["longest_matched"] for i, t in reply.get("instances", {}).items()
                if t.get("longest_matched", 0) > 0}

    def await_scores(self, token_ids, model_name, want, timeout_s=TIMEOUT_S):
        """Queries until the scores are `want` (a dict as query returns); the last otherwise."""
        deadline = time.monotonic() + timeout_s
        scores = None
        while time.monotonic() < deadline:
            scores = self.query(token_ids, model_name)
            if scores == want:
                return scores
            time.sleep(0.1)
        return scores

    def stop(self):
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def selftest():
    here = os.path.dirname(os.path.abspath(__file__))
    prompt = list(range(1000, 1000 + 16 * 3 + 5))  # 3 full blocks and a partial one
    publishers, indexer = [], None
    try:
        for _ in range(2):
            p = subprocess.Popen(
                [sys.executable, os.path.join(here, "fake_publisher.py"), "--pub",
                 "tcp://127.0.0.1:0", "--replay", "tcp://127.0.0.1:0", "--block-size", "16"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            lines = Lines(p)
            line = lines.wait_for("ready pub=")
            pub, replay = (w.split("=", 1)[1] for w in line.split()[1:3])
            publishers.append((p, pub, replay, lines))
        indexer = Indexer(16)
        for i, (_, pub, replay, _) in enumerate(publishers, start=1):
            indexer.register(i, pub, replay, "m")
        # The indexer's SUB connects some time after /register, and a batch published
        # before is lost until a later one shows the gap: publish only once each publisher
        # has its subscription (a wait for that, not a guess at how long it takes).
        for _, _, _, lines in publishers:
            lines.wait_for("subscribed")
        checks = []
        for node, want in ((0, {1: 48}), (1, {1: 48, 2: 48})):
            p, _, _, lines = publishers[node]
            p.stdin.write(json.dumps(prompt) + "\n")
            p.stdin.flush()
            lines.wait_for("published")
            got = indexer.await_scores(prompt, "m", want)
            checks.append((want, got))
            print(f"selftest: after node {node + 1}: scores {got} (want {want})")
        failed = [c for c in checks if c[0] != c[1]]
        print(f"{len(checks) - len(failed)} passed, {len(failed)} failed")
        return 1 if failed else 0
    finally:
        if indexer is not None:
            indexer.stop()
        for p, _, _, _ in publishers:
            p.terminate()
            p.wait(timeout=10)


def main():
    if sys.argv[1:] == ["selftest"]:
        return selftest()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--model-name", required=True)
    parser.add_argument("--node", action="append", required=True,
                        help="ID=PUB_ENDPOINT,REPLAY_ENDPOINT (repeatable)")
    parser.add_argument("--query", action="append", default=[],
                        help="a JSON list of token ids (repeatable)")
    parser.add_argument("--settle-s", type=float, default=1.0,
                        help="wait after registering before the first query")
    args = parser.parse_args()
    indexer = Indexer(args.block_size)
    try:
        for node in args.node:
            instance, endpoints = node.split("=", 1)
            pub, replay = endpoints.split(",", 1)
            indexer.register(int(instance), pub, replay, args.model_name)
        time.sleep(args.settle_s)
        for q in args.query:
            print(json.dumps(indexer.query(json.loads(q), args.model_name)), flush=True)
    finally:
        indexer.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
