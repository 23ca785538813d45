#!/usr/bin/env python3
"""The resident memory of each kvcm-executor serving one model, for 1 and 2 executors.

For each executor count it starts the whole stack with kvcm-launch (shm pool), waits for it
to be ready, sends a few concurrent /generate requests so that every executor has run
forward passes, then reads each executor's VmRSS (/proc/PID/status) and its
/proc/PID/smaps_rollup: Rss, Pss and its anonymous / file / shmem parts, and the shared
and private pages. The KV pool is a shared memfd mapped by the cache manager and every
executor (Shmem); the weights are the anonymous part (docs/executor.md, "Memory").

  bench/executor_memory.py --bin build/bin                    # the bundled SmolLM2 GGUF
  bench/executor_memory.py --bin build/bin --model M.gguf --executors 1,2,4

Prints one row per executor and a summary per count: the executors' Pss summed (what they
cost the machine together, the pool's pages shared with the cache manager included) and
the anonymous part alone (the weights and scratch each executor holds for itself), as a
ratio to the model file's size (what one copy shared in the page cache would take).
"""

import argparse
import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

ROLLUP_FIELDS = ["Rss", "Pss", "Pss_Anon", "Pss_File", "Pss_Shmem", "Shared_Clean",
                 "Shared_Dirty", "Private_Clean", "Private_Dirty"]


def read_kb(path, fields):
    values = {}
    with open(path) as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in fields:
                values[name] = int(rest.split()[0])
    return values


def memory(pid):
    m = read_kb(f"/proc/{pid}/smaps_rollup", ROLLUP_FIELDS)
    m.update(read_kb(f"/proc/{pid}/status", ["VmRSS"]))
    return m


def wait_for(path, regex, deadline_s):
    pattern = re.compile(regex)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        with open(path, errors="replace") as f:
            text = f.read()
        if pattern.search(text):
            return text
        time.sleep(0.1)
    raise RuntimeError(f"timed out waiting for /{regex}/ in {path}:\n{text[-3000:]}")


def generate(url, prompt, tokens):
    body = json.dumps({"inputs": prompt, "parameters": {"max_new_tokens": tokens}}).encode()
    request = urllib.request.Request(url + "/generate", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.load(reply)["generated_text"]


def measure(args, count):
    with tempfile.TemporaryDirectory(prefix="kvcm-memory.") as work:
        run = os.path.join(work, "run")
        os.mkdir(run, 0o700)
        log_path = os.path.join(work, "launch.log")
        with open(log_path, "w") as log:
            launch = subprocess.Popen(
                [os.path.join(args.bin, "kvcm-launch"), "--model", args.model, "--executors",
                 str(count), "--run-dir", run, "--backend", "shm", "--block-size", "16",
                 "--num-blocks", str(args.num_blocks), "--port", "0", "--threads",
                 str(args.threads)],
                stdout=log, stderr=subprocess.STDOUT)
        try:
            text = wait_for(log_path, r"kvcm-launch: ready http=\S+", 300)
            url = re.search(r"kvcm-launch: ready http=(\S+)", text).group(1)
            pids = [int(p) for p in re.findall(r"started executor-\d+ \(pid (\d+)\)", text)]
            if len(pids) != count:
                raise RuntimeError(f"expected {count} executors in the log, found {pids}")
            prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(4 * count)]
            with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
                list(pool.map(lambda p: generate(url, p, args.tokens), prompts))
            with open(log_path, errors="replace") as f:
                loads = re.findall(r"kvcm-executor: loaded \S+ in (\S+):", f.read())
            return [(pid, memory(pid)) for pid in pids], loads
        finally:
            launch.send_signal(signal.SIGTERM)
            try:
                launch.wait(30)
            except subprocess.TimeoutExpired:
                launch.kill()
                launch.wait()


def mb(kb):
    return f"{kb / 1024:.1f}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin", default="build/bin")
    parser.add_argument("--model", help="default: the bundled model (scripts/get-model.sh)")
    parser.add_argument("--executors", default="1,2")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--num-blocks", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=8)
    args = parser.parse_args()
    if not args.model:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        args.model = subprocess.run([os.path.join(root, "scripts", "get-model.sh")],
                                    check=True, capture_output=True, text=True).stdout.split()[-1]
    print(f"model {args.model} ({os.path.getsize(args.model) / 2**20:.1f} MiB file), "
          f"--threads {args.threads}, shm pool of {args.num_blocks} blocks of 16 tokens; MiB")
    columns = ["VmRSS", "Pss", "Pss_Anon", "Pss_File", "Pss_Shmem", "Shared", "Private"]
    print("executors  executor  " + "  ".join(f"{c:>9}" for c in columns))
    for count in [int(c) for c in args.executors.split(",")]:
        rows, loads = measure(args, count)
        for i, (pid, m) in enumerate(rows):
            values = [m["VmRSS"], m["Pss"], m["Pss_Anon"], m["Pss_File"], m["Pss_Shmem"],
                      m["Shared_Clean"] + m["Shared_Dirty"],
                      m["Private_Clean"] + m["Private_Dirty"]]
            print(f"{count:>9}  {i:>8}  " + "  ".join(f"{mb(v):>9}" for v in values))
        total = sum(m["Pss"] for _, m in rows)
        anon = sum(m["Pss_Anon"] for _, m in rows)
        print(f"{count:>9}  {'sum':>8}  Pss {mb(total)}, of it anonymous {mb(anon)} = "
              f"{anon * 1024 / os.path.getsize(args.model):.2f}x the model file; "
              f"weights loaded in {', '.join(loads) or '(not logged)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
