#!/usr/bin/env python3
"""A stand-in for one node's vLLM-format KV event publisher, for developing the cluster
scripts before the cache manager's own publisher (--kv-events-endpoint) is wired in. Never a
substitute for it in a test of kvcm.

Binds a PUB (an XPUB: frames [topic, seq 8 bytes big-endian from 0, msgpack [ts, [events],
0]]) and a ROUTER replay socket (request [identity, "", start seq]; one [identity, "", topic,
seq, payload] per buffered batch from start, then [identity, "", "", -1, ""]), as vLLM 0.33.0
and the cache manager's publisher do. The first batch is AllBlocksCleared; then one BlockStored
batch per prompt on stdin (a JSON list of token ids a line), full blocks only, ids the low 64
bits of a counter-based hash (any unique 64-bit ids do: consumers recompute their keys from
the tokens). Prints "ready pub=... replay=...", then "subscribed" for each subscription the PUB
receives (so that a test publishes only once its subscriber is connected: a PUB drops what
it sends before), and runs until stdin closes or SIGTERM.

    fake_publisher.py --pub tcp://127.0.0.1:0 --replay tcp://127.0.0.1:0 --block-size 16
"""

import argparse
import hashlib
import json
import select
import struct
import sys
import time

import msgpack
import zmq


def block_id(parent, tokens):
    digest = hashlib.sha256(struct.pack(f"<Q{len(tokens)}I", parent or 0, *tokens)).digest()
    return int.from_bytes(digest[-8:], "big")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pub", required=True)
    parser.add_argument("--replay", required=True)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--topic", default="kv@fake@model")
    args = parser.parse_args()

    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.bind(args.pub)
    replay = ctx.socket(zmq.ROUTER)
    replay.bind(args.replay)
    print(f"ready pub={pub.getsockopt_string(zmq.LAST_ENDPOINT)} "
          f"replay={replay.getsockopt_string(zmq.LAST_ENDPOINT)}", flush=True)

    topic = args.topic.encode()
    batches = []  # (seq, payload)

    def publish(events):
        seq = len(batches)
        payload = msgpack.packb([time.time(), events, 0])
        batches.append((seq, payload))
        pub.send_multipart([topic, struct.pack(">q", seq), payload])

    publish([{"type": "AllBlocksCleared"}])
    poller = zmq.Poller()
    poller.register(replay, zmq.POLLIN)
    poller.register(pub, zmq.POLLIN)
    def answer_replays(timeout_ms):
        for sock, _ in poller.poll(timeout=timeout_ms):
            if sock is pub:
                # [0x01 topic prefix] subscribes, [0x00 ...] unsubscribes.
                if sock.recv()[:1] == b"\x01":
                    print("subscribed", flush=True)
                continue
            identity, _empty, start = sock.recv_multipart()
            (first,) = struct.unpack(">q", start)
            for seq, payload in batches:
                if seq >= first:
                    sock.send_multipart([identity, b"", topic, struct.pack(">q", seq), payload])
            sock.send_multipart([identity, b"", b"", struct.pack(">q", -1), b""])

    while True:
        answer_replays(50)
        ready, _, _ = select.select([sys.stdin], [], [], 0)
        if not ready:
            continue
        line = sys.stdin.readline()
        if not line:
            break
        tokens = json.loads(line)
        full = len(tokens) // args.block_size * args.block_size
        parent, hashes = None, []
        for i in range(0, full, args.block_size):
            parent = block_id(parent, tokens[i:i + args.block_size])
            hashes.append(parent)
        if hashes:
            publish([{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                      "token_ids": tokens[:full], "block_size": args.block_size,
                      "lora_id": None, "medium": "GPU", "lora_name": None}])
        print(f"published {len(hashes)} block(s)", flush=True)
    # stdin closed: keep answering replay requests until SIGTERM.
    while True:
        answer_replays(1000)


if __name__ == "__main__":
    main()
