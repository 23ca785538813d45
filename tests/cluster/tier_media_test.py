#!/usr/bin/env python3
"""Dynamo's standalone KV indexer over a kvcm node with a host tier and a disk tier: the
vLLM-format events name the medium each block is in (docs/cluster.md, "Tiers").

    tier_media_test.py --bin-dir BUILD_DIR/bin [--seed N] [--keep]

One kvcm-launch node (tests/cluster/two_node_test.py's Node) with a tiny model, a shm pool of
48 blocks, a host tier and a disk tier, its vLLM-format events on fixed loopback ports, and
`python -m dynamo.indexer` subscribed to them. Dynamo counts a node's match per tier
(instances[id]: "gpu", "cpu", "disk"; a tier's count includes the tiers above it). Checks:
  1. a long prompt: its full blocks are in the pool and the host tier (both "CPU") and on
     disk ("DISK");
  2. 16 other prompts evict it from the pool: the host tier still holds it, so the node
     still announces it in "CPU" (before, a pool eviction removed it for the whole node);
  3. the cache manager SIGKILLed (kvcm-launch restarts it): the host tier is gone with it,
     the disk tier's blocks are recovered and announced in "DISK" alone;
  4. the prompt again: loaded from disk into the pool, "CPU" again, and its greedy tokens
     unchanged.
Every wait is bounded; the seed is printed; exit status 1 when a check fails.
"""

import os
import random
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dynamo_indexer import Indexer, free_port  # noqa: E402
from two_node_test import (BLOCK, MODEL_NAME, TIMEOUT_S, Node, finish, make_work,  # noqa: E402
                           parse_args, prime, prompt_text)


def tiers(indexer, tokens):
    """(cpu, disk) matched tokens of instance 1: Dynamo's host and disk tiers."""
    instance = indexer.query_raw(tokens, MODEL_NAME).get("instances", {}).get("1", {})
    return instance.get("cpu", 0), instance.get("disk", 0)


def await_tiers(indexer, tokens, want):
    """Queries until tiers() is `want`; the last otherwise."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        got = tiers(indexer, tokens)
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def main():
    args = parse_args(__doc__)
    rng = random.Random(args.seed)
    work, model = make_work(args, "kvcm-tier-media-")
    node, indexer, checks = None, None, []

    def check(what, got, ok):
        checks.append(ok)
        print(f"{'PASS' if ok else 'FAIL'}: {what}: {got}", flush=True)

    try:
        # Fixed event ports: the restarted cache manager binds them again, where the indexer
        # is subscribed. The host tier holds every prompt of the test; the pool does not.
        node = Node("a", args.bin_dir, model, work, num_blocks=48,
                    pub=f"tcp://127.0.0.1:{free_port()}",
                    replay=f"tcp://127.0.0.1:{free_port()}",
                    extra_args=["--host-tier-bytes", "64MiB",
                                "--disk-tier-dir", os.path.join(work, "disk-tier"),
                                "--disk-tier-bytes", "64MiB"])
        node.await_ready()
        indexer = Indexer(BLOCK)
        indexer.register(1, node.pub, node.replay, MODEL_NAME)
        prime(indexer, node, 1, rng)

        # 1. A long prompt (BOS and 100 bytes: 6 full blocks).
        text = prompt_text(rng, 100)
        tokens = node.tokenize(text)
        full = len(tokens) // BLOCK * BLOCK
        first = node.generate(text)["generated_text"]
        got = await_tiers(indexer, tokens, (full, full))
        check("a prompt's blocks are announced in CPU (pool, host tier) and DISK", got,
              got == (full, full))

        # 2. Evicted from the 48-block pool by 16 other prompts; the host tier keeps it.
        for _ in range(16):
            node.generate(prompt_text(rng, 100))
        got = await_tiers(indexer, tokens, (full, full))
        check("evicted from the pool, still announced in CPU: the host tier holds it", got,
              got == (full, full))

        # 3. The cache manager killed: its host tier with it; the disk tier recovered.
        old = node.cm_pid
        os.kill(old, signal.SIGKILL)
        node.await_line(r"started cache-manager \(pid (\d+)\)")
        print(f"cache manager {old} killed, restarted as {node.cm_pid}", flush=True)
        node.await_line(r"\[executor-0\] .*registered with the router as executor")
        got = await_tiers(indexer, tokens, (0, full))
        check("after the restart, announced in DISK alone", got, got == (0, full))

        # 4. The prompt again: loaded from disk into the pool ("CPU"), the same tokens.
        again = node.generate(text)["generated_text"]
        check("the same greedy tokens from the blocks loaded from disk", repr(again), again == first)
        got = await_tiers(indexer, tokens, (full, full))
        check("loaded into the pool, announced in CPU again", got, got == (full, full))
    finally:
        if indexer is not None:
            indexer.stop()
        if node is not None:
            node.stop()
    return finish(args, work, checks)


if __name__ == "__main__":
    sys.exit(main())
