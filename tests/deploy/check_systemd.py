#!/usr/bin/env python3
"""Checks deploy/systemd/ (docs/operations.md, "Deployment").

systemd-analyze verify on every unit (an executor instance too), with /usr/local/bin
replaced by the build's bin directory so that the binaries exist; warnings count as
failures, and two deliberately broken copies must be refused. Then what the units must
keep for kvcm to work under their hardening: one user (created by the sysusers file,
dry-run), one preserved run directory, the GPU's device nodes, no separation of IPC, PID
or user namespaces, W+X memory allowed, a system-call filter that still has every call
kvcm makes for its pool, sockets and peers; restart limits; every flag a binary accepts;
the executor template's metrics port (9410 + N) worked out by its own shell line.

  check_systemd.py BIN_DIR      (exit 77: systemd-analyze is not installed)
"""

import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from deploy_common import ROOT, Checks, check_command  # noqa: E402

UNITS = ROOT / "deploy/systemd"
SERVICES = ["kvcm-cache-manager.service", "kvcm-router.service", "kvcm-executor@.service"]
PREFIX = "/usr/local/bin/"
# System calls kvcm needs: the shm pool (memfd_create, fcntl seals, mmap), passing its fd
# (sendmsg/recvmsg with SCM_RIGHTS), watching peers (pidfd_open, poll), the lock (flock),
# the descriptor limit (prlimit64/setrlimit), stale sockets (getdents64), the accept guard
# (accept4), the GPU (ioctl, mmap, mbind, set_mempolicy, sched_setaffinity), ZeroMQ/epoll.
NEEDED_SYSCALLS = ["memfd_create", "fcntl", "mmap", "munmap", "sendmsg", "recvmsg",
                   "pidfd_open", "poll", "flock", "prlimit64", "setrlimit", "getdents64",
                   "accept4", "ioctl", "mbind", "set_mempolicy", "get_mempolicy",
                   "sched_setaffinity", "epoll_wait", "epoll_ctl", "eventfd2", "socket",
                   "bind", "listen", "connect", "clone3", "futex", "madvise", "mremap"]
FORBIDDEN = {  # setting: why it would break kvcm
    "PrivateDevices": "hides /dev/nvidia*",
    "MemoryDenyWriteExecute": "CUDA's PTX JIT and PCRE2's JIT need W+X pages",
    "PrivateIPC": "CUDA IPC between the units needs one IPC namespace",
    "PrivateUsers": "the memfd is handed only to the same uid, across units",
    "PrivatePIDs": "peers are watched by pid",
    "RemoveIPC": "all units share one user: it would remove the others' objects",
    "DynamicUser": "every unit must be the same user",
}


def parse_unit(path: pathlib.Path) -> dict[str, list[str]]:
    """{"Section.Key": [values in order]}, continuation lines joined."""
    entries: dict[str, list[str]] = {}
    section = ""
    pending = ""
    for raw in path.read_text().splitlines():
        line = pending + raw.strip() if pending else raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        entries.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return entries


def is_true(value: str) -> bool:
    return value.lower() in ("1", "yes", "true", "on")


def syscalls(groups: list[str], seen: set[str] | None = None) -> set[str]:
    """The system calls of systemd's groups (@system-service), nested groups expanded."""
    seen = seen if seen is not None else set()
    names: set[str] = set()
    for group in groups:
        if group in seen:
            continue
        seen.add(group)
        out = subprocess.run(["systemd-analyze", "syscall-filter", group],
                             capture_output=True, text=True, check=True).stdout
        for line in out.splitlines()[1:]:  # the first line is the group's own name
            entry = line.strip()
            if entry.startswith("@"):
                names |= syscalls([entry], seen)
            elif entry and not entry.startswith("#"):
                names.add(entry)
    return names


def allowed_syscalls(filters: list[str]) -> set[str]:
    """What a list of SystemCallFilter= lines lets through (an allow list, then ~deny lists)."""
    allowed: set[str] | None = None
    for value in filters:
        deny = value.startswith("~")
        names = value.lstrip("~").split()
        expanded = syscalls([n for n in names if n.startswith("@")]) | {
            n for n in names if not n.startswith("@")}
        if deny:
            allowed = (allowed if allowed is not None else set()) - expanded
        else:
            allowed = (allowed or set()) | expanded
    return allowed or set()


def verify(directory: pathlib.Path, names: list[str]) -> tuple[int, str]:
    out = subprocess.run(["systemd-analyze", "verify", "--man=no",
                          *[str(directory / n) for n in names]],
                         capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, SYSTEMD_LOG_COLOR="0"))
    return out.returncode, (out.stdout + out.stderr).strip()


def staged(bin_dir: pathlib.Path) -> pathlib.Path:
    """A copy of deploy/systemd/ whose units run the build's binaries."""
    directory = pathlib.Path(tempfile.mkdtemp(prefix="kvcm-units-"))
    for path in UNITS.iterdir():
        text = path.read_text().replace(PREFIX, str(bin_dir) + "/")
        (directory / path.name).write_text(text)
    return directory


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    bin_dir = pathlib.Path(sys.argv[1]).resolve()
    if not shutil.which("systemd-analyze"):
        print("SKIP: systemd-analyze is not installed (Debian's systemd package; "
              "scripts/bootstrap.sh installs it): deploy/systemd/ was not verified")
        return 77
    checks = Checks("deploy/systemd")
    directory = staged(bin_dir)
    try:
        to_verify = ["kvcm-cache-manager.service", "kvcm-router.service",
                     "kvcm-executor@0.service", "kvcm-executor@3.service", "kvcm.target"]
        for name in to_verify[2:4]:  # instances are verified through a copy of the template
            shutil.copy(directory / "kvcm-executor@.service", directory / name)
        rc, output = verify(directory, to_verify)
        checks.check(rc == 0 and not output,
                     f"systemd-analyze verify {' '.join(to_verify)}: exit 0 and no warning"
                     + (f" (exit {rc}: {output})" if rc or output else ""))

        # The verification finds what it is meant to find.
        broken = directory / "broken-key.service"
        broken.write_text((directory / "kvcm-router.service").read_text()
                          .replace("UMask=0077", "UMaskk=0077"))
        rc, output = verify(directory, [broken.name])
        checks.check("Unknown key" in output, "a unit with a misspelt key is reported")
        broken.unlink()
        broken = directory / "broken-binary.service"
        broken.write_text((directory / "kvcm-router.service").read_text()
                          .replace("/kvcm-router ", "/kvcm-no-such-binary "))
        rc, output = verify(directory, [broken.name])
        checks.check(rc != 0 and "kvcm-no-such-binary" in output,
                     "a unit whose binary is missing is refused")
        broken.unlink()

        # How exposed each service is, by systemd's own measure (0 best, 10 worst).
        for name in to_verify[:3]:
            out = subprocess.run(["systemd-analyze", "security", "--offline=yes",
                                  "--threshold=25", str(directory / name)],
                                 capture_output=True, text=True, timeout=60)
            level = re.search(r"Overall exposure level for \S+: ([0-9.]+)", out.stdout)
            checks.check(out.returncode == 0 and level is not None,
                         f"{name}: exposure {level.group(1) if level else '?'} of 10, at most 2.5"
                         + ("" if out.returncode == 0 else f" ({out.stdout[-300:]})"))

        # The sysusers file creates the units' user (dry run in an empty root).
        root = directory / "root"
        (root / "etc").mkdir(parents=True)
        (root / "etc/group").write_text("video:x:44:\n")
        out = subprocess.run(["systemd-sysusers", f"--root={root}", "--dry-run",
                              str(UNITS / "kvcm-sysusers.conf")],
                             capture_output=True, text=True, timeout=60)
        checks.check(out.returncode == 0 and "Creating user 'kvcm'" in out.stdout + out.stderr,
                     "kvcm-sysusers.conf creates the user kvcm (systemd-sysusers --dry-run)"
                     + ("" if out.returncode == 0 else f": {out.stderr.strip()}"))
    finally:
        shutil.rmtree(directory, ignore_errors=True)

    environment = {}
    for line in (UNITS / "kvcm.env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            environment[key.strip()] = value.strip()
    units = {name: parse_unit(UNITS / name) for name in SERVICES}
    for name, unit in units.items():
        get = lambda key: unit.get(key, [""])[-1]  # noqa: E731
        checks.check(get("Service.User") == "kvcm" and get("Service.Group") == "kvcm",
                     f"{name}: runs as kvcm:kvcm")
        checks.check(get("Service.RuntimeDirectory") == "kvcm"
                     and get("Service.RuntimeDirectoryMode") == "0700"
                     and get("Service.RuntimeDirectoryPreserve") == "yes",
                     f"{name}: the run directory /run/kvcm, 0700, kept across restarts")
        checks.check(get("Service.Restart") in ("always", "on-failure")
                     and bool(get("Service.RestartSec")) and bool(get("Unit.StartLimitIntervalSec"))
                     and bool(get("Unit.StartLimitBurst")),
                     f"{name}: restarts, with RestartSec and a start limit")
        checks.check(get("Service.ProtectSystem") == "strict", f"{name}: ProtectSystem=strict")
        checks.check(get("Service.DevicePolicy") == "closed"
                     and any(v.split()[0] == "char-nvidia*" for v in unit.get("Service.DeviceAllow", [])),
                     f"{name}: devices closed but for the NVIDIA ones")
        for key, why in FORBIDDEN.items():
            values = unit.get(f"Service.{key}", [])
            checks.check(not any(is_true(v) for v in values), f"{name}: no {key}= ({why})")
        checks.check(get("Service.ProcSubset") in ("", "all"),
                     f"{name}: /proc whole (the NVIDIA driver, /proc/meminfo)")
        allowed = allowed_syscalls(unit.get("Service.SystemCallFilter", []))
        missing = [s for s in NEEDED_SYSCALLS if s not in allowed]
        checks.check(not missing, f"{name}: its system-call filter allows what kvcm calls"
                                  + (f" (not: {', '.join(missing)})" if missing else ""))
        checks.check(get("Service.EnvironmentFile") == "/etc/kvcm/kvcm.env",
                     f"{name}: reads /etc/kvcm/kvcm.env")

        # The command line, with the variables systemd substitutes (the unit's defaults, then
        # kvcm.env's values, as systemd applies EnvironmentFile= after Environment=).
        values = dict(v.split("=", 1) for v in unit.get("Service.Environment", []))
        values.update(environment)
        exec_start = get("Service.ExecStart")
        if exec_start.startswith("/bin/sh -c "):
            script = shlex.split(exec_start)[2].replace("$$", "$")
            for instance, port in (("0", "9410"), ("3", "9413"), ("12", "9422")):
                shown = subprocess.run(
                    ["/bin/sh", "-c", script.replace("%i", instance).replace("exec ", "exec echo ", 1)],
                    capture_output=True, text=True, env=values, timeout=60)
                argv = shlex.split(shown.stdout)
                checks.check(shown.returncode == 0 and f"127.0.0.1:{port}" in argv
                             and f"executor-{instance}" in argv,
                             f"{name} as kvcm-executor@{instance}: executor-{instance}, metrics "
                             f"on 127.0.0.1:{port} (ran: {shown.stdout.strip()}{shown.stderr.strip()})")
            refused = subprocess.run(["/bin/sh", "-c", script.replace("%i", "x")],
                                     capture_output=True, text=True, env=values, timeout=60)
            checks.check(refused.returncode == 2 and "RestartPreventExitStatus" in unit_keys(unit)
                         and get("Service.RestartPreventExitStatus") == "2",
                         f"{name} as kvcm-executor@x: refused with exit 2, not restarted")
        else:
            argv = []
            for word in shlex.split(exec_start):
                word = re.sub(r"\$\{(\w+)\}", lambda m: values.get(m.group(1), ""), word)
                if re.fullmatch(r"\$\w+", word):
                    argv += values.get(word[1:], "").split()
                else:
                    argv.append(word)
        checks.check(argv[0].startswith(PREFIX) or argv[0] == "echo",
                     f"{name}: runs its binary from {PREFIX}")
        argv = argv[1:] if argv[0] == "echo" else argv
        check_command(checks, name, [pathlib.PurePath(argv[0]).name, *argv[1:]], bin_dir)
        checks.check("--run-dir" in argv and argv[argv.index("--run-dir") + 1] == "/run/kvcm",
                     f"{name}: --run-dir /run/kvcm")

    # The Prometheus target file for the units lists each at the port it listens on.
    listed = {}
    for group in json.loads((UNITS / "kvcm-targets.json").read_text()):
        for target in group["targets"]:
            listed[target] = group["labels"]
    expected = {environment["CACHE_MANAGER_METRICS"]: "cache-manager",
                f"{environment['ROUTER_HOSTNAME']}:{environment['ROUTER_PORT']}": "router",
                f"{environment['EXECUTOR_METRICS_HOST']}:9410": "executor",
                f"{environment['EXECUTOR_METRICS_HOST']}:9411": "executor"}
    checks.check({t: l.get("__kvcm_component") for t, l in listed.items()} == expected,
                 "kvcm-targets.json lists the cache manager, the router, kvcm-executor@0 and @1 "
                 "at their ports (kvcm.env, 9410 + N)")
    instances = [l.get("instance") for l in listed.values()]
    checks.check(len(set(instances)) == len(instances), "kvcm-targets.json: an instance each")

    executor = units["kvcm-executor@.service"]
    checks.check("kvcm-router.service" in " ".join(executor.get("Unit.Before", [])),
                 "executors are ordered before the router, so the router stops first")
    target = parse_unit(UNITS / "kvcm.target")
    checks.check(all(u in " ".join(target.get("Unit.Wants", []))
                     for u in ("kvcm-cache-manager.service", "kvcm-router.service")),
                 "kvcm.target wants the cache manager and the router")
    checks.check(all(u.get("Install.WantedBy", [""])[-1] == "kvcm.target" for u in units.values())
                 and all("kvcm.target" in u.get("Unit.PartOf", [""])[-1] for u in units.values()),
                 "every service is wanted by and part of kvcm.target")
    return checks.done()


def unit_keys(unit: dict[str, list[str]]) -> str:
    return " ".join(key.split(".", 1)[1] for key in unit)


if __name__ == "__main__":
    sys.exit(main())
