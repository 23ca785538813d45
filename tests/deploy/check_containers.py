#!/usr/bin/env python3
"""Checks deploy/docker/ (docs/operations.md, "Deployment") as far as a machine without
Docker can: the compose files parse as the Compose specification (compose-spec, which
refuses unknown keys; merge keys and ${VAR:-default} resolved first, as docker compose
does) and their references resolve; the stack's wiring (the executors and the router in
the cache manager's PID and IPC namespaces, one memory-backed run directory, every kvcm
flag one its binary accepts, Prometheus's targets at the ports the processes listen on,
monitoring/ mounted as it is); the Dockerfile's structure (named stages of Debian 12
images with tags, none `latest`, a non-root user that matches the compose file and the
run directory, no build packages in the runtime stage); and runtime-packages.sh on the
build's own binaries.

  check_containers.py BIN_DIR
"""

import copy
import json
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile

import yaml
from compose_spec import PyCompose

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from deploy_common import (ROOT, Checks, check_command, dockerfile_user,  # noqa: E402
                           flags_in, project_version)

DOCKER = ROOT / "deploy/docker"
KVCM_BINARIES = {"kvcm-cache-manager": "cache-manager", "kvcm-router": "router",
                 "kvcm-executor": "executor"}


def interpolate(text: str) -> str:
    """${NAME:-default} and ${NAME} with nothing set, as docker compose reads them."""
    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}",
                  lambda m: m.group(2) or "", text)


def load_compose(path: pathlib.Path) -> dict:
    data = yaml.safe_load(interpolate(path.read_text()))  # merge keys (<<) resolved here
    return {k: v for k, v in data.items() if not k.startswith("x-")}


def merge(base: dict, overlay: dict) -> dict:
    """docker compose -f base -f overlay, for what these files use: mappings merged,
    everything else (command, lists) replaced."""
    result = copy.deepcopy(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merge(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def check_spec(checks: Checks, name: str, data: dict) -> None:
    try:
        compose = PyCompose.from_yaml(yaml.safe_dump(data))
        compose.validate()
        checks.check(True, f"{name}: a valid Compose file ({len(compose.service_names())} services)")
    except ValueError as error:
        checks.check(False, f"{name}: a valid Compose file ({error})")


def listen_port(argv: list[str]) -> str:
    """The port a kvcm process serves /metrics on, from its command line."""
    if "--metrics-address" in argv:
        return argv[argv.index("--metrics-address") + 1].rsplit(":", 1)[1]
    if "--port" in argv:
        return argv[argv.index("--port") + 1]
    return ""


def check_compose(checks: Checks, bin_dir: pathlib.Path) -> None:
    raw = (DOCKER / "compose.yaml").read_text()
    compose = load_compose(DOCKER / "compose.yaml")
    gpu = load_compose(DOCKER / "compose.gpu.yaml")
    check_spec(checks, "compose.yaml", compose)
    check_spec(checks, "compose.yaml + compose.gpu.yaml", merge(compose, gpu))
    checks.check(set(gpu["services"]) <= set(compose["services"]),
                 "compose.gpu.yaml only adds to services of compose.yaml")

    # A deliberately broken copy is refused (the parser is no rubber stamp).
    broken = copy.deepcopy(compose)
    broken["services"]["router"]["pidd"] = "service:cache-manager"
    try:
        PyCompose.from_yaml(yaml.safe_dump(broken))
        checks.check(False, "a compose file with a misspelt key is refused")
    except ValueError:
        checks.check(True, "a compose file with a misspelt key is refused")

    services = compose["services"]
    version = project_version()
    user = dockerfile_user()
    uid = user.split(":")[0]
    kvcm = {name: s for name, s in services.items()
            if s.get("command") and s["command"][0] in KVCM_BINARIES}
    checks.check({"cache-manager", "router"} <= set(kvcm) and
                 any(s["command"][0] == "kvcm-executor" for s in kvcm.values()),
                 "compose.yaml runs a cache manager, a router and executors")
    build = services["cache-manager"].get("build", {})
    checks.check((DOCKER / build.get("context", "-") / build.get("dockerfile", "-")).is_file(),
                 "the build context and Dockerfile it names exist")
    run_volume = compose["volumes"].get("kvcm-run", {})
    options = dict(o.split("=", 1) for o in run_volume.get("driver_opts", {}).get("o", "").split(",") if "=" in o)
    checks.check(run_volume.get("driver_opts", {}).get("type") == "tmpfs"
                 and options.get("uid") == uid and options.get("mode") == "0700",
                 f"the run directory volume is in memory, owned by uid {uid}, mode 0700")
    holder = str(services["cache-manager"].get("pid", "")).removeprefix("service:")
    for name, service in kvcm.items():
        argv = [str(a) for a in service["command"]]
        check_command(checks, f"compose {name}", argv, bin_dir)
        checks.check(service.get("image") == f"kvcm:{version}",
                     f"compose {name}: image kvcm:{version} (the project's version)")
        checks.check(str(service.get("user")) == user, f"compose {name}: user {user}, the image's")
        checks.check("kvcm-run:/run/kvcm" in service.get("volumes", [])
                     and argv[argv.index("--run-dir") + 1] == "/run/kvcm",
                     f"compose {name}: the run directory volume at /run/kvcm, its --run-dir")
        checks.check(service.get("pid") == f"service:{holder}" and service.get("ipc") == f"service:{holder}",
                     f"compose {name}: in the shared PID and IPC namespaces (of {holder})")
        if name != "cache-manager":
            checks.check(service.get("depends_on", {}).get("cache-manager", {}).get("condition")
                         == "service_healthy", f"compose {name}: starts once the cache manager is healthy")
    holding = services.get(holder, {})
    checks.check(holder not in kvcm and holding.get("ipc") == "shareable"
                 and holding.get("image") == f"kvcm:{version}",
                 f"compose {holder}: holds the namespaces (IPC shareable) and runs no kvcm process, "
                 "so that a cache-manager restart does not end the others' PID namespace")
    health = services["cache-manager"].get("healthcheck", {}).get("test", [])
    if checks.check(health[:2] == ["CMD", "kvcmctl"], "compose cache-manager: healthcheck by kvcmctl"):
        check_command(checks, "compose cache-manager healthcheck", health[1:], bin_dir)
    for name, service in gpu["services"].items():
        if "command" in service:
            check_command(checks, f"compose.gpu.yaml {name}", [str(a) for a in service["command"]], bin_dir)

    # Images: tags, never latest; host ports used once.
    for name, service in services.items():
        image = service.get("image", "")
        checks.check(re.fullmatch(r"[\w./-]+:[\w.-]+", image) is not None and not image.endswith(":latest"),
                     f"compose {name}: image {image} has a tag, not latest")
    host_ports = [p.rsplit(":", 2)[-2] if p.count(":") >= 1 else p
                  for s in services.values() for p in s.get("ports", [])]
    checks.check(len(host_ports) == len(set(host_ports)), f"host ports used once ({', '.join(host_ports)})")

    # Bind mounts: every fixed source exists (a ${VAR} source is the operator's).
    raw_compose = yaml.safe_load(raw)
    for name, service in raw_compose["services"].items():
        for volume in service.get("volumes", []):
            source = str(volume).split(":", 1)[0]
            if source.startswith(".") and "${" not in source:
                checks.check((DOCKER / source).exists(), f"compose {name}: mounts {source}, which exists")

    # Prometheus: monitoring/prometheus/ as it is, and a target for every kvcm process at
    # the port it listens on, under the component its job keeps.
    prometheus = services["prometheus"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in prometheus["volumes"]}
    config_path = "/etc/prometheus/kvcm/prometheus.yml"
    checks.check(mounts.get(config_path) == "../../monitoring/prometheus/prometheus.yml"
                 and f"--config.file={config_path}" in prometheus["command"],
                 "prometheus runs monitoring/prometheus/prometheus.yml")
    config = yaml.safe_load((ROOT / "monitoring/prometheus/prometheus.yml").read_text())
    for rule_file in config["rule_files"]:
        folder, _, file = rule_file.partition("/")
        source = mounts.get(f"/etc/prometheus/kvcm/{folder}")
        checks.check(source is not None and (DOCKER / source / file).is_file(),
                     f"prometheus finds its rule file {rule_file} in a mounted folder")
    targets_source = mounts.get("/etc/prometheus/kvcm/targets", "")
    target_files = sorted((DOCKER / targets_source).glob("*.json")) if targets_source else []
    checks.check(bool(target_files), "prometheus has a target file mounted where prometheus.yml reads them")
    listed = {}
    for path in target_files:
        for group in json.loads(path.read_text()):
            for target in group["targets"]:
                listed[target] = group["labels"]
    instances = [labels.get("instance") for labels in listed.values()]
    checks.check(len(instances) == len(set(instances)), "every target has an instance of its own")
    for name, service in kvcm.items():
        argv = [str(a) for a in service["command"]]
        target = f"{name}:{listen_port(argv)}"
        component = KVCM_BINARIES[argv[0]]
        checks.check(listed.get(target, {}).get("__kvcm_component") == component,
                     f"prometheus scrapes {name} at {target} as {component}")
        if argv[0] == "kvcm-router":  # it answers 403 to a Host it does not know
            allowed = argv[argv.index("--allowed-hosts") + 1] if "--allowed-hosts" in argv else ""
            checks.check(name in [h.strip() for h in allowed.split(",")],
                         f"{name}'s --allowed-hosts names {name}, the Host prometheus scrapes it by")
    checks.check(all(t.split(":")[0] in kvcm for t in listed), "every target is a kvcm service")

    # Grafana: monitoring/grafana/ as it is; the datasource differs only by its address.
    grafana = services["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    provider = yaml.safe_load((ROOT / "monitoring/grafana/provisioning/dashboards/kvcm.yml").read_text())
    dashboards_path = provider["providers"][0]["options"]["path"]
    checks.check(mounts.get(dashboards_path) == "../../monitoring/grafana/dashboards",
                 f"grafana reads monitoring/grafana/dashboards at {dashboards_path}")
    checks.check(mounts.get("/etc/grafana/provisioning/dashboards")
                 == "../../monitoring/grafana/provisioning/dashboards",
                 "grafana provisions monitoring/grafana/provisioning/dashboards")
    ours = yaml.safe_load((DOCKER / "grafana/datasources/kvcm.yml").read_text())
    theirs = yaml.safe_load((ROOT / "monitoring/grafana/provisioning/datasources/kvcm.yml").read_text())
    url = ours["datasources"][0].pop("url")
    theirs["datasources"][0].pop("url")
    checks.check(mounts.get("/etc/grafana/provisioning/datasources") == "./grafana/datasources",
                 "grafana provisions deploy/docker/grafana/datasources")
    checks.check(ours == theirs, "its datasource is monitoring/'s but for the url")
    prometheus_port = prometheus["ports"][0].rsplit(":", 1)[1]
    checks.check(url == f"http://prometheus:{prometheus_port}",
                 f"its datasource url {url} is the prometheus service")


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
            for line in joined.splitlines() if line.strip()]


def check_dockerfile(checks: Checks, bin_dir: pathlib.Path) -> None:
    instructions = dockerfile_instructions((DOCKER / "Dockerfile").read_text())
    args = {}
    stages = []  # [name, base image, instructions]
    for op, rest in instructions:
        if op == "ARG" and not stages:
            key, _, value = rest.partition("=")
            args[key] = value
        elif op == "FROM":
            words = rest.split()
            image = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), ""), words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else ""
            stages.append([name, image, []])
        elif stages:
            stages[-1][2].append((op, rest))
    checks.check(len(stages) >= 2 and all(s[0] for s in stages),
                 f"Dockerfile: several stages, each named ({', '.join(s[0] or '?' for s in stages)})")
    for name, image, _ in stages:
        checks.check(re.fullmatch(r"debian:(12|bookworm)[\w.-]*", image) is not None,
                     f"Dockerfile stage {name}: Debian 12 ({image}), a tag and not latest")
    names = [s[0] for s in stages]
    for index, (name, _, body) in enumerate(stages):
        for op, rest in body:
            source = re.match(r"--from=(\S+)", rest) if op == "COPY" else None
            if source:
                checks.check(source.group(1) in names[:index],
                             f"Dockerfile stage {name}: COPY --from={source.group(1)} is an earlier stage")
            elif op == "COPY":
                for path in shlex.split(rest)[:-1]:
                    checks.check(path == "." or (ROOT / path).exists(),
                                 f"Dockerfile stage {name}: copies {path}, which exists")
            if op == "RUN":
                for script in re.findall(r"(?:scripts|deploy)/[\w./-]+\.sh", rest):
                    checks.check((ROOT / script).is_file(), f"Dockerfile stage {name}: runs {script}, which exists")
    final_name, _, final = stages[-1]
    users = [rest for op, rest in final if op == "USER"]
    uid = users[-1].split(":")[0] if users else "0"
    checks.check(bool(users) and uid not in ("0", "root"),
                 f"Dockerfile: the runtime stage runs as a user that is not root ({users[-1] if users else 'none'})")
    run_text = " ".join(rest for op, rest in final if op == "RUN")
    checks.check(f"--uid {uid}" in run_text and "-m 0700 /run/kvcm" in run_text,
                 f"Dockerfile: creates uid {uid} and its run directory /run/kvcm, mode 0700")
    build_packages = re.findall(r"\b[\w.+-]+-dev\b|\bbuild-essential\b|\bcmake\b|\bbootstrap\.sh\b", run_text)
    checks.check(not build_packages, f"Dockerfile: the runtime stage installs no build package"
                                     + (f" ({', '.join(build_packages)})" if build_packages else ""))
    commands = [json.loads(rest) for op, rest in final if op == "CMD"]
    if checks.check(len(commands) == 1 and commands[0][0] == "kvcm-launch",
                    "Dockerfile: the default command is kvcm-launch (exec form)"):
        launch_help = subprocess.run([str(bin_dir / "kvcm-launch"), "--help"], capture_output=True,
                                     text=True, timeout=30)
        documented = set(re.findall(r"--([a-z][a-z0-9-]*)", launch_help.stdout + launch_help.stderr))
        unknown = [f for f in flags_in(commands[0][1:]) if f not in documented]
        checks.check(not unknown, "Dockerfile: every flag of its kvcm-launch is one kvcm-launch takes"
                                  + (f" (not: {', '.join(unknown)})" if unknown else ""))
    ignored = (DOCKER / "Dockerfile.dockerignore").read_text().split()
    checks.check("build" in ignored and "build-*" in ignored and ".git" in ignored,
                 "Dockerfile.dockerignore keeps build trees and .git out of the context")


def check_runtime_packages(checks: Checks, bin_dir: pathlib.Path) -> None:
    binaries = [str(bin_dir / b) for b in ("kvcm-cache-manager", "kvcm-router", "kvcm-executor")]
    with tempfile.TemporaryDirectory() as copied:
        out = subprocess.run([str(DOCKER / "runtime-packages.sh"), "--copy-unowned", copied, *binaries],
                             capture_output=True, text=True, timeout=120)
        packages = out.stdout.split()
        checks.check(out.returncode == 0 and len(packages) > 5,
                     f"runtime-packages.sh names the packages of the binaries' libraries ({len(packages)})"
                     + ("" if out.returncode == 0 else f": {out.stderr.strip()}"))
        dev = [p for p in packages if p.endswith("-dev")]
        checks.check(not dev, "runtime-packages.sh names no -dev package")
        for library, package in (("libzmq.so.5", "libzmq5"), ("libstdc++.so.6", "libstdc++6")):
            checks.check(package in packages, f"runtime-packages.sh names {package} for {library}")
        ldd = subprocess.run(["ldd", *binaries], capture_output=True, text=True).stdout
        unowned = [p.name for p in pathlib.Path(copied).iterdir()]
        checks.check(all(name in ldd for name in unowned),
                     f"what no package holds was copied ({', '.join(unowned) or 'nothing'})")


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    bin_dir = pathlib.Path(sys.argv[1]).resolve()
    checks = Checks("deploy/docker")
    check_compose(checks, bin_dir)
    check_dockerfile(checks, bin_dir)
    check_runtime_packages(checks, bin_dir)
    return checks.done()


if __name__ == "__main__":
    sys.exit(main())
