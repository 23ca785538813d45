#!/usr/bin/env python3
"""The system calls of a running kvcm stack fall within the systemd units' filter.

Runs kvcm-launch (a cache manager with the shared-memory pool, the router, two executors
on a tiny random model) under `strace -f`, sends a few requests, stops it with SIGTERM,
and checks that every system call any of its processes made is one that the
SystemCallFilter= lines of deploy/systemd/ let through (systemd-analyze expands the
groups). A call outside would fail with EPERM under systemd. The CUDA backend's calls are
not covered here (no GPU in the tests).

  check_syscalls.py BIN_DIR     (exit 77: strace or systemd-analyze is not installed)
"""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from check_systemd import SERVICES, UNITS, allowed_syscalls, parse_unit  # noqa: E402
from deploy_common import Checks  # noqa: E402


def children(parent: int) -> list[int]:
    """The pids whose parent is `parent` (here: kvcm-launch, strace's child)."""
    found = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if fields[1] == str(parent):
            found.append(int(stat.parent.name))
    return found


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    bin_dir = pathlib.Path(sys.argv[1]).resolve()
    for tool in ("strace", "systemd-analyze"):
        if not shutil.which(tool):
            print(f"SKIP: {tool} is not installed (scripts/bootstrap.sh installs it): the "
                  "stack's system calls were not checked against deploy/systemd/'s filter")
            return 77
    checks = Checks("system calls")
    with tempfile.TemporaryDirectory(prefix="kvcm-syscalls-") as work_dir:
        work = pathlib.Path(work_dir)
        seed = "5"
        print(f"tiny model seed {seed}")
        subprocess.run([str(bin_dir / "kvcm-make-tiny-model"), f"--output={work / 'model'}",
                        f"--seed={seed}"], check=True, capture_output=True, timeout=60)
        trace = work / "trace"
        log = open(work / "launch.log", "w+")
        # LeakSanitizer cannot run under ptrace: in a sanitizer build (scripts/test.sh's ASan
        # stage) the traced processes run without it, or each would report a fatal error.
        env = dict(os.environ)
        if "ASAN_OPTIONS" in env:
            env["ASAN_OPTIONS"] += ":detect_leaks=0"
        launch = subprocess.Popen(
            ["strace", "-f", "-qq", "-o", str(trace), str(bin_dir / "kvcm-launch"),
             "--model", str(work / "model"), "--executors", "2", "--run-dir", str(work / "run"),
             "--port", "0", "--num-blocks", "256", "--backend", "shm"],
            stdout=log, stderr=subprocess.STDOUT, env=env)
        url = None
        deadline = time.monotonic() + 90
        while url is None and time.monotonic() < deadline and launch.poll() is None:
            time.sleep(0.2)
            log.seek(0)
            match = re.search(r"kvcm-launch: ready http=(\S+)", log.read())
            url = match.group(1) if match else None
        if not checks.check(url is not None, "kvcm-launch under strace became ready"):
            log.seek(0)
            print(log.read()[-3000:])
            for pid in children(launch.pid):
                subprocess.run(["kill", "-TERM", str(pid)])
            launch.wait(timeout=60)
            return checks.done()
        answered = 0
        for i in range(3):
            request = urllib.request.Request(
                f"{url}/generate", method="POST", headers={"Content-Type": "application/json"},
                data=json.dumps({"inputs": f"Hello {i}", "parameters": {"max_new_tokens": 8}}).encode())
            with urllib.request.urlopen(request, timeout=30) as reply:
                answered += reply.status == 200
        checks.check(answered == 3, f"3 requests answered ({answered})")
        # strace passes SIGTERM on to kvcm-launch, which stops the whole stack.
        for pid in children(launch.pid):
            subprocess.run(["kill", "-TERM", str(pid)])
        try:
            launch.wait(timeout=60)
        except subprocess.TimeoutExpired:
            launch.kill()
        calls = sorted(set(re.findall(r"^\d+ +([a-z_0-9]+)\(", trace.read_text(), re.MULTILINE)))
        checks.check(len(calls) > 30, f"strace saw the stack's system calls ({len(calls)} distinct)")
        for name in SERVICES:
            allowed = allowed_syscalls(parse_unit(UNITS / name).get("Service.SystemCallFilter", []))
            outside = [c for c in calls if c not in allowed]
            checks.check(not outside, f"{name}: its filter allows every one of them"
                                      + (f" (not: {', '.join(outside)})" if outside else ""))
    return checks.done()


if __name__ == "__main__":
    sys.exit(main())
