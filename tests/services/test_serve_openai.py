"""`kvserve serve` end to end, through the official `openai` client and plain HTTP: the real
process, the real model, the in-process bus and worker. One server for the module (the model
loads once), with API keys, a two-request queue and a body limit. The OpenAI API suite
(tests/services/openai_suite.py, shared with the disaggregated stack) runs on it first, then
what is this process's own; the SIGTERM drain runs last and stops it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from kvserve.services.bench.lib.http import Http
from kvserve.services.bench.lib.process import ServerProcess
from kvserve.services.bench.lib.readiness import poll_until
from prometheus_client.parser import text_string_to_metric_families

from tests.services.openai_suite import ERROR_KEYS, MODEL, NUM_BLOCKS, OpenAIApiSuite
from tests.services.server_state import cache_totals, idle, read_spans

KEYS = ("key-one", "key-two")
MAX_QUEUE = 2
BODY_LIMIT = 8192


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("traces") / "spans.jsonl"


@pytest.fixture(scope="module")
def server(start_server, trace_file: Path) -> ServerProcess:
    return start_server(
        "--store", "memory://",
        "--served-model-name", MODEL,
        "--num-blocks", str(NUM_BLOCKS),
        "--api-key", KEYS[0], "--api-key", KEYS[1],
        "--max-queue", str(MAX_QUEUE),
        "--max-body-bytes", str(BODY_LIMIT),
        "--drain-timeout", "60",
        env={"KVSERVE_TRACE_FILE": str(trace_file)},
    )  # fmt: skip


def make_client(server: ServerProcess, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def make_http(server: ServerProcess, key: str | None = KEYS[0]) -> Http:
    return Http(server.url, {"Authorization": f"Bearer {key}"} if key else {})


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return make_client(server)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Http:
    return make_http(server)


@pytest.fixture(scope="module")
def engine_totals(http: Http) -> Callable[[], dict[str, Any]]:
    """The in-process engine's numbers: the gateway reads them from the worker at once."""
    return lambda: cache_totals(http)


class TestOpenAIApi(OpenAIApiSuite):
    """The OpenAI API suite on `kvserve serve`."""


# ---- this process's own ----------------------------------------------------------------------


def test_client_gone_during_non_stream_request_cancels_it(
    server: ServerProcess, http: Http
) -> None:
    poll_until(lambda: idle(http))
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps(
        {"prompt": "Count: one, two,", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEYS[0]}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head + body)
        poll_until(lambda: cache_totals(http)["num_requests_running"] == 1)
    # The connection is closed: the handler is cancelled, the request cancelled on the bus.
    after = poll_until(lambda: idle(http))
    assert after["num_used_blocks"] == 0


# ---- other endpoints -------------------------------------------------------------------------


def test_tokenize_detokenize(http: Http, tokenizer) -> None:
    text = "Hello, KV cache!"
    r = http.post("/tokenize", json={"prompt": text}).json()
    assert r["tokens"] == tokenizer.encode(text) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 8192
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": text}
    msgs = [{"role": "user", "content": "hi"}]
    r = http.post("/tokenize", json={"messages": msgs}).json()
    assert r["tokens"] == tokenizer.encode_chat(msgs)
    assert http.post("/detokenize", json={"tokens": [-1]}).status_code == 400


def test_openapi_lists_every_route(http: Http, tokenizer) -> None:
    from kvserve.services.gateway.app import Gateway, GatewayConfig
    from kvserve.services.gateway.schema import ModelInfo
    from kvserve.shared.bus.memory import InProcessBus

    gw = Gateway(GatewayConfig(), InProcessBus(), ModelInfo("m", tokenizer, 8192, 49152))
    routes = {
        (r.method, r.resource.canonical)
        for r in gw.app.router.routes()
        if r.method != "HEAD" and r.resource is not None
    }
    doc = http.get("/openapi.json").json()
    documented = {(m.upper(), path) for path, ops in doc["paths"].items() for m in ops}
    assert documented == routes
    assert {"/v1/completions", "/v1/chat/completions", "/metrics", "/openapi.json"} <= set(
        doc["paths"]
    )


def test_metrics_names(http: Http, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    poll_until(lambda: idle(http))
    running = {
        s.name: s.value
        for f in text_string_to_metric_families(http.get("/metrics").text)
        for s in f.samples
    }["kvserve:num_requests_running"]
    assert running == 0
    samples = [
        s for f in text_string_to_metric_families(http.get("/metrics").text) for s in f.samples
    ]
    names = {s.name for s in samples}
    sources = {s.labels["source"] for s in samples if s.name == "kvserve:cached_tokens_total"}
    assert sources == {"device", "host", "store"}
    for name in (
        "kvserve:num_requests_running",
        "kvserve:num_requests_waiting",
        "kvserve:kv_cache_usage_perc",
        "kvserve:prefix_cache_queries_total",
        "kvserve:prefix_cache_hits_total",
        "kvserve:num_preemptions_total",
        "kvserve:cached_tokens_total",
        "kvserve:time_to_first_token_seconds_bucket",
        "kvserve:inter_token_latency_seconds_bucket",
        "kvserve:e2e_request_latency_seconds_bucket",
        "kvserve:prompt_tokens_total",
        "kvserve:generation_tokens_total",
        "kvserve:request_success_total",
        "kvserve:store_bytes_per_token",  # the prefix store's numbers (memory:// here)
        "kvserve:store_backend_get_errors",
    ):
        assert name in names, name


# ---- telemetry -------------------------------------------------------------------------------


def test_trace_spans_gateway_to_worker_and_logs(
    client: openai.OpenAI, trace_file: Path, server: ServerProcess
) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0
    )

    def spans_of_request() -> tuple[dict[str, Any], dict[str, Any]] | None:
        spans = read_spans(trace_file)
        gw = [s for s in spans if s["attributes"].get("kvserve.request_id") == r.id
              and s["name"] == f"chat {MODEL}"]  # fmt: skip
        wk = [s for s in spans if s["attributes"].get("kvserve.request_id") == r.id
              and s["name"] == "kvserve.worker.generate"]  # fmt: skip
        return (gw[0], wk[0]) if gw and wk else None

    gw, wk = poll_until(spans_of_request)
    assert wk["trace_id"] == gw["trace_id"] and wk["parent_span_id"] == gw["span_id"]
    a = gw["attributes"]
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.usage.input_tokens"] == r.usage.prompt_tokens  # type: ignore[union-attr]
    assert a["gen_ai.usage.output_tokens"] == 3
    assert "gen_ai.usage.cache_read.input_tokens" in a
    assert wk["attributes"]["gen_ai.usage.output_tokens"] == 3
    children = {s["name"] for s in read_spans(trace_file) if s["parent_span_id"] == wk["span_id"]}
    assert {"kvserve.queue", "kvserve.prefill", "kvserve.decode"} <= children

    # structlog JSON: the request's log line carries its request and trace ids.
    def finished_logs() -> list[dict[str, Any]]:
        return [
            e
            for e in server.events()
            if e.get("request_id") == r.id and e.get("event") == "request finished"
        ]

    logs = poll_until(finished_logs)
    assert logs[0]["trace_id"] == gw["trace_id"]


def test_usage_splits_cached_tokens_by_tier(client: openai.OpenAI, trace_file: Path) -> None:
    """The usage extension `prompt_tokens_details.cached_tokens_by_tier` (device, host, store)
    sums to `cached_tokens`, in the body and in the stream's usage chunk; the second request
    finds the shared system prompt in the device cache. The gateway's and the worker's spans
    say the same, and the first request's spans say its store lookup found nothing."""
    system = f"[{uuid.uuid4().hex}] " + "You answer in one short sentence, always politely. " * 8
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 2, "temperature": 0}

    def ask(q: str) -> Any:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": q}]
        return client.chat.completions.create(messages=messages, **kw)

    first, second = ask("What is the capital of Italy?"), ask("What is the capital of Spain?")
    tiers = []
    for r in (first, second):
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        details = r.usage.prompt_tokens_details
        by_tier = (details.model_extra or {})["cached_tokens_by_tier"]  # kept by the client
        assert set(by_tier) == {"device", "host", "store"}
        assert sum(by_tier.values()) == details.cached_tokens
        tiers.append(by_tier)
    cached = second.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    assert tiers[0] == {"device": 0, "host": 0, "store": 0}
    assert cached is not None and cached >= 64
    assert tiers[1] == {"device": cached, "host": 0, "store": 0}

    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
    stream = client.chat.completions.create(
        messages=messages, stream=True, stream_options={"include_usage": True}, **kw
    )
    usage = list(stream)[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    by_tier = (usage.prompt_tokens_details.model_extra or {})["cached_tokens_by_tier"]
    assert by_tier["device"] == usage.prompt_tokens_details.cached_tokens >= 64

    def spans_of(r: Any) -> tuple[dict[str, Any], dict[str, Any]] | None:
        spans = read_spans(trace_file)
        mine = [s for s in spans if s["attributes"].get("kvserve.request_id") == r.id]
        gw = [s for s in mine if s["name"] == f"chat {MODEL}"]
        wk = [s for s in mine if s["name"] == "kvserve.worker.generate"]
        return (gw[0]["attributes"], wk[0]["attributes"]) if gw and wk else None

    def tiers_of(attrs: dict[str, Any]) -> list[int]:
        return [attrs[f"kvserve.cached_tokens.{t}"] for t in ("device", "host", "store")]

    # The first request's blocks are nowhere yet: the store is asked and holds none of them.
    for attrs in poll_until(lambda: spans_of(first)):
        assert (attrs["kvserve.store.lookup"], tiers_of(attrs)) == ("absent", [0, 0, 0])
    for attrs in poll_until(lambda: spans_of(second)):
        assert tiers_of(attrs) == [cached, 0, 0]


def quiet(server: ServerProcess) -> bool:
    """Nothing in flight at the gateway (every queue slot is free)."""
    return bool(make_http(server).get("/v1/cache/stats").json()["gateway"]["in_flight"] == 0)


def long_stream(c: openai.OpenAI) -> Any:
    return c.completions.create(
        model=MODEL,
        prompt="Count: one, two,",
        max_tokens=1000,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )


# ---- limits: keys, body size, queue; the drain last ------------------------------------------


def test_bad_serve_arguments_are_one_line_errors() -> None:
    for args in (["--max-queue", "0"], ["--port", "70000"], ["--api-key", ""]):
        r = subprocess.run(
            [sys.executable, "-m", "kvserve.services.cli", "serve", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr


def test_api_keys(server: ServerProcess) -> None:
    for key in (None, "wrong"):
        r = make_http(server, key).get("/v1/models")
        assert r.status_code == 401 and set(r.json()["error"]) == ERROR_KEYS
        assert r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        make_client(server, "wrong").models.list()
    assert make_http(server, None).get("/health").status_code == 200  # not under /v1
    for key in KEYS:
        assert [m.id for m in make_client(server, key).models.list().data]


def test_each_key_has_its_own_cache_partition(server: ServerProcess) -> None:
    prompt = f"[{uuid.uuid4().hex}] " + "A long shared preamble about caching. " * 10

    def cached(key: str) -> int:
        r = make_client(server, key).completions.create(
            model=MODEL, prompt=prompt, max_tokens=1, temperature=0
        )
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        return r.usage.prompt_tokens_details.cached_tokens or 0

    assert cached(KEYS[0]) == 0
    assert cached(KEYS[0]) > 0  # same key: the prefix is reused
    assert cached(KEYS[1]) == 0  # another key never sees the first key's blocks
    # A client cache_salt is refused unless the server allows it.
    r = make_http(server).post("/v1/completions", json={"prompt": "hi", "cache_salt": "mine"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_body_limit_413(server: ServerProcess) -> None:
    r = make_http(server).post("/v1/completions", json={"prompt": "x" * (BODY_LIMIT + 10)})
    assert r.status_code == 413
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["code"] == "request_too_large"
    ok = make_client(server).completions.create(
        model=MODEL, prompt="hi", max_tokens=1, temperature=0
    )
    assert ok.choices[0].text is not None


def test_full_queue_answers_503_with_retry_after(server: ServerProcess) -> None:
    poll_until(lambda: quiet(server))
    c = make_client(server)
    streams = [long_stream(c) for _ in range(MAX_QUEUE)]
    for stream in streams:
        next(iter(stream))  # every slot is taken
    with pytest.raises(openai.InternalServerError) as e:
        c.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert e.value.status_code == 503
    assert e.value.response.headers["retry-after"] == "1"
    assert e.value.code == "server_overloaded"
    for stream in streams:
        stream.close()
    poll_until(lambda: quiet(server))
    ok = c.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert ok.choices


def test_sigterm_drains_running_requests(server: ServerProcess) -> None:
    """Runs last in this module: the server stops."""
    poll_until(lambda: quiet(server))
    c = make_client(server)
    stream = c.completions.create(
        model=MODEL,
        prompt="Count: one, two,",
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    it = iter(stream)
    first = next(it)
    server.terminate()
    poll_until(lambda: make_http(server).get("/ready").status_code == 503)
    assert make_http(server).get("/ready").json() == {"status": "draining"}
    r = make_http(server).post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    assert r.headers["Retry-After"] == "1"
    rest = list(it)  # the running request still finishes
    chunks = [first, *rest]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert rest[-1].usage is not None and rest[-1].usage.completion_tokens == 24
    assert server.wait(60) == 0
    assert any(e.get("event") == "stopped" and e.get("drained") for e in server.events())
