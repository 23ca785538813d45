#!/usr/bin/env python3
"""The whole kvcm server beside llama.cpp's llama-server, under NVIDIA's aiperf.

Sets up, then measures (docs/PERFORMANCE.md, "The whole server beside llama-server"):
  1. llama-server from the llama-cpp-python sdist (scripts/build-llama-cpp.sh llama-server:
     API only, nothing downloaded but the sdist),
  2. aiperf (PyPI, pinned: AIPERF_VERSION) in BUILD_DIR/venv-aiperf,
  3. a Hugging Face tokenizer folder (tokenizer.json, tokenizer_config.json) written from
     the bundled GGUF's tokenizer.ggml.* metadata by the repo's own reference script
     (tests/common/tokenizer/bpe_reference.py smollm2, run in BUILD_DIR/venv-reference),
     so aiperf never asks Hugging Face for anything (HF_ENDPOINT points nowhere),
then starts kvcm (kvcm-launch, one executor, 2 threads) and llama-server (-t 2, 16 slots of
2,048 tokens, continuous batching), one at a time and alternately (kvcm, llama-server, kvcm,
... for --rounds rounds), and runs the same aiperf workloads (same seed, so the same prompts)
against each: streaming /v1/completions, every request producing exactly its output length
(--extra-inputs ignore_eos:true min_tokens:OSL), token counts from the servers' usage
(--use-server-token-count), after a warmup of 2 requests (8 for prefix):

  c1, c16, c4   random 256-token prompts, 64 output tokens, concurrency 1, 16, 4
                (8, 32, 16 requests)
  prefix        8 shared 1,000-token prefixes (+ 128 random tokens each), 64 output
                tokens, concurrency 8 (16 requests)

--requests-scale multiplies the counts; --duration S runs each workload S seconds instead.
kvcm's router gets --http-idle-timeout-seconds=600 (its default, 60 s, cuts a stream that
waits longer for a token; llama-server's read/write --timeout is 3,600 s).

Each (server, round) segment (start, every workload, stop) runs under
flock(/tmp/kvcm-bench.lock), so that another timed run taking it waits, for at most
--segment-budget seconds (840): a run still going then is stopped (SIGINT to aiperf) and the
segment's remaining workloads are skipped. Prints per workload each server's output
tokens/s, TTFT p50/p99 and inter-token latency p50/p99 (aiperf's JSON export, the mean over
rounds), failed requests, the server's and aiperf's CPU use in cores, kvcm / llama-server
ratios and the goals beside them. aiperf's CPU is its process tree's user+sys time over its
wall time, start-up (about 15 s of CPU: its services are Python processes) included: wait4's
rusage of the aiperf process, its reaped workers included, or psutil's sum over the tree
when larger. Everything (aiperf artifacts, server logs, results.json, summary.md,
summary.json) goes to --out-dir (default BUILD_DIR/server-bench/UTC-TIME).

  bench/server_vs_llama.py --quick              # a smoke run: 1 round, 3-16 requests a run
  bench/server_vs_llama.py --rounds 2           # the measurement in docs/PERFORMANCE.md
  bench/server_vs_llama.py --setup-only         # build, install, write the tokenizer
  bench/server_vs_llama.py --report DIR/results.json   # the summary again (or of a partial run)
"""

import argparse
import fcntl
import json
import os
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AIPERF_VERSION = "0.13.0"
MODEL_NAME = "SmolLM2-135M-Instruct"
LOCK = "/tmp/kvcm-bench.lock"

# name, isl, osl, concurrency, prefix prompts, prefix length, requests (full, quick)
WORKLOADS = [
    ("c1", 256, 64, 1, 0, 0, 8, 3),
    ("c16", 256, 64, 16, 0, 0, 32, 16),
    ("prefix", 128, 64, 8, 8, 1000, 16, 8),
    ("c4", 256, 64, 4, 0, 0, 16, 8),  # last: no goal of its own
]
GOALS = {  # workload: [(metric, op, value, text)]
    "c1": [("tput", ">=", 1.0, "output tok/s >= 1.0x"), ("itl_p50", "<=", 1.0, "ITL p50 <= 1.0x")],
    "c16": [("tput", ">=", 2.0, "output tok/s >= 2x")],
    "prefix": [("ttft_p50", "<=", 0.5, "TTFT p50 <= 0.5x")],
}
METRICS = [("tput", "out tok/s"), ("ttft_p50", "TTFT p50 ms"), ("ttft_p99", "TTFT p99 ms"),
           ("itl_p50", "ITL p50 ms"), ("itl_p99", "ITL p99 ms")]


def log(msg):
    print(f"server-vs-llama: {msg}", file=sys.stderr, flush=True)


def last_line(cmd, env=None):
    out = subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True, env=env)
    return out.stdout.strip().splitlines()[-1]


# --- setup -------------------------------------------------------------------------------

def build_llama_server(build_dir):
    built = os.path.join(ROOT, build_dir, "llama.cpp", "build", "bin", "llama-server")
    if os.access(built, os.X_OK):
        return built
    env = dict(os.environ, KVCM_BUILD_DIR=build_dir, KVCM_JOBS=os.environ.get("KVCM_JOBS", "2"))
    return os.path.abspath(os.path.join(ROOT, last_line(
        ["scripts/build-llama-cpp.sh", "llama-server"], env)))


def aiperf_venv(build_dir):
    venv = os.path.join(ROOT, build_dir, "venv-aiperf")
    stamp = os.path.join(venv, ".aiperf-version")
    if os.path.exists(stamp) and open(stamp).read().strip() == AIPERF_VERSION:
        return venv
    log(f"installing aiperf=={AIPERF_VERSION} into {venv}")
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([os.path.join(venv, "bin", "pip"), "install", "--quiet",
                    "--disable-pip-version-check", "--no-input", f"aiperf=={AIPERF_VERSION}"],
                   check=True)
    with open(stamp, "w") as f:
        f.write(AIPERF_VERSION + "\n")
    return venv


def tokenizer_dir(build_dir, gguf):
    out = os.path.join(ROOT, build_dir, "server-bench-tokenizer")
    if os.path.exists(os.path.join(out, "tokenizer.json")):
        return out
    python = os.path.join(ROOT, build_dir, "venv-reference", "bin", "python3")
    if not os.path.exists(python):
        sys.exit(f"server-vs-llama: {python} is missing: scripts/python-env.sh makes it")
    log(f"writing a tokenizer folder from {gguf} into {out}")
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run([python, "tests/common/tokenizer/bpe_reference.py", "smollm2", "--gguf", gguf,
                    "--out-dir", tmp], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    for name in ("expected.json", "gguf_vocab.json"):  # the test's outputs, not a tokenizer's
        os.remove(os.path.join(tmp, name))
    config_path = os.path.join(tmp, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(config_path, "w") as f:
        json.dump(config, f)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    return out


# --- servers -----------------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name, cmd, log_path, ready):
        self.name, self.cmd, self.log_path, self.ready = name, cmd, log_path, ready
        self.proc = None
        self.url = None

    def start(self, timeout=180):
        self.logf = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.logf, stderr=subprocess.STDOUT,
                                     cwd=ROOT, start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); see {self.log_path}")
            url = self.ready(self)
            if url:
                self.url = url
                return
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} not ready after {timeout} s; see {self.log_path}")

    def cpu_seconds(self):
        """User+sys seconds of the server's process tree so far (psutil)."""
        import_psutil = _psutil()
        if import_psutil is None or self.proc is None:
            return None
        try:
            root = import_psutil.Process(self.proc.pid)
            total = 0.0
            for p in [root] + root.children(recursive=True):
                try:
                    t = p.cpu_times()
                    total += t.user + t.system
                except import_psutil.Error:
                    pass
            return total
        except import_psutil.Error:
            return None

    def stop(self):
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the session this script started
                self.proc.wait()
        self.logf.close()
        self.proc = None


def kvcm_server(args, log_path, run_dir):
    port = free_port()
    cmd = [os.path.join(args.bin_dir, "kvcm-launch"), "--model", args.model, "--executors", "1",
           "--threads", str(args.threads), "--run-dir", run_dir, "--hostname", "127.0.0.1",
           "--port", str(port), "--max-input-tokens", "4096", "--max-total-tokens", "8192",
           # The router's idle timeout (60 s) cuts a stream that waits longer than that for
           # a token (seen on a loaded machine); llama-server's --timeout is 3,600 s.
           "--router-arg=--http-idle-timeout-seconds=600"] + args.kvcm_args.split()

    def ready(server):
        try:
            with open(log_path) as f:
                m = re.search(r"kvcm-launch: ready http=(\S+)", f.read())
            return m.group(1) if m else None
        except OSError:
            return None
    return Server("kvcm", cmd, log_path, ready)


def llama_server(args, log_path):
    port = free_port()
    slots = 16
    cmd = [args.llama_server, "-m", args.model, "-t", str(args.threads), "-tb", str(args.threads),
           "--host", "127.0.0.1", "--port", str(port), "--parallel", str(slots),
           "--ctx-size", str(slots * 2048), "--cont-batching", "--no-warmup",
           "--alias", MODEL_NAME] + args.llama_args.split()
    url = f"http://127.0.0.1:{port}"

    def ready(server):
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                return url if r.status == 200 else None
        except Exception:
            return None
    return Server("llama-server", cmd, log_path, ready)


# --- aiperf ------------------------------------------------------------------------------

_PSUTIL = []


def _psutil():
    if not _PSUTIL:
        try:
            import psutil  # the system python may lack it; the aiperf venv has it
            _PSUTIL.append(psutil)
        except ImportError:
            _PSUTIL.append(None)
    return _PSUTIL[0]


def tree_cpu_sampler(pid, stop, seen):
    """Keeps seen[pid] = the latest user+sys seconds of each process under pid."""
    ps = _psutil()
    if ps is None:
        return
    while not stop.is_set():
        try:
            root = ps.Process(pid)
            for p in [root] + root.children(recursive=True):
                try:
                    t = p.cpu_times()
                    seen[p.pid] = t.user + t.system
                except ps.Error:
                    pass
        except ps.Error:
            pass
        stop.wait(0.2)


def run_aiperf(args, venv, tok, url, workload, out_dir, requests, deadline):
    name, isl, osl, conc, nprefix, prefix_len, _, _ = workload
    cmd = [os.path.join(venv, "bin", "aiperf"), "profile",
           "--model", MODEL_NAME, "--tokenizer", tok, "--url", url,
           "--endpoint-type", "completions", "--streaming",
           "--isl", str(isl), "--isl-stddev", "0", "--osl", str(osl), "--osl-stddev", "0",
           "--extra-inputs", "ignore_eos:true", "--extra-inputs", f"min_tokens:{osl}",
           "--use-server-token-count",
           "--concurrency", str(conc), "--random-seed", "42",
           "--warmup-request-count", str(8 if nprefix else 2),
           "--no-server-metrics", "--no-gpu-telemetry",
           "--workers-max", "1", "--record-processors", "1",
           "--ui-type", "none", "--artifact-dir", out_dir]
    if args.duration:
        cmd += ["--benchmark-duration", f"{args.duration:g}",
                "--benchmark-grace-period", f"{args.grace:g}"]
    else:
        cmd += ["--request-count", str(requests)]
    if nprefix:
        cmd += ["--num-prefix-prompts", str(nprefix), "--prefix-prompt-length", str(prefix_len)]
    # Not HF_HUB_OFFLINE: aiperf 0.13.0 then looks a local --tokenizer folder up in the hub
    # cache (snapshot_download(local_files_only=True)) and fails. Online mode loads a local
    # folder as it is; an unreachable HF_ENDPOINT makes sure nothing is fetched.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_DISABLE_TELEMETRY="1",
               TOKENIZERS_PARALLELISM="false")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "command.txt"), "w") as f:
        f.write(" ".join(cmd) + "\n")
    logf = open(os.path.join(out_dir, "aiperf.log"), "w")
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)

    stop, seen = threading.Event(), {}
    sampler = threading.Thread(target=tree_cpu_sampler, args=(proc.pid, stop, seen), daemon=True)
    sampler.start()
    watchdog = threading.Thread(target=watchdog_loop, args=(proc, stop, deadline, out_dir),
                                daemon=True)
    watchdog.start()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - start
    stop.set()
    sampler.join()
    logf.close()
    cpu = max(usage.ru_utime + usage.ru_stime, sum(seen.values()))
    if proc.returncode != 0:
        log(f"aiperf failed ({proc.returncode}): {out_dir}/aiperf.log")
        return None, cpu, wall
    return read_export(out_dir), cpu, wall


def metric(data, *names):
    for n in names:
        if n in data and isinstance(data[n], dict):
            return data[n]
    for v in data.values():  # nested layouts ({"records": {...}})
        if isinstance(v, dict):
            found = metric(v, *names)
            if found:
                return found
    return None


def read_export(out_dir):
    path = None
    for dirpath, _, files in os.walk(out_dir):
        for f in files:
            if f == "profile_export_aiperf.json":
                path = os.path.join(dirpath, f)
    if path is None:
        raise RuntimeError(f"no profile_export_aiperf.json under {out_dir}")
    with open(path) as f:
        data = json.load(f)
    tput = metric(data, "output_token_throughput")
    ttft = metric(data, "time_to_first_token")
    itl = metric(data, "inter_token_latency")
    osl = metric(data, "output_sequence_length")
    count = metric(data, "request_count")
    errors = metric(data, "error_request_count")
    return {
        "tput": tput["avg"], "ttft_p50": ttft["p50"], "ttft_p99": ttft["p99"],
        "itl_p50": itl["p50"], "itl_p99": itl["p99"],
        "osl_avg": osl["avg"] if osl else None, "osl_min": osl.get("min") if osl else None,
        "requests": count["avg"] if count else None,
        "errors": errors["avg"] if errors else 0,
    }


def watchdog_loop(proc, stop, deadline, out_dir):
    """SIGINT to aiperf's session at the deadline, SIGKILL 30 s later."""
    for sig, at in ((signal.SIGINT, deadline), (signal.SIGKILL, deadline + 30)):
        if stop.wait(max(0.0, at - time.monotonic())):
            return
        log(f"{out_dir}: the segment's time is up; sending aiperf {sig.name}")
        try:
            os.killpg(proc.pid, sig)  # the session started for this aiperf run
        except ProcessLookupError:
            return


# --- the run -----------------------------------------------------------------------------

class BenchLock:
    def __init__(self, path, enabled):
        self.path, self.enabled = path, enabled

    def __enter__(self):
        if self.enabled:
            self.f = open(self.path, "a")
            t = time.monotonic()
            fcntl.flock(self.f, fcntl.LOCK_EX)
            waited = time.monotonic() - t
            if waited > 1:
                log(f"waited {waited:.0f} s for {self.path}")
        return self

    def __exit__(self, *exc):
        if self.enabled:
            fcntl.flock(self.f, fcntl.LOCK_UN)
            self.f.close()


def fmt(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f}"


def summarize(results, workloads, rounds):
    """Means over rounds per (workload, server); ratios kvcm / llama-server."""
    summary = {}
    for w in workloads:
        name = w[0]
        row = {}
        for server in ("kvcm", "llama-server"):
            runs = [r for r in results if r["workload"] == name and r["server"] == server
                    and r["metrics"]]
            if not runs:
                continue
            row[server] = {k: statistics.mean(r["metrics"][k] for r in runs) for k, _ in METRICS}
            row[server]["aiperf_cores"] = statistics.mean(r["aiperf_cpu_s"] / r["aiperf_wall_s"]
                                                          for r in runs)
            row[server]["server_cores"] = statistics.mean(
                r["server_cpu_s"] / r["aiperf_wall_s"] for r in runs if r["server_cpu_s"])\
                if any(r["server_cpu_s"] for r in runs) else None
            row[server]["osl_avg"] = statistics.mean(r["metrics"]["osl_avg"] or 0 for r in runs)
            row[server]["errors"] = sum(r["metrics"]["errors"] or 0 for r in runs)
            row[server]["rounds"] = len(runs)
        if "kvcm" in row and "llama-server" in row:
            row["ratio"] = {k: (row["kvcm"][k] / row["llama-server"][k]
                                if row["llama-server"][k] else None) for k, _ in METRICS}
            goals = []
            for key, op, value, text in GOALS.get(name, []):
                r = row["ratio"][key]
                ok = r is not None and (r >= value if op == ">=" else r <= value)
                goals.append({"goal": text, "ratio": r, "met": ok})
            row["goals"] = goals
        summary[name] = row
    return summary


def render(summary, workloads, header, results):
    lines = [header, "",
             "| workload | server | " + " | ".join(t for _, t in METRICS) +
             " | failed requests | server CPU (cores) | aiperf CPU (cores) |",
             "|---|---|" + "---:|" * (len(METRICS) + 3)]
    for w in workloads:
        row = summary.get(w[0], {})
        for server in ("kvcm", "llama-server"):
            if server not in row:
                continue
            s = row[server]
            lines.append(f"| {w[0]} | {server} | " +
                         " | ".join(fmt(s[k], 1) for k, _ in METRICS) +
                         f" | {s['errors']:.0f} | {fmt(s['server_cores'], 2)} | "
                         f"{fmt(s['aiperf_cores'], 2)} |")
        if "ratio" in row:
            lines.append(f"| {w[0]} | **kvcm ÷ llama** | " +
                         " | ".join(fmt(row["ratio"][k], 2) + "x" for k, _ in METRICS) + " | | | |")
    failed = [f"{r['server']} {r['workload']} round {r['round']}" for r in results if not r["metrics"]]
    lines.append("")
    if failed:
        lines.append("Runs without results (aiperf failed; see their aiperf.log): " + ", ".join(failed))
    lines.append("Goals (kvcm ÷ llama-server):")
    for w in workloads:
        for g in summary.get(w[0], {}).get("goals", []):
            lines.append(f"  {w[0]:7s} {g['goal']:22s} measured {fmt(g['ratio'], 2)}x  "
                         f"{'met' if g['met'] else 'NOT met'}")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=None, help="alternated rounds (default 2; --quick 1)")
    p.add_argument("--quick", action="store_true", help="few requests per run: a smoke run")
    p.add_argument("--requests-scale", type=float, default=1.0,
                   help="multiply every workload's request count")
    p.add_argument("--duration", type=float, default=None,
                   help="seconds each run sends requests (aiperf --benchmark-duration) instead "
                        "of a fixed request count per workload (WORKLOADS)")
    p.add_argument("--grace", type=float, default=None,
                   help="seconds to wait for requests in flight when a run's time is up "
                        "(aiperf --benchmark-grace-period; default 120)")
    p.add_argument("--kvcm-args", default="",
                   help="more kvcm-launch arguments, one string")
    p.add_argument("--segment-budget", type=float, default=840,
                   help="seconds one (server, round) segment may hold the lock: a run still "
                        "going then is stopped and the segment's remaining workloads skipped")
    p.add_argument("--llama-args", default="",
                   help="more llama-server arguments, one string (e.g. '--poll 0')")
    p.add_argument("--workloads", default="c1,c16,prefix,c4")
    p.add_argument("--out-dir", default=None, help="default BUILD_DIR/server-bench/UTC-TIME")
    p.add_argument("--build-dir", default=os.environ.get("KVCM_BUILD_DIR", "build"))
    p.add_argument("--bin-dir", default=None, help="kvcm binaries (default BUILD_DIR/bin)")
    p.add_argument("--model", default=None, help="GGUF (default: scripts/get-model.sh)")
    p.add_argument("--llama-server", default=None,
                   help="llama-server binary (default: scripts/build-llama-cpp.sh llama-server)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lock", default=LOCK, help="flock file held per (server, round)")
    p.add_argument("--no-lock", action="store_true")
    p.add_argument("--servers", default="kvcm,llama-server")
    p.add_argument("--setup-only", action="store_true")
    p.add_argument("--report", metavar="RESULTS_JSON", nargs="+",
                   help="print the summary of earlier (or interrupted) runs' results.json, "
                        "several runs' rounds together")
    args = p.parse_args()
    rounds = args.rounds or (1 if args.quick else 2)
    if args.report:
        results = []
        for path in args.report:
            with open(path) as f:
                base = max([r["round"] for r in results], default=0)
                results += [dict(r, round=base + r["round"]) for r in json.load(f)]
        workloads = [w for w in WORKLOADS if any(r["workload"] == w[0] for r in results)]
        summary = summarize(results, workloads, rounds)
        print(render(summary, workloads, f"{' '.join(args.report)}: {max(r['round'] for r in results)} "
                     f"round(s); aiperf's own CPU {statistics.mean(r['aiperf_cpu_s'] / r['aiperf_wall_s'] for r in results if r['aiperf_wall_s']):.2f} cores on average", results))
        return
    if args.grace is None:
        args.grace = 120
    args.bin_dir = os.path.abspath(args.bin_dir or os.path.join(ROOT, args.build_dir, "bin"))
    args.model = os.path.abspath(args.model or last_line(["scripts/get-model.sh"]))
    args.llama_server = os.path.abspath(args.llama_server or build_llama_server(args.build_dir))
    venv = aiperf_venv(args.build_dir)
    tok = tokenizer_dir(args.build_dir, args.model)
    # psutil: the aiperf venv carries it; use it from there when this python lacks it.
    if _psutil() is None:
        site = subprocess.run([os.path.join(venv, "bin", "python3"), "-c",
                               "import psutil, os; print(os.path.dirname(os.path.dirname(psutil.__file__)))"],
                              check=True, stdout=subprocess.PIPE, text=True).stdout.strip()
        sys.path.append(site)
        _PSUTIL.clear()
    log(f"llama-server {args.llama_server}")
    log(f"aiperf {venv}/bin/aiperf ({AIPERF_VERSION}); tokenizer {tok}; model {args.model}")
    if args.setup_only:
        return
    for b in ("kvcm-launch", "kvcm-router", "kvcm-executor", "kvcm-cache-manager"):
        if not os.access(os.path.join(args.bin_dir, b), os.X_OK):
            sys.exit(f"server-vs-llama: {args.bin_dir}/{b} is missing: build kvcm first")
    out = os.path.abspath(args.out_dir or os.path.join(
        ROOT, args.build_dir, "server-bench", time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())))
    os.makedirs(out, exist_ok=True)
    wanted = args.workloads.split(",")
    workloads = [w for w in WORKLOADS if w[0] in wanted]
    servers = args.servers.split(",")
    results, loads = [], []
    cpu_model = "?"
    with open("/proc/cpuinfo") as f:
        m = re.search(r"model name\s*:\s*(.*)", f.read())
        cpu_model = m.group(1).strip() if m else "?"
    log(f"{rounds} round(s), workloads {','.join(w[0] for w in workloads)}; output in {out}")
    for rnd in range(1, rounds + 1):
        for server_name in servers:
            seg = os.path.join(out, f"round{rnd}", server_name)
            os.makedirs(seg, exist_ok=True)
            with BenchLock(args.lock, not args.no_lock):
                t0 = time.monotonic()
                load = os.getloadavg()[0]
                loads.append(load)
                log(f"round {rnd}: starting {server_name} (load average {load:.2f})")
                if server_name == "kvcm":
                    run_dir = os.path.join(seg, "run")
                    os.makedirs(run_dir, mode=0o700, exist_ok=True)
                    server = kvcm_server(args, os.path.join(seg, "server.log"), run_dir)
                else:
                    server = llama_server(args, os.path.join(seg, "server.log"))
                server.start()
                log(f"round {rnd}: {server_name} ready at {server.url}")
                try:
                    deadline = t0 + args.segment_budget
                    for w in workloads:
                        if time.monotonic() > deadline - 30:
                            log(f"round {rnd}: {server_name}: no time left for {w[0]}; skipped")
                            results.append({"round": rnd, "server": server_name,
                                            "workload": w[0], "metrics": None, "skipped": True,
                                            "aiperf_cpu_s": 0, "aiperf_wall_s": 0,
                                            "server_cpu_s": None})
                            continue
                        requests = w[7] if args.quick else max(1, int(w[6] * args.requests_scale))
                        cpu0 = server.cpu_seconds()
                        metrics, cpu, wall = run_aiperf(args, venv, tok, server.url, w,
                                                        os.path.join(seg, w[0]), requests,
                                                        deadline)
                        cpu1 = server.cpu_seconds()
                        results.append({"round": rnd, "server": server_name, "workload": w[0],
                                        "requests": requests, "metrics": metrics,
                                        "aiperf_cpu_s": cpu, "aiperf_wall_s": wall,
                                        "server_cpu_s": (cpu1 - cpu0) if cpu0 is not None and
                                        cpu1 is not None else None})
                        if metrics is None:
                            continue
                        log(f"round {rnd} {server_name:12s} {w[0]:6s} {metrics['tput']:7.1f} tok/s "
                            f"TTFT p50 {metrics['ttft_p50']:7.1f} ms ITL p50 {metrics['itl_p50']:6.2f} ms "
                            f"osl {fmt(metrics['osl_avg'])} errors {metrics['errors']:.0f}; "
                            f"aiperf {cpu:.1f} s CPU / {wall:.1f} s")
                finally:
                    server.stop()
                log(f"round {rnd}: {server_name} segment took {time.monotonic() - t0:.0f} s")
            with open(os.path.join(out, "results.json"), "w") as f:
                json.dump(results, f, indent=1)
    summary = summarize(results, workloads, rounds)
    load_avgs = (min(loads), max(loads))
    aiperf_cores = statistics.mean(r["aiperf_cpu_s"] / r["aiperf_wall_s"] for r in results
                                   if r["aiperf_wall_s"])
    header = (f"{cpu_model}, {os.cpu_count()} CPUs; {rounds} round(s) alternated; "
              f"kvcm-launch 1 executor --threads {args.threads}; llama-server -t {args.threads} "
              f"-np 16 -c 32768 {args.llama_args}".rstrip() + "; " +
              (f"{args.duration:g} s of requests per run; " if args.duration else "fixed request counts; ") +
              f"load average {load_avgs[0]:.1f}-{load_avgs[1]:.1f} at segment starts; "
              f"aiperf {AIPERF_VERSION}, streaming /v1/completions, ignore_eos; "
              f"aiperf's own CPU: {aiperf_cores:.2f} cores on average "
              f"({100 * aiperf_cores / os.cpu_count():.0f}% of the machine) over its runs")
    text = render(summary, workloads, header, results)
    print(text)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump({"header": header, "summary": summary, "aiperf_cores": aiperf_cores}, f, indent=1)
    log(f"results in {out}")


if __name__ == "__main__":
    main()
