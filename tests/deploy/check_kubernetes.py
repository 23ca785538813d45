#!/usr/bin/env python3
"""Checks deploy/kubernetes/ (docs/operations.md, "Deployment"): every built-in object
against the Kubernetes API's schemas (kubernetes-validate, strict: an unknown field is an
error) for the oldest and the newest release it ships the schemas of that we support; the
Prometheus Operator's objects (ServiceMonitor, PrometheusRule: CRDs, whose schemas it does
not ship) by their structure; the PrometheusRules equal to monitoring/prometheus/rules/
(and generated from them); and the Pod's wiring: one PID namespace, a memory-backed run
directory that every container mounts and names, probes on ports and paths its processes
serve, the Service's and ServiceMonitor's ports, the jobs and instances monitoring/ uses,
every kvcm flag one its binary accepts, the image and user of deploy/docker/.

  check_kubernetes.py BIN_DIR
"""

import copy
import pathlib
import subprocess
import sys

import kubernetes_validate
import yaml

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from deploy_common import (ROOT, Checks, check_command, dockerfile_user,  # noqa: E402
                           project_version)

K8S = ROOT / "deploy/kubernetes"
VERSIONS = ["1.30.0", "1.37.0"]
CRDS = {"ServiceMonitor", "PrometheusRule"}
# What each process serves over HTTP (common/metrics/metrics_server.h; the router's
# services/router/http_frontend.h).
SERVED = {"kvcm-cache-manager": {"/metrics"}, "kvcm-executor": {"/metrics"},
          "kvcm-router": {"/metrics", "/health", "/info", "/v1/models"}}
JOBS = {"kvcm-cache-manager": "kvcm-cache-manager", "kvcm-router": "kvcm-router",
        "kvcm-executor": "kvcm-executor"}


def validate(checks: Checks, where: str, doc: dict) -> None:
    for version in VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
            checks.check(True, f"{where}: valid for Kubernetes {version} (strict)")
        except kubernetes_validate.ValidationError as error:
            checks.check(False, f"{where}: valid for Kubernetes {version} (strict): "
                                f"{error.message if hasattr(error, 'message') else error}"[:400])


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    bin_dir = pathlib.Path(sys.argv[1]).resolve()
    checks = Checks("deploy/kubernetes")
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    checks.check(sorted(kustomization["resources"]) == files,
                 f"kustomization.yaml lists every manifest ({', '.join(files)})")
    objects = {}
    for name in files:
        for doc in yaml.safe_load_all((K8S / name).read_text()):
            if doc:
                objects[(doc["kind"], doc["metadata"]["name"])] = doc
                where = f"{name}: {doc['kind']} {doc['metadata']['name']}"
                if doc["kind"] in CRDS:
                    checks.check(doc["apiVersion"] == "monitoring.coreos.com/v1"
                                 and set(doc) == {"apiVersion", "kind", "metadata", "spec"},
                                 f"{where}: monitoring.coreos.com/v1 (CRD: checked by structure)")
                else:
                    validate(checks, where, doc)
                checks.check(doc["metadata"].get("namespace", "kvcm") == "kvcm",
                             f"{where}: in the namespace kvcm")

    # The schemas catch what they should (the check is no rubber stamp).
    daemonset = objects[("DaemonSet", "kvcm")]
    broken = copy.deepcopy(daemonset)
    broken["spec"]["template"]["spec"]["shareProcessNamespaces"] = True
    try:
        kubernetes_validate.validate(broken, VERSIONS[-1], strict=True)
        checks.check(False, "a DaemonSet with a misspelt field is refused")
    except kubernetes_validate.ValidationError:
        checks.check(True, "a DaemonSet with a misspelt field is refused")

    # The Pod.
    pod = daemonset["spec"]["template"]["spec"]
    checks.check(pod.get("shareProcessNamespace") is True, "the Pod shares one PID namespace")
    run = [v for v in pod["volumes"] if v["name"] == "run"]
    checks.check(bool(run) and run[0].get("emptyDir", {}).get("medium") == "Memory",
                 "the run directory is a memory-backed emptyDir")
    user = dockerfile_user().split(":")
    checks.check([str(pod["securityContext"].get("runAsUser")), str(pod["securityContext"].get("runAsGroup"))]
                 == user and pod["securityContext"].get("runAsNonRoot") is True,
                 f"the Pod runs as {':'.join(user)}, the image's user")
    containers = {c["name"]: c for c in pod["containers"]}
    binaries = {name: c["command"][0] for name, c in containers.items()}
    checks.check(sorted(set(binaries.values())) == sorted(SERVED),
                 f"the Pod holds a cache manager, a router and executors ({', '.join(containers)})")
    run_dirs = set()
    version = project_version()
    ports_by_name = {}
    for name, container in containers.items():
        argv = [str(a) for a in container["command"]]
        check_command(checks, f"container {name}", argv, bin_dir)
        mount = [m for m in container.get("volumeMounts", []) if m["name"] == "run"]
        run_dir = argv[argv.index("--run-dir") + 1] if "--run-dir" in argv else ""
        run_dirs.add(run_dir)
        checks.check(bool(mount) and run_dir.startswith(mount[0]["mountPath"] + "/"),
                     f"container {name}: its --run-dir {run_dir} is inside the run volume "
                     "(a folder of its own: the cache manager makes it 0700)")
        checks.check(container["image"] == f"kvcm:{version}", f"container {name}: image kvcm:{version}")
        declared = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        ports_by_name.update(declared)
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            http = container.get(probe, {}).get("httpGet")
            if http:
                checks.check(http["port"] in declared and http["path"] in SERVED[argv[0]],
                             f"container {name}: {probe} GET {http['path']} on its port {http['port']}")
        checks.check("livenessProbe" in container, f"container {name}: has a liveness probe")
        address = argv[argv.index("--metrics-address") + 1] if "--metrics-address" in argv else None
        port = int(address.rsplit(":", 1)[1]) if address else int(argv[argv.index("--port") + 1])
        checks.check(port in declared.values(), f"container {name}: declares the port it listens on ({port})")
        host = address.rsplit(":", 1)[0] if address else argv[argv.index("--hostname") + 1]
        checks.check(host == "0.0.0.0", f"container {name}: listens on the Pod's address (probes, scrapes)")
        security = container.get("securityContext", {})
        checks.check(security.get("allowPrivilegeEscalation") is False
                     and security.get("readOnlyRootFilesystem") is True
                     and security.get("capabilities", {}).get("drop") == ["ALL"],
                     f"container {name}: no privilege escalation, read-only root, no capabilities")
    checks.check(len(run_dirs) == 1, f"every container names the same run directory ({', '.join(sorted(run_dirs))})")
    router = [c for c in containers.values() if c["command"][0] == "kvcm-router"][0]
    checks.check(router.get("readinessProbe", {}).get("httpGet", {}).get("path") == "/health",
                 "the router is ready only with an executor (/health)")

    # The Service and the ServiceMonitor.
    service = objects[("Service", "kvcm")]
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    checks.check(all(labels.get(k) == v for k, v in service["spec"]["selector"].items()),
                 "the Service selects the DaemonSet's Pods")
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    for name, port in service_ports.items():
        checks.check(port["targetPort"] in ports_by_name, f"Service port {name}: targets a container port")
    monitor = objects[("ServiceMonitor", "kvcm")]
    checks.check(all(service["metadata"]["labels"].get(k) == v
                     for k, v in monitor["spec"]["selector"]["matchLabels"].items()),
                 "the ServiceMonitor selects the Service")
    jobs = {c["job_name"] for c in yaml.safe_load(
        (ROOT / "monitoring/prometheus/prometheus.yml").read_text())["scrape_configs"]}
    scraped = set()
    for endpoint in monitor["spec"]["endpoints"]:
        port = endpoint["port"]
        container = [c for c in containers.values()
                     if port in {p["name"] for p in c.get("ports", [])}]
        job = [r.get("replacement") for r in endpoint.get("relabelings", []) if r.get("targetLabel") == "job"]
        instance = [r for r in endpoint.get("relabelings", []) if r.get("targetLabel") == "instance"]
        checks.check(port in service_ports and bool(container),
                     f"ServiceMonitor endpoint {port}: a port of the Service and of a container")
        if container:
            binary = container[0]["command"][0]
            scraped.add(binary)
            checks.check(job == [JOBS[binary]] and JOBS[binary] in jobs,
                         f"ServiceMonitor endpoint {port}: job {JOBS[binary]}, as in monitoring/prometheus/")
            checks.check(bool(instance) and "__meta_kubernetes_pod_node_name" in instance[0].get("sourceLabels", []),
                         f"ServiceMonitor endpoint {port}: instance NODE:NAME, fixed across restarts")
    checks.check(scraped == set(SERVED), "the ServiceMonitor scrapes every process")

    # The PrometheusRules: generated from monitoring/prometheus/rules/ and equal to them.
    generated = subprocess.run([sys.executable, str(K8S / "generate_prometheusrule.py"), "--check"],
                               capture_output=True, text=True, timeout=60)
    checks.check(generated.returncode == 0, "prometheusrule.yaml is what generate_prometheusrule.py writes"
                 + ("" if generated.returncode == 0 else f": {generated.stderr.strip()}"))
    for rule_file in sorted((ROOT / "monitoring/prometheus/rules").glob("*.yml")):
        rule = objects.get(("PrometheusRule", rule_file.stem))
        source = yaml.safe_load(rule_file.read_text())
        checks.check(rule is not None and rule["spec"] == source,
                     f"PrometheusRule {rule_file.stem}: the groups of monitoring/prometheus/rules/{rule_file.name}")
    return checks.done()


if __name__ == "__main__":
    sys.exit(main())
