"""The compose stack, run for real: the OpenAI API suite (tests/services/openai_suite.py, the one
`kvserve serve` and `kvserve stack` pass) against the gateway that `docker compose up` published,
with the real `openai` client; a request's trace at the collector (the stand-in of
ops/compose.ci.yaml) with the gateway's and a worker's spans under one trace id; a worker's
/metrics scraped over the compose network; NVIDIA's aiperf with its fixed workload
(tests/services/aiperf_run.py, as against `kvserve serve`).

ops/test-compose.sh brings each topology up and runs this module with the stack's coordinates in
the environment (KVSERVE_COMPOSE_*); without them every test here is skipped. Marked `compose`:
not in the default run."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from kvserve.services.bench.lib.http import Http
from kvserve.services.bench.lib.process import parse_event
from kvserve.services.bench.lib.readiness import poll_until
from prometheus_client.parser import text_string_to_metric_families

from tests.services.aiperf_run import (
    aiperf_command,
    check_exports,
    export_hf_tokenizer,
    install_aiperf,
    run_aiperf,
)
from tests.services.openai_suite import MODEL, OpenAIApiSuite, metrics_totals
from tests.services.server_state import idle

pytestmark = pytest.mark.compose

URL = os.environ.get("KVSERVE_COMPOSE_URL", "")
PROJECT = os.environ.get("KVSERVE_COMPOSE_PROJECT", "")
SINK = os.environ.get("KVSERVE_COMPOSE_SINK", "")  # the collector stand-in's published URL
WORKERS = [w for w in os.environ.get("KVSERVE_COMPOSE_WORKERS", "").split(",") if w]
REPORT = os.environ.get("KVSERVE_COMPOSE_REPORT", "")  # JSON lines: the figures measured here
UP_AT = float(os.environ.get("KVSERVE_COMPOSE_UP_AT", "0"))  # when `up` started (epoch s)
READY_TIMEOUT_S = 600.0  # the first worker compiles the CPU kernels; 2 cores load the model

if not (URL and PROJECT and SINK and WORKERS):
    pytest.skip("no compose stack (ops/test-compose.sh runs this module)", allow_module_level=True)


def _docker(*args: str) -> str:
    return subprocess.run(["docker", *args], check=True, capture_output=True, text=True).stdout


def containers(service: str) -> list[str]:
    """The ids of `service`'s running containers in this project."""
    out = _docker(
        "ps", "-q",
        "--filter", f"label=com.docker.compose.project={PROJECT}",
        "--filter", f"label=com.docker.compose.service={service}",
    )  # fmt: skip
    return out.split()


def _metrics_url(container: str) -> str:
    host_port = _docker("port", container, "9100/tcp").split()[0]
    return f"http://{host_port}/metrics"


def _report(**figures: Any) -> None:
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps({"workers": WORKERS, **figures}) + "\n")


@pytest.fixture(scope="module")
def http() -> Http:
    """The gateway, once every worker container is registered and a request is answered."""
    gateway = Http(URL)
    expected = sum(len(containers(w)) for w in WORKERS)
    assert expected, f"no running container of {WORKERS}"

    def workers_live() -> bool:
        try:
            stats = gateway.get("/v1/cache/stats")
        except OSError:
            return False
        return stats.status_code == 200 and len(stats.json()["workers"]) == expected

    poll_until(workers_live, timeout=READY_TIMEOUT_S, interval=1.0)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    poll_until(
        lambda: gateway.post("/v1/completions", json=body).status_code == 200,
        timeout=60,
        interval=0.5,
    )
    if UP_AT:
        _report(up_to_first_answer_s=round(time.time() - UP_AT, 1), live_workers=expected)
    return gateway


@pytest.fixture(scope="module")
def client(http: Http) -> openai.OpenAI:
    return openai.OpenAI(base_url=URL + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def engine_totals(http: Http) -> Callable[[], dict[str, int]]:
    """Every worker container's own numbers, summed, from its /metrics (published on an
    ephemeral port of the host's loopback by ops/compose.ci.yaml)."""
    urls = [_metrics_url(c) for w in WORKERS for c in containers(w)]
    return lambda: metrics_totals(urls)


class TestOpenAIApi(OpenAIApiSuite):
    """The OpenAI API suite on the compose stack."""


def _sink_spans(trace_id: str | None = None) -> list[dict[str, Any]]:
    query = f"?trace_id={trace_id}" if trace_id else ""
    with urllib.request.urlopen(f"{SINK}/spans{query}", timeout=5) as resp:
        spans: list[dict[str, Any]] = json.loads(resp.read())["spans"]
    return spans


def test_a_requests_trace_reaches_the_collector(client: openai.OpenAI) -> None:
    """The gateway's and a worker's spans of one request, exported over OTLP/HTTP to the
    collector's address in the compose network, under one trace id and one root: the
    gateway's server span."""
    marker = f"trace-check-{time.time_ns()}"
    client.completions.create(model=MODEL, prompt=marker, max_tokens=2, temperature=0)
    worker_services = {f"kvserve-{w}" for w in WORKERS}
    seen: dict[str, list[dict[str, Any]]] = {}

    def whole_trace() -> list[dict[str, Any]] | None:
        """A trace with both services' spans whose every parent has arrived too (each
        process's SDK exports its ended spans in batches of its own, so a child can reach the
        collector a batch before its parent)."""
        seen.clear()
        for span in _sink_spans():
            seen.setdefault(span["trace_id"], []).append(span)
        for spans in seen.values():
            services = {s["service_name"] for s in spans}
            ids = {s["span_id"] for s in spans}
            dangling = [s for s in spans if s["parent_span_id"] and s["parent_span_id"] not in ids]
            if "kvserve-gateway" in services and services & worker_services and not dangling:
                return spans
        return None

    try:
        spans = poll_until(whole_trace, timeout=30, interval=0.5)
    except AssertionError:
        joined = {t: sorted((s["service_name"], s["name"], s["parent_span_id"]) for s in v)
                  for t, v in seen.items()}  # fmt: skip
        raise AssertionError(f"no whole trace of gateway and worker spans: {joined}") from None
    roots = [s for s in spans if not s["parent_span_id"]]
    assert len(roots) == 1 and roots[0]["service_name"] == "kvserve-gateway", roots
    assert len({s["trace_id"] for s in spans}) == 1


def test_a_workers_metrics_scraped_over_the_compose_network(http: Http) -> None:
    """From the gateway's container, by service name, as the collector scrapes them."""
    (gateway, *_) = containers("gateway")
    for worker in WORKERS:
        script = (
            "import urllib.request; "
            f"print(urllib.request.urlopen('http://{worker}:9100/metrics', timeout=5).read()"
            ".decode())"
        )
        text = _docker("exec", gateway, "python", "-c", script)
        families = {f.name for f in text_string_to_metric_families(text)}
        assert "kvserve:num_requests_running" in families, worker


def _gateway_log(tail: int | None = None) -> str:
    """The gateway container's log (JSON lines on stderr), or its last `tail` lines."""
    (gateway, *_) = containers("gateway")
    args = ["docker", "logs", *(["--tail", str(tail)] if tail else []), gateway]
    logs = subprocess.run(args, check=True, capture_output=True, text=True)
    return logs.stdout + logs.stderr


def _gateway_flushes() -> int:
    """The gateway's flush answers so far (one per POST /reset_prefix_cache or /v1/cache/flush)."""
    events = map(parse_event, _gateway_log().splitlines())
    return sum(
        1 for e in events if e and e.get("event") == "prefix cache flushed" and "workers" in e
    )


@pytest.mark.timeout(900)  # the first run installs aiperf
def test_aiperf_against_the_stack(http: Http, model_path: Path, tmp_path: Path) -> None:
    """NVIDIA's aiperf, unchanged, against the published gateway: the fixed workload of
    tests/services/aiperf_run.py (chat, streamed; no API key on the stack). 16 requests, none
    failed, every output 16 tokens, aiperf read the gateway's /metrics, and its
    --reset-kv-cache reached the gateway (in its log)."""
    aiperf = install_aiperf()
    tokenizer = export_hf_tokenizer(model_path, tmp_path / "hf-tokenizer")
    poll_until(lambda: idle(http), timeout=60, interval=0.5)
    flushed_before = _gateway_flushes()
    cmd = aiperf_command(aiperf, URL, MODEL, tokenizer, "chat", True, tmp_path / "aiperf")
    started = time.monotonic()
    run = run_aiperf(cmd, cwd=tmp_path)
    _report(aiperf_chat_stream_s=round(time.monotonic() - started, 1))
    # bursts: on a 2-vCPU host running the workers, the gateway and aiperf, a worker short of CPU
    # may write a short completion's events in one burst, or the gateway read them only once all
    # are in the bus (its log: ttft_s ~ e2e_s); aiperf then gets the whole stream in one read.
    check_exports(run, stream=True, server_tail=lambda: _gateway_log(tail=30), bursts=True)
    assert _gateway_flushes() > flushed_before  # --reset-kv-cache reached /reset_prefix_cache


def test_redis_down_is_503_with_retry_after_then_recovers(http: Http) -> None:
    """The bus's Redis stopped: the gateway answers 503 with Retry-After (an OpenAI error),
    as `kvserve stack` does; started again (empty: it keeps nothing), the stack answers once
    the workers have registered again. Last in the module: it restarts a service."""
    (bus,) = containers("bus")
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    _docker("stop", bus)
    try:
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 503 and int(reply.headers["Retry-After"]) > 0
        assert reply.json()["error"]["code"] == "bus_unavailable"
        assert http.get("/ready").status_code == 503
    finally:
        _docker("start", bus)
    poll_until(
        lambda: http.post("/v1/completions", json=body).status_code == 200,
        timeout=120,
        interval=1.0,
    )
