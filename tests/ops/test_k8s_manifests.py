"""ops/k8s: the Kubernetes manifests of compose.yaml's two topologies, a kustomize base (the
ConfigMap with the Redis URLs, the gateway, the bus and store Redis servers) and two overlays,
`aggregated` (2 `worker`) and `disagg` (2 `prefill`, 1 `decode`).

Every kustomization is a plain list of files and directories (no patches, generators or
transformers), so rendering an overlay is concatenating what it lists, recursively; where a
`kubectl` with kustomize is on PATH its rendering must agree. Each rendered document is
validated offline against the Kubernetes JSON schemas that `kubernetes-validate` bundles (strict:
unknown fields are errors), for every Kubernetes version the package carries; a deliberately
broken document must be rejected. The references between documents (Service selectors, env and
args, probe ports, URLs to Services) are checked here, and the commands, flags, environment,
replicas, probes and Redis settings against compose.yaml's.

None of this applies the manifests to a cluster."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate  # the dev extra; missing, this module fails rather than skips
import pytest
import yaml
from kubernetes_validate import utils as kv_utils

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "ops" / "k8s"
OVERLAYS = {
    "aggregated": {"worker": 2},
    "disagg": {"prefill": 2, "decode": 1},
}
KVSERVE_APPS = ("gateway", "worker", "prefill", "decode")
WORKERS = ("worker", "prefill", "decode")
# Named in the ConfigMap but deliberately not deployed: the collector is the user's to run (or
# its line deleted), and every container reads it with `optional: true`.
OPTIONAL_SERVICES = {"otel-collector"}
KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources"}
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
COMPOSE_VAR = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*:-([^}]*)\}")
SCHEMA_VERSIONS = sorted(set(kv_utils.all_versions()), key=lambda v: tuple(map(int, v.split("."))))

Doc = dict[str, Any]


# --- rendering ------------------------------------------------------------------------------


def render(directory: Path) -> list[Doc]:
    """What `kustomize build directory` gives for a kustomization that only lists resources."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    extra = set(kustomization) - KUSTOMIZATION_KEYS
    assert not extra, f"{directory}: only plain resource lists are rendered here, not {extra}"
    assert kustomization["kind"] == "Kustomization"
    docs: list[Doc] = []
    for entry in kustomization["resources"]:
        path = (directory / entry).resolve()
        if path.is_dir():
            docs += render(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def key(doc: Doc) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def by_kind(docs: list[Doc], kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def containers(deployment: Doc) -> list[Doc]:
    return list(deployment["spec"]["template"]["spec"]["containers"])


def env_of(container: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in container.get("env", [])}


@pytest.fixture(scope="module", params=sorted(OVERLAYS))
def overlay(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def docs(overlay: str) -> list[Doc]:
    return render(K8S / overlay)


@pytest.fixture(scope="module")
def compose() -> dict[str, Doc]:
    return dict(yaml.safe_load((ROOT / "compose.yaml").read_text())["services"])


def test_the_layout() -> None:
    """A namespace-agnostic base and two overlays that add only their workers."""
    base = {key(d) for d in render(K8S / "base")}
    assert base == {
        ("ConfigMap", "kvserve"),
        ("Deployment", "gateway"), ("Service", "gateway"),
        ("Deployment", "bus"), ("Service", "bus"),
        ("Deployment", "store"), ("Service", "store"),
    }  # fmt: skip
    for name, workers in OVERLAYS.items():
        added = {key(d) for d in render(K8S / name)} - base
        assert added == {(kind, w) for w in workers for kind in ("Deployment", "Service")}
    for path in K8S.rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            assert "namespace" not in doc.get("metadata", {}), path


def test_no_duplicate_documents(docs: list[Doc]) -> None:
    keys = [key(d) for d in docs]
    assert len(keys) == len(set(keys)), keys


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with kustomize) not on PATH")
def test_kubectl_kustomize_renders_the_same(overlay: str, docs: list[Doc]) -> None:
    result = subprocess.run(
        ["kubectl", "kustomize", str(K8S / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    theirs = [d for d in yaml.safe_load_all(result.stdout) if d is not None]
    assert sorted(theirs, key=key) == sorted(docs, key=key)


# --- schema validation ----------------------------------------------------------------------


def validate(doc: Doc, version: str) -> None:
    kubernetes_validate.validate(doc, version, strict=True)


def test_schemas_are_bundled() -> None:
    """Offline: the package carries its schemas (nothing is downloaded to validate), for a
    range of Kubernetes versions that reaches back to 1.28 at least."""
    oldest = tuple(map(int, SCHEMA_VERSIONS[0].split(".")))
    assert len(SCHEMA_VERSIONS) >= 2 and oldest <= (1, 28, 0), SCHEMA_VERSIONS


def test_every_document_validates(docs: list[Doc]) -> None:
    for version in SCHEMA_VERSIONS:
        for doc in docs:
            try:
                validate(doc, version)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{key(doc)} against Kubernetes {version}: {e.message} at {e.path}")


def _gateway(docs: list[Doc]) -> Doc:
    return copy.deepcopy(by_kind(docs, "Deployment")["gateway"])


@pytest.mark.parametrize(
    "breakage",
    ["replicas as a string", "container without a name", "misspelt field", "port as a word"],
)
def test_the_validator_rejects_a_broken_document(docs: list[Doc], breakage: str) -> None:
    broken = _gateway(docs)
    container = containers(broken)[0]
    if breakage == "replicas as a string":
        broken["spec"]["replicas"] = "two"
    elif breakage == "container without a name":
        del container["name"]
    elif breakage == "misspelt field":
        container["imagePulPolicy"] = container.pop("imagePullPolicy")
    else:
        container["ports"][0]["containerPort"] = "eight thousand"
    validate(_gateway(docs), SCHEMA_VERSIONS[-1])  # the unbroken copy passes
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(broken, SCHEMA_VERSIONS[-1])


# --- references between documents -----------------------------------------------------------


def _port_names_and_numbers(container: Doc) -> set[str | int]:
    found: set[str | int] = set()
    for port in container.get("ports", []):
        found.add(port["containerPort"])
        if "name" in port:
            found.add(port["name"])
    return found


def _selected(service: Doc, deployments: dict[str, Doc]) -> list[Doc]:
    selector = service["spec"].get("selector") or {}
    return [
        d
        for d in deployments.values()
        if selector and selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
    ]


def _url_hosts(value: str) -> list[tuple[str, int | None]]:
    """The host (and port) of every URL in a string."""
    return [
        (parts.hostname, parts.port)
        for parts in (urlsplit(u) for u in re.findall(r"[a-z+]+://[^\s\"']+", value))
        if parts.hostname
    ]


def reference_problems(docs: list[Doc]) -> list[str]:
    """Every broken reference between the documents, as sentences (none: all hold)."""
    problems: list[str] = []
    deployments = by_kind(docs, "Deployment")
    services = by_kind(docs, "Service")
    configmaps = by_kind(docs, "ConfigMap")

    for name, d in deployments.items():
        labels = d["spec"]["template"]["metadata"]["labels"]
        if not d["spec"]["selector"]["matchLabels"].items() <= labels.items():
            problems.append(f"Deployment {name}: its selector does not match its pods' labels")
        others = [o for o in deployments.values() if o is not d]
        for other in others:
            sel = other["spec"]["selector"]["matchLabels"]
            if sel.items() <= labels.items():
                problems.append(f"Deployment {other['metadata']['name']} selects {name}'s pods")

    for name, s in services.items():
        selected = _selected(s, deployments)
        if len(selected) != 1:
            problems.append(f"Service {name} selects {len(selected)} Deployments, not 1")
            continue
        ports = set().union(*(_port_names_and_numbers(c) for c in containers(selected[0])))
        for port in s["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            if target not in ports:
                problems.append(f"Service {name}: targetPort {target} is no container port")

    def check_host(where: str, host: str, port: int | None) -> None:
        if host in OPTIONAL_SERVICES:
            return
        if host not in services:
            problems.append(f"{where}: {host} is no Service")
        elif port is not None and port not in {p["port"] for p in services[host]["spec"]["ports"]}:
            problems.append(f"{where}: Service {host} has no port {port}")

    for cm_name, cm in configmaps.items():
        for k, value in cm.get("data", {}).items():
            for host, port in _url_hosts(str(value)):
                check_host(f"ConfigMap {cm_name} {k}", host, port)

    for name, d in deployments.items():
        pod = d["spec"]["template"]["spec"]
        volumes = {v["name"] for v in pod.get("volumes", [])}
        for c in containers(d):
            where = f"Deployment {name} container {c['name']}"
            env = env_of(c)
            for e in env.values():
                ref = e.get("valueFrom", {}).get("configMapKeyRef")
                if ref is not None:
                    cm = configmaps.get(ref["name"])
                    if cm is None:
                        problems.append(f"{where}: env {e['name']}: no ConfigMap {ref['name']}")
                    elif ref["key"] not in cm.get("data", {}) and not ref.get("optional"):
                        problems.append(f"{where}: env {e['name']}: no key {ref['key']}")
                field = e.get("valueFrom", {}).get("resourceFieldRef")
                if field is not None and field.get("containerName", c["name"]) != c["name"]:
                    problems.append(f"{where}: env {e['name']} reads another container")
                if "value" in e:
                    for host, port in _url_hosts(str(e["value"])):
                        check_host(f"{where} env {e['name']}", host, port)
            for arg in [*c.get("command", []), *c.get("args", [])]:
                for var in VAR_REF.findall(str(arg)):
                    if var not in env:
                        problems.append(f"{where}: $({var}) in its args is not in its env")
                for host, port in _url_hosts(str(arg)):
                    check_host(f"{where} args", host, port)
            ports = _port_names_and_numbers(c)
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                action = c.get(probe, {})
                for kind in ("httpGet", "tcpSocket", "grpc"):
                    if kind in action and action[kind]["port"] not in ports:
                        port = action[kind]["port"]
                        problems.append(f"{where}: {probe} port {port} is no container port")
            for mount in c.get("volumeMounts", []):
                if mount["name"] not in volumes:
                    problems.append(f"{where}: volumeMount {mount['name']} is no pod volume")
    return problems


def test_references_hold(docs: list[Doc]) -> None:
    assert reference_problems(docs) == []


def _break_selector(docs: list[Doc]) -> None:
    by_kind(docs, "Service")["gateway"]["spec"]["selector"]["app.kubernetes.io/component"] = "gw"


def _break_probe(docs: list[Doc]) -> None:
    containers(by_kind(docs, "Deployment")["gateway"])[0]["readinessProbe"]["httpGet"]["port"] = 80


def _break_env(docs: list[Doc]) -> None:
    env = containers(by_kind(docs, "Deployment")["gateway"])[0]["env"]
    env[:] = [e for e in env if e["name"] != "KVSERVE_BUS_URL"]


def _break_url(docs: list[Doc]) -> None:
    by_kind(docs, "ConfigMap")["kvserve"]["data"]["KVSERVE_STORE_URL"] = "redis://stor:6379/0"


def _break_target_port(docs: list[Doc]) -> None:
    by_kind(docs, "Service")["bus"]["spec"]["ports"][0]["targetPort"] = "resp"


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        (_break_selector, "Service gateway selects 0 Deployments"),
        (_break_probe, "readinessProbe port 80 is no container port"),
        (_break_env, "$(KVSERVE_BUS_URL) in its args is not in its env"),
        (_break_url, "stor is no Service"),
        (_break_target_port, "targetPort resp is no container port"),
    ],
)
def test_broken_references_are_found(docs: list[Doc], breakage: Any, expected: str) -> None:
    broken = copy.deepcopy(docs)
    breakage(broken)
    problems = reference_problems(broken)
    assert any(expected in p for p in problems), problems


# --- the same services as compose.yaml ------------------------------------------------------


def _compose_command(service: Doc) -> list[str]:
    """compose's command with each ${VAR:-default} at its default."""
    return [COMPOSE_VAR.sub(r"\1", str(part)) for part in service["command"]]


def _expanded_args(container: Doc, config: dict[str, str]) -> list[str]:
    """The container's args as the kubelet expands them: $(VAR) from its env."""
    values: dict[str, str] = {}
    for name, e in env_of(container).items():
        if "value" in e:
            values[name] = str(e["value"])
        elif "configMapKeyRef" in e.get("valueFrom", {}):
            values[name] = config[e["valueFrom"]["configMapKeyRef"]["key"]]
    return [VAR_REF.sub(lambda m: values[m.group(1)], str(a)) for a in container["args"]]


def test_commands_and_flags_are_composes(docs: list[Doc], compose: dict[str, Doc]) -> None:
    config = by_kind(docs, "ConfigMap")["kvserve"]["data"]
    for name, d in by_kind(docs, "Deployment").items():
        (container,) = containers(d)
        assert "command" not in container, "the image's ENTRYPOINT (kvserve, docker-entrypoint)"
        assert _expanded_args(container, config) == _compose_command(compose[name]), name


def test_redis_servers(docs: list[Doc], compose: dict[str, Doc]) -> None:
    deployments = by_kind(docs, "Deployment")
    for name, policy in (("bus", "noeviction"), ("store", "allkeys-lru")):
        (redis,) = containers(deployments[name])
        args = [str(a) for a in redis["args"]]
        assert redis["image"] == COMPOSE_VAR.sub(r"\1", compose[name]["image"]) == "redis:7"
        assert args[args.index("--maxmemory-policy") + 1] == policy
        assert args[args.index("--save") + 1] == "" and args[args.index("--appendonly") + 1] == "no"
        assert "volumes" not in deployments[name]["spec"]["template"]["spec"]  # nothing on disk
        assert deployments[name]["spec"]["replicas"] == 1
        assert deployments[name]["spec"]["strategy"]["type"] == "Recreate"
        maxmemory = _bytes(args[args.index("--maxmemory") + 1])
        limit = _bytes(redis["resources"]["limits"]["memory"])
        assert limit >= 1.25 * maxmemory, (name, "headroom above maxmemory")
        for probe in ("readinessProbe", "livenessProbe"):
            assert redis[probe]["exec"]["command"] == ["redis-cli", "ping"]
    urls = by_kind(docs, "ConfigMap")["kvserve"]["data"]
    assert urls["KVSERVE_BUS_URL"] == "redis://bus:6379/0"
    assert urls["KVSERVE_STORE_URL"] == "redis://store:6379/0"


def _bytes(quantity: str) -> int:
    """A Kubernetes memory quantity (Mi, Gi) or a Redis size (mb, gb: powers of 1024)."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "kb": 1 << 10, "mb": 1 << 20}
    units["gb"] = 1 << 30
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(quantity[: -len(suffix)]) * factor
    return int(quantity)


def _seconds(duration: str) -> int:
    """A compose duration: 40s, 5m."""
    return int(duration[:-1]) * {"s": 1, "m": 60}[duration[-1]]


def test_replicas(overlay: str, docs: list[Doc], compose: dict[str, Doc]) -> None:
    deployments = by_kind(docs, "Deployment")
    assert deployments["gateway"]["spec"]["replicas"] == 1
    for name, replicas in OVERLAYS[overlay].items():
        assert deployments[name]["spec"]["replicas"] == replicas
        assert compose[name]["deploy"]["replicas"] == replicas


def test_one_image_pulled_if_not_present(docs: list[Doc]) -> None:
    for name, d in by_kind(docs, "Deployment").items():
        for c in containers(d):
            assert c["imagePullPolicy"] == "IfNotPresent", name
            if name in KVSERVE_APPS:
                assert c["image"] == "kvserve:latest", name
            # the schema lets a container omit its image; the API server does not
            assert c.get("image"), name


def test_tracing_env(docs: list[Doc], compose: dict[str, Doc]) -> None:
    config = by_kind(docs, "ConfigMap")["kvserve"]["data"]
    for name, d in by_kind(docs, "Deployment").items():
        if name not in KVSERVE_APPS:
            continue
        (container,) = containers(d)
        env = env_of(container)
        want = compose[name]["environment"]
        assert env["OTEL_SERVICE_NAME"]["value"] == want["OTEL_SERVICE_NAME"]
        for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL"):
            ref = env[var]["valueFrom"]["configMapKeyRef"]
            assert ref["optional"] is True  # no collector: delete the ConfigMap's line
            assert config[ref["key"]] == want[var]


def test_probes(docs: list[Doc], compose: dict[str, Doc]) -> None:
    deployments = by_kind(docs, "Deployment")
    (gateway,) = containers(deployments["gateway"])
    assert gateway["startupProbe"]["httpGet"]["path"] == "/health"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/health"
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert gateway["ports"] == [{"name": "http", "containerPort": 8000}]
    assert "/health" in str(compose["gateway"]["healthcheck"]["test"])
    for name in WORKERS:
        if name not in deployments:
            continue
        (worker,) = containers(deployments[name])
        assert worker["ports"] == [{"name": "metrics", "containerPort": 9100}]
        assert "127.0.0.1:9100/metrics" in str(compose[name]["healthcheck"]["test"])
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert worker[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}
        # compose: interval 15s, timeout 5s, retries 3
        live = worker["livenessProbe"]
        timing = [live[k] for k in ("periodSeconds", "timeoutSeconds", "failureThreshold")]
        assert timing == [15, 5, 3]
        # the startup grace covers the CPU kernels' build (well under a minute) and the load
        start = worker["startupProbe"]
        grace = _seconds(compose[name]["healthcheck"]["start_period"])
        assert start["periodSeconds"] * start["failureThreshold"] >= max(grace, 300)


def test_kernels_volume_and_grace(docs: list[Doc], compose: dict[str, Doc]) -> None:
    """Each engine pod builds the CPU kernels once, into an emptyDir of its own at compose's
    mount point; every kvserve pod gets compose's 40 s to drain."""
    for name, d in by_kind(docs, "Deployment").items():
        pod = d["spec"]["template"]["spec"]
        if name not in KVSERVE_APPS:
            continue
        assert pod["terminationGracePeriodSeconds"] == 40
        assert _seconds(compose[name]["stop_grace_period"]) == 40
        assert pod["securityContext"]["runAsUser"] == 10001  # the image's `kvserve` user
        if name == "gateway":
            continue  # no engine, no kernels
        (worker,) = containers(d)
        assert worker["volumeMounts"] == [{"name": "kernels", "mountPath": "/models/kernels"}]
        assert pod["volumes"] == [{"name": "kernels", "emptyDir": {}}]
        assert "kernels:/models/kernels" in compose[name]["volumes"]


def test_resources(docs: list[Doc]) -> None:
    for name, d in by_kind(docs, "Deployment").items():
        for c in containers(d):
            requests, limits = c["resources"]["requests"], c["resources"]["limits"]
            assert set(requests) == set(limits) == {"cpu", "memory"}, name
            assert _bytes(requests["memory"]) <= _bytes(limits["memory"]), name
        if name in WORKERS:
            (worker,) = containers(d)
            threads = env_of(worker)["OMP_NUM_THREADS"]["valueFrom"]["resourceFieldRef"]
            assert threads["resource"] == "limits.cpu"  # torch's threads: the pod's cores
