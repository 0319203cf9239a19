"""compose.yaml, .env, ops/Dockerfile and ops/otel-collector.yaml: two Redis servers (the bus,
never evicted, and the prefix store, an LRU cache), the gateway, the collector and Jaeger in every
profile, and the workers of one of two topologies by
compose profile: `aggregated` (`worker` replicas behind the routing gateway; the default, set in
.env) or `disagg` (`prefill` and `decode`, DESIGN.md section 2)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
APP_SERVICES = ("gateway", "worker", "prefill", "decode")
WORKERS = ("worker", "prefill", "decode")
PROFILES = {"worker": ["aggregated"], "prefill": ["disagg"], "decode": ["disagg"]}
BUS_URL = "redis://bus:6379/0"
STORE_URL = "redis://store:6379/0"


def _load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


def _defaults(value: Any) -> Any:
    """`value` with every ${VAR:-default} as its default: what a plain `up` gets."""
    if isinstance(value, dict):
        return {k: _defaults(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_defaults(v) for v in value]
    if isinstance(value, str):
        return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)
    return value


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    compose = _load(ROOT / "compose.yaml")
    services: dict[str, dict[str, Any]] = _defaults(compose["services"])
    return services


@pytest.fixture(scope="module")
def collector() -> dict[str, Any]:
    return _load(ROOT / "ops" / "otel-collector.yaml")


def _flag(command: list[str], name: str) -> str:
    assert name in command, f"{name} missing from {command}"
    return command[command.index(name) + 1]


def test_eight_services(services: dict[str, dict[str, Any]]) -> None:
    assert set(services) == {
        "bus", "store", "gateway", "worker", "prefill", "decode", "otel-collector", "jaeger"
    }  # fmt: skip


def test_profiles(services: dict[str, dict[str, Any]]) -> None:
    """The workers of each topology under its profile; everything else runs under both."""
    assert {name: s["profiles"] for name, s in services.items() if "profiles" in s} == PROFILES


def test_the_default_profile_is_aggregated() -> None:
    lines = (ROOT / ".env").read_text().splitlines()
    settings = [line for line in lines if line.strip() and not line.lstrip().startswith("#")]
    assert settings == ["COMPOSE_PROFILES=aggregated"]


def test_replicas(services: dict[str, dict[str, Any]]) -> None:
    assert services["worker"]["deploy"]["replicas"] == 2
    assert services["prefill"]["deploy"]["replicas"] == 2
    assert services["decode"]["deploy"]["replicas"] == 1


@pytest.mark.parametrize(
    ("name", "maxmemory", "policy"),
    [
        # The bus: never evicted; at its bound Redis refuses writes.
        ("bus", "1gb", "noeviction"),
        # The store: recomputable blocks, the least recently used evicted at the bound.
        ("store", "2gb", "allkeys-lru"),
    ],
)
def test_redis_bus_never_evicts_the_store_is_an_lru_cache(
    services: dict[str, dict[str, Any]], name: str, maxmemory: str, policy: str
) -> None:
    redis = services[name]
    assert redis["image"].split(":")[0] == "redis"
    command = [str(c) for c in redis["command"]]
    assert command[0] == "redis-server"
    assert _flag(command, "--maxmemory") == maxmemory
    assert _flag(command, "--maxmemory-policy") == policy
    assert _flag(command, "--save") == ""
    assert _flag(command, "--appendonly") == "no"
    assert "redis-cli" in redis["healthcheck"]["test"] and "ping" in redis["healthcheck"]["test"]


def test_one_image_for_all_kvserve_services(services: dict[str, dict[str, Any]]) -> None:
    builds = [services[name]["build"] for name in APP_SERVICES]
    assert builds[0] == {
        "context": ".",
        "dockerfile": "ops/Dockerfile",
        "args": {"BASE_IMAGE": "python:3.11-slim", "OFFLINE": "0"},  # an online build by default
    }
    assert all(b == builds[0] for b in builds)
    assert {services[name]["image"] for name in APP_SERVICES} == {"kvserve:latest"}
    assert (ROOT / "ops" / "Dockerfile").is_file()


def test_kernels_are_built_once_per_host(services: dict[str, dict[str, Any]]) -> None:
    """Every kvserve container shares one volume for the CPU kernels (the first builds, the
    others wait for it and load), which the image makes writable for the service user."""
    compose = _load(ROOT / "compose.yaml")
    assert "kernels" in compose["volumes"]
    for name in APP_SERVICES:
        assert "kernels:/models/kernels" in services[name]["volumes"]
    dockerfile = (ROOT / "ops" / "Dockerfile").read_text()
    assert "chown kvserve:kvserve /models/store /models/kernels" in dockerfile


def test_commands(services: dict[str, dict[str, Any]]) -> None:
    gateway = [str(c) for c in services["gateway"]["command"]]
    assert gateway[0] == "gateway"
    assert _flag(gateway, "--bus") == BUS_URL and "--store" not in gateway
    assert (_flag(gateway, "--host"), _flag(gateway, "--port")) == ("0.0.0.0", "8000")
    assert _flag(gateway, "--routing") == "cache-aware"
    for name in WORKERS:
        command = [str(c) for c in services[name]["command"]]
        assert command[0] == name
        assert _flag(command, "--bus") == BUS_URL
        assert _flag(command, "--store") == STORE_URL
        assert _flag(command, "--metrics-port") == "9100"
        # kvserve binds 127.0.0.1 by default; the collector scrapes over the compose network.
        assert _flag(command, "--metrics-host") == "0.0.0.0"
    # Blocks in Redis are in the KV cache's own format by default (--store-format auto).
    assert all("--store-format" not in services[n]["command"] for n in WORKERS)


def test_workers_alike(services: dict[str, dict[str, Any]]) -> None:
    """The aggregated worker runs like prefill and decode: same health check and drain grace."""
    for name in WORKERS:
        test = services[name]["healthcheck"]["test"]
        assert any("127.0.0.1:9100/metrics" in str(part) for part in test)
        assert services[name]["stop_grace_period"] == "40s"


def test_only_the_gateway_is_published_beyond_the_host(
    services: dict[str, dict[str, Any]],
) -> None:
    """Every other published port is bound to the host's loopback (Redis, the collector's
    receivers and metrics, Jaeger); the workers publish none."""
    published = {
        name: [str(p) for p in service.get("ports", [])] for name, service in services.items()
    }
    assert published.pop("gateway") == ["8000:8000"]
    assert all(published[name] == [] for name in WORKERS)
    others = [p for ports in published.values() for p in ports]
    assert others and all(p.startswith("127.0.0.1:") for p in others), others


def test_gateway_published_and_checked(services: dict[str, dict[str, Any]]) -> None:
    gateway = services["gateway"]
    assert "8000:8000" in [str(p) for p in gateway["ports"]]
    assert gateway["depends_on"]["bus"]["condition"] == "service_healthy"
    assert any("/health" in str(part) for part in gateway["healthcheck"]["test"])


def test_workers_wait_for_redis(services: dict[str, dict[str, Any]]) -> None:
    for name in WORKERS:
        for redis in ("bus", "store"):
            assert services[name]["depends_on"][redis]["condition"] == "service_healthy"


def test_tracing_env(services: dict[str, dict[str, Any]]) -> None:
    names = set()
    for name in APP_SERVICES:
        env = services[name]["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4318"
        names.add(env["OTEL_SERVICE_NAME"])
    assert names == {"kvserve-gateway", "kvserve-worker", "kvserve-prefill", "kvserve-decode"}


def test_collector_and_jaeger(services: dict[str, dict[str, Any]]) -> None:
    otel = services["otel-collector"]
    assert otel["image"].startswith("otel/opentelemetry-collector-contrib")
    assert any(v.startswith("./ops/otel-collector.yaml:") for v in otel["volumes"])
    published = {str(p).split(":")[-1] for p in otel["ports"]}
    assert {"4317", "4318"} <= published
    jaeger = services["jaeger"]
    assert jaeger["image"].startswith("jaegertracing/all-in-one")
    assert "127.0.0.1:16686:16686" in [str(p) for p in jaeger["ports"]]
    assert jaeger["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"


def test_collector_config_exports_to_jaeger(collector: dict[str, Any]) -> None:
    assert set(collector["receivers"]["otlp"]["protocols"]) == {"grpc", "http"}
    exporters = collector["exporters"]
    jaeger = [
        cfg for name, cfg in exporters.items() if name.split("/")[0] == "otlp" and cfg is not None
    ]
    assert [cfg["endpoint"] for cfg in jaeger] == ["jaeger:4317"]
    assert jaeger[0]["tls"]["insecure"] is True
    traces = collector["service"]["pipelines"]["traces"]
    assert traces["receivers"] == ["otlp"]
    assert "batch" in traces["processors"]
    assert "otlp/jaeger" in traces["exporters"] and "debug" in traces["exporters"]
    # Every component a pipeline names is defined.
    for pipeline in collector["service"]["pipelines"].values():
        for kind in ("receivers", "processors", "exporters"):
            assert set(pipeline[kind]) <= set(collector[kind]), (kind, pipeline[kind])


def test_collector_scrapes_the_metrics_ports(collector: dict[str, Any]) -> None:
    jobs = collector["receivers"]["prometheus"]["config"]["scrape_configs"]
    targets = {
        job["job_name"]: [t for sc in job.get("static_configs", []) for t in sc["targets"]]
        + [f"{n}:{sd['port']}" for sd in job.get("dns_sd_configs", []) for n in sd["names"]]
        for job in jobs
    }
    assert targets == {
        "kvserve-gateway": ["gateway:8000"],
        "kvserve-worker": ["worker:9100"],
        "kvserve-prefill": ["prefill:9100"],
        "kvserve-decode": ["decode:9100"],
    }
    assert "prometheus" in collector["service"]["pipelines"]["metrics"]["receivers"]


def test_dockerfile() -> None:
    text = (ROOT / "ops" / "Dockerfile").read_text()
    lines = [line.strip() for line in text.splitlines()]
    assert "ARG BASE_IMAGE=python:3.11-slim" in lines
    assert {x for x in lines if x.startswith("FROM ")} == {
        "FROM ${BASE_IMAGE} AS build",
        "FROM ${BASE_IMAGE}",
    }
    install = (ROOT / "ops" / "image-install.sh").read_text()
    online = install[install.index("else") :]
    torch_at = online.index("TORCH_INDEX_URL")
    project_at = online.index("install -q /src")
    assert torch_at < project_at < online.index("kvserve fetch-model")
    assert "TORCH_VERSION=2.13.0" in text and "download.pytorch.org/whl/cpu" in text
    assert "[dev]" not in text
    assert "KVSERVE_CACHE_DIR=/models" in text
    user = [x for x in lines if x.startswith("USER ")]
    assert user and user[-1] not in ("USER root", "USER 0")
    assert 'ENTRYPOINT ["kvserve"]' in lines


def test_dockerignore() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    for path in (".venv", ".git", ".env"):
        assert path in ignored or f"{path}/" in ignored


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not on PATH")
@pytest.mark.parametrize("profile", ["aggregated", "disagg"])
def test_docker_compose_config(profile: str) -> None:
    result = subprocess.run(
        ["docker-compose", "-f", "compose.yaml", "--profile", profile, "config", "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_ci_override_adds_only_the_suites_settings(services: dict[str, dict[str, Any]]) -> None:
    """ops/compose.ci.yaml (ops/test-compose.sh) runs compose.yaml's commands with the suite's
    served model name and KV-cache size added, nothing else; its collector is the stand-in."""
    ci = _load(ROOT / "ops" / "compose.ci.yaml")["services"]
    extra = {"gateway": ["--served-model-name", "kvtest-smol"]}
    extra.update({name: ["--num-blocks", "256"] for name in WORKERS})
    for name, flags in extra.items():
        base = [str(c) for c in services[name]["command"]]
        assert [str(c) for c in ci[name]["command"]] == base + flags, name
    assert set(ci) == {*extra, "otel-collector"}
    assert ci["otel-collector"]["entrypoint"][-1] == "kvserve.services.bench.lib.otlp_sink"
