#!/usr/bin/env python3
"""NVIDIA Dynamo's in-process KV router (`KvRouter.best_worker()`, ai-dynamo-runtime 1.6.1) over
two real kvcm nodes on loopback (docs/cluster.md, "Dynamo's KvRouter in process").

    kv_router_test.py --bin-dir BUILD_DIR/bin [--seed N] [--keep] [--dynamo-log info]

Makes a tiny model (kvcm-make-tiny-model), starts two kvcm-launch nodes (two_node_test.py's
Node: block size 16, HTTP port 0, vLLM-format KV events on tcp://127.0.0.1:0), then in this
process three Dynamo DistributedRuntimes (file discovery in the work directory, TCP request
plane, ZMQ event plane through a loopback broker): one per node, each serving a stand-in
endpoint, registering the model and relaying its node's PUB with a KvEventPublisher, and one
for the KvRouter. Then checks:
  1. a long prompt through node A's /generate: best_worker() picks A's worker, and
     get_overlap_scores() has A holding the prompt's full blocks (host tier: a shm pool's
     medium CPU), B none;
  2. the same prompt through B: both hold it;
  3. another prompt through B only: best_worker() picks B, A holds none of it;
  4. every socket this process listens on is on 127.0.0.1.
Every wait is bounded; the seed and every score are printed; exit status 1 when a check fails.
"""

import asyncio
import json
import os
import random
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from two_node_test import (BLOCK, MODEL_NAME, TIMEOUT_S, Node, finish, make_work,  # noqa: E402
                           parse_args, prompt_text)

NAMESPACE_PATH = "kvcm.node.generate"  # Dynamo's namespace.component.endpoint of the workers


def loopback_env(discovery_dir, broker):
    """What Dynamo 1.6.1 reads to keep every socket on loopback. DYN_TCP_RPC_HOST and
    DYN_TCP_RESPONSE_STREAM_HOST are the request plane's and response stream's hosts (1.6.1
    reads no DYN_RPC_HOST or DYN_RESPONSE_HOST: with those alone both bind the machine's
    address). An event-plane publisher in direct mode binds tcp://0.0.0.0:0 whatever
    DYN_EVENT_PLANE_HOST says (that only sets the address it advertises), so the event plane
    runs in broker mode: every publisher connects to the broker's XSUB, every subscriber to
    its XPUB, and the broker binds loopback."""
    return {
        "DYN_FILE_KV": discovery_dir,
        "DYN_ZMQ_BROKER_URL": f"xsub={broker.xsub} , xpub={broker.xpub}",
        "DYN_EVENT_PLANE_HOST": "127.0.0.1",
        "DYN_TCP_RPC_HOST": "127.0.0.1",
        "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
        "DYN_SYSTEM_HOST": "127.0.0.1",
    }


class Broker:
    """Dynamo's ZMQ event-plane broker: an XSUB/XPUB forwarder on loopback (frames pass
    unchanged); a thread of this process."""

    def __init__(self):
        import zmq
        self._zmq = zmq
        self.context = zmq.Context()
        self._xsub = self.context.socket(zmq.XSUB)
        self._xsub.bind("tcp://127.0.0.1:0")
        self._xpub = self.context.socket(zmq.XPUB)
        self._xpub.bind("tcp://127.0.0.1:0")
        self.xsub = self._xsub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.xpub = self._xpub.getsockopt_string(zmq.LAST_ENDPOINT)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        try:
            self._zmq.proxy(self._xsub, self._xpub)
        except self._zmq.ZMQError:
            pass  # stop() closed the sockets

    def stop(self):
        self.context.destroy(linger=0)


async def stand_in_generate(request):
    """The workers' endpoint. best_worker() only picks among served, registered instances
    ("no endpoints available to route work" otherwise); it sends nothing here, and the test
    checks only which worker it picks: the kvcm nodes serve the requests over HTTP."""
    yield {"token_ids": [], "finish_reason": "stop"}


class Worker:
    """One kvcm node as Dynamo sees it: a DistributedRuntime of its own (a worker's id is its
    runtime's connection id, so two workers need two runtimes), a served endpoint, the model
    registered on it, and a KvEventPublisher relaying the node's vLLM-format PUB into Dynamo's
    event plane."""

    def __init__(self, node):
        self.node = node
        self.runtime = self.endpoint = self.publisher = self.serving = None
        self.id = None

    async def start(self, loop, model_dir):
        from dynamo.llm import (KvEventPublisher, ModelInput, ModelType, WorkerType,
                                register_model)
        from dynamo.runtime import DistributedRuntime
        self.runtime = DistributedRuntime(loop, "file", "tcp", event_plane="zmq")
        self.endpoint = self.runtime.endpoint(NAMESPACE_PATH)
        self.serving = asyncio.ensure_future(self.endpoint.serve_endpoint(stand_in_generate))
        await asyncio.wait_for(
            register_model(ModelInput.Tokens, ModelType.Completions, self.endpoint, model_dir,
                           MODEL_NAME, worker_type=WorkerType.Aggregated,
                           kv_cache_block_size=BLOCK, skip_model_assets=True), TIMEOUT_S)
        self.publisher = KvEventPublisher(self.endpoint, kv_block_size=BLOCK,
                                          zmq_endpoint=self.node.pub)
        self.id = self.endpoint.connection_id()
        print(f"node {self.node.name}: Dynamo worker {self.id} relays {self.node.pub}",
              flush=True)

    async def stop(self):
        if self.runtime is not None:
            self.runtime.shutdown()
        if self.serving is not None:
            try:
                await asyncio.wait_for(self.serving, 10)
            except (Exception, asyncio.CancelledError) as e:
                print(f"node {self.node.name}: serve_endpoint ended: {e!r}", flush=True)


async def route(router, workers, tokens):
    """best_worker() (query only: no request id, so the router's state is untouched) between
    two get_overlap_scores(), as {"pick": node name, "credit": best_worker's overlap blocks,
    "tiers": {node: (device, host, disk) blocks}, "settled": both overlap queries agree, so
    best_worker saw the same index}. A kvcm shm pool publishes medium CPU, Dynamo's host tier
    (a tier's count includes the tiers above it); best_worker's count is such blocks times
    KvRouterConfig's host_cache_hit_weight (0.75), rounded."""
    by_id = {w.id: w.node.name for w in workers}

    async def tiers():
        scores = await asyncio.wait_for(router.get_overlap_scores(tokens), TIMEOUT_S)
        return {by_id.get(r["worker_id"], r["worker_id"]):
                (r["device_blocks"], r["host_pinned_blocks"], r["disk_blocks"])
                for r in scores["workers"]}

    before = await tiers()
    worker_id, _dp_rank, credit = await asyncio.wait_for(router.best_worker(tokens), TIMEOUT_S)
    after = await tiers()
    return {"pick": by_id.get(worker_id, worker_id), "credit": credit, "tiers": after,
            "settled": before == after}


def listening_addresses():
    """The local addresses of this process's listening TCP sockets (Linux /proc)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        with open(f"/proc/self/net/{table}") as f:
            for row in f.readlines()[1:]:
                fields = row.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                    continue
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                if width == 8:
                    host_ip = ".".join(str(b) for b in reversed(raw))
                else:  # four little-endian 32-bit words
                    words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]
                    host_ip = ":".join(w.hex() for w in words)
                found.append(f"{host_ip}:{int(port, 16)}")
    return sorted(found)


def host(blocks):
    """A tier triple for blocks held in a kvcm shm pool (medium CPU)."""
    return (0, blocks, blocks)


async def await_tiers(router, workers, tokens, want, timeout_s=TIMEOUT_S):
    """Routes until the tiers are want's ({node: (device, host, disk)}) before and after
    best_worker; the last result otherwise."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        got = await route(router, workers, tokens)
        if (got["tiers"] == want and got["settled"]) or loop.time() > deadline:
            return got
        await asyncio.sleep(0.1)


async def run(args, model, a, b, checks):
    from dynamo.llm import KvRouter, KvRouterConfig
    from dynamo.runtime import DistributedRuntime
    loop = asyncio.get_running_loop()
    nodes = [a, b]
    workers = [Worker(n) for n in nodes]
    router_runtime = None

    def check(what, got, ok):
        checks.append(ok)
        print(f"{'PASS' if ok else 'FAIL'}: {what}: {got}", flush=True)

    with open(os.path.join(model, "config.json")) as f:
        bos = json.load(f)["bos_token_id"]

    def tokens_of(node, text):
        # Dynamo recomputes its block keys from the token ids the events carry: a request's
        # prompt, which begins with the model's BOS, as /tokenize's ids do.
        ids = node.tokenize(text)
        if not ids or ids[0] != bos:
            raise RuntimeError(f"/tokenize's ids do not begin with BOS {bos}: {ids[:4]}")
        return ids

    try:
        for w in workers:
            await w.start(loop, model)
        router_runtime = DistributedRuntime(loop, "file", "tcp", event_plane="zmq")
        router = KvRouter(router_runtime.endpoint(NAMESPACE_PATH), BLOCK, KvRouterConfig())
        rng = random.Random(args.seed)
        none = {n.name: host(0) for n in nodes}

        # Warm-up: throwaway prompts per node until the router sees one. The relay's SUB and
        # the router's subscription to the broker connect some time after they are made, and
        # a batch published before misses them for good (KvEventPublisher has no replay): a
        # fresh prompt every 2 s, and any prompt sent so far that the router sees ends it.
        # How long that takes is up to the machine: the bound is generous.
        for n in nodes:
            sent, got, seen = [], None, False
            want = dict(none, **{n.name: host(2)})
            deadline = loop.time() + TIMEOUT_S
            while not seen and loop.time() < deadline:
                text = prompt_text(rng, 40)
                n.generate(text)
                sent.append(tokens_of(n, text))
                next_prompt = loop.time() + 2
                while not seen and loop.time() < min(next_prompt, deadline):
                    for tokens in sent:
                        got = await route(router, workers, tokens)
                        seen = got["tiers"] == want and got["settled"]
                        if seen:
                            break
                    if not seen:
                        await asyncio.sleep(0.1)
            print(f"warm-up on {n.name}: seen after {len(sent)} prompt(s): {got}", flush=True)
            if not seen:
                check(f"node {n.name}'s events reach the router", got, False)
                return

        # 1. A long prompt through A: 6 full blocks (BOS and 100 bytes: 101 tokens).
        first = prompt_text(rng, 100)
        tokens = tokens_of(a, first)
        full = len(tokens) // BLOCK
        print(f"prompt 1: {len(tokens)} tokens, {full} full blocks", flush=True)
        print(f"before any request: {await route(router, workers, tokens)}", flush=True)
        a.generate(first)
        got = await await_tiers(router, workers, tokens, {"a": host(full), "b": host(0)})
        check("after A, best_worker picks A; A holds the full blocks, B none", got,
              got["settled"] and got["pick"] == "a" and 0 < got["credit"] <= full
              and got["tiers"] == {"a": host(full), "b": host(0)})

        # 2. The same prompt through B: both hold it (either may be picked).
        b.generate(first)
        got = await await_tiers(router, workers, tokens, {"a": host(full), "b": host(full)})
        check("after B too, both hold it", got,
              got["settled"] and got["tiers"] == {"a": host(full), "b": host(full)}
              and 0 < got["credit"] <= full)

        # 3. Another prompt through B only.
        second = prompt_text(rng, 100)
        tokens2 = tokens_of(b, second)
        full2 = len(tokens2) // BLOCK
        print(f"prompt 2: {len(tokens2)} tokens, {full2} full blocks", flush=True)
        b.generate(second)
        got = await await_tiers(router, workers, tokens2, {"a": host(0), "b": host(full2)})
        check("a prompt only B served: best_worker picks B; A holds none of it", got,
              got["settled"] and got["pick"] == "b" and 0 < got["credit"] <= full2
              and got["tiers"] == {"a": host(0), "b": host(full2)})
        print(f"prompt 1 again (not sent): {await route(router, workers, tokens)}", flush=True)

        # Dynamo's sockets in this process (request plane, response stream, broker) listen on
        # loopback only.
        listening = listening_addresses()
        check("every socket this process listens on is on 127.0.0.1", listening,
              bool(listening) and all(addr.startswith("127.0.0.1:") for addr in listening))
    finally:
        for w in workers:
            await w.stop()
        if router_runtime is not None:
            router_runtime.shutdown()


def main():
    args = parse_args(__doc__, lambda parser: parser.add_argument(
        "--dynamo-log", default="warn", help="Dynamo's DYN_LOG level"))
    work, model = make_work(args, "kvcm-kvrouter-")
    nodes, broker, checks = [], None, []
    try:
        a = Node("a", args.bin_dir, model, work, num_blocks=256)
        b = Node("b", args.bin_dir, model, work, num_blocks=256)
        nodes = [a, b]
        for n in nodes:
            n.await_ready()
            print(f"node {n.name}: http={n.url} pub={n.pub}", flush=True)
        broker = Broker()
        discovery = os.path.join(work, "dynamo-discovery")
        os.makedirs(discovery)
        env = loopback_env(discovery, broker)
        print(f"Dynamo: {' '.join(f'{k}={v}' for k, v in env.items())}", flush=True)
        os.environ.update(env, DYN_LOG=args.dynamo_log, NO_COLOR="1")
        asyncio.run(asyncio.wait_for(run(args, model, a, b, checks), 8 * TIMEOUT_S))
    finally:
        for n in nodes:
            n.stop()
        if broker is not None:
            broker.stop()
    return finish(args, work, checks)


if __name__ == "__main__":
    sys.exit(main())
