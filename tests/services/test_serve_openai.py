"""`kvserve serve` end to end, through the official `openai` client and plain HTTP: the real
process, the real model, the in-process bus and worker. One server for the module (the model
loads once), with API keys, a two-request queue and a body limit; the SIGTERM drain runs last
and stops it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import openai
import pytest
from kvserve.shared.model.tokenizer import KVTokenizer
from kvserve.shared.sampling_params import SamplingParams
from prometheus_client.parser import text_string_to_metric_families

from tests.services.kvserve_process import Http, ServeProcess, poll_until

MODEL = "kvtest-smol"
NUM_BLOCKS = 256  # 4096 tokens of KV cache: less than the model's 8192-token context
ERROR_KEYS = {"message", "type", "param", "code"}
KEYS = ("key-one", "key-two")
MAX_QUEUE = 2
BODY_LIMIT = 8192


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("traces") / "spans.jsonl"


@pytest.fixture(scope="module")
def server(start_server, trace_file: Path) -> ServeProcess:
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


def make_client(server: ServeProcess, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def make_http(server: ServeProcess, key: str | None = KEYS[0]) -> Http:
    return Http(server.url, {"Authorization": f"Bearer {key}"} if key else {})


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> openai.OpenAI:
    return make_client(server)


@pytest.fixture(scope="module")
def http(server: ServeProcess) -> Http:
    return make_http(server)


def cache_totals(http) -> dict[str, Any]:
    r = http.get("/v1/cache/stats")
    assert r.status_code == 200
    return dict(r.json()["totals"])


def idle(http) -> dict[str, Any] | None:
    """The cache stats once nothing runs and no block is referenced (None before)."""
    stats = http.get("/v1/cache/stats").json()
    t = stats["totals"]
    quiet = not (t["num_requests_running"] or t["num_requests_waiting"] or t["num_used_blocks"])
    return t if quiet and stats["gateway"]["in_flight"] == 0 else None


# ---- basics ----------------------------------------------------------------------------------


def test_health_ready_models_version(client: openai.OpenAI, http: Http) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/ready").json() == {"status": "ready"}
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert http.get("/version").json()["version"]


def test_greedy_completion_matches_engine(
    client: openai.OpenAI, services_engine: Any, tokenizer: KVTokenizer
) -> None:
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    expected = services_engine.generate([tokenizer.encode(prompt)], SamplingParams(max_tokens=12))
    tokens = expected[0][0]
    assert r.choices[0].text == tokenizer.decode(tokens)
    assert r.object == "text_completion" and r.model == MODEL
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert r.usage.completion_tokens == len(tokens)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_greedy_chat_matches_engine_and_generate(
    client: openai.OpenAI, services_engine: Any, tokenizer: KVTokenizer
) -> None:
    """`kvserve generate` is Engine.generate on the chat-templated prompt (tests/test_cli_generate),
    so matching the engine here matches `kvserve generate` too."""
    question = "Name two planets."
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        max_tokens=16,
        temperature=0,
    )
    ids = tokenizer.encode_chat([{"role": "user", "content": question}])
    tokens = services_engine.generate([ids], SamplingParams(max_tokens=16))[0][0]
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == tokenizer.decode(tokens)
    assert r.object == "chat.completion"
    assert r.usage is not None and r.usage.prompt_tokens == len(ids)
    assert r.choices[0].finish_reason in ("stop", "length")


# ---- streaming -------------------------------------------------------------------------------


def test_chat_stream_with_usage_equals_non_stream(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is 2 + 2?"}],
        "max_tokens": 10,
        "temperature": 0,
    }
    full = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == (
        full.choices[0].finish_reason
    )
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == full.usage.completion_tokens  # type: ignore[union-attr]
    assert last.usage.prompt_tokens == full.usage.prompt_tokens  # type: ignore[union-attr]
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_equals_non_stream(client: openai.OpenAI, http: Http) -> None:
    kw: dict[str, Any] = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8}
    full = client.completions.create(**kw, temperature=0)
    chunks = list(client.completions.create(**kw, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    # The raw stream ends with data: [DONE]
    r = http.post("/v1/completions", json={**kw, "stream": True})
    assert r.headers["Content-Type"].startswith("text/event-stream")
    lines = [ln for ln in r.text.split("\n") if ln]
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)


# ---- sampling parameters ---------------------------------------------------------------------


def test_n2_seed_and_usage(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {
        "model": MODEL,
        "prompt": "My favourite animal is",
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 1234,
        "n": 2,
    }
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert a.usage is not None
    assert a.usage.completion_tokens == 16  # 2 x max_tokens (ignore_eos below is not needed:
    # the seeded samples are the same each run, and both hit the length limit here)
    assert all(c.finish_reason == "length" for c in a.choices)


def test_seed_reproducible_chat_stream(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a word."}],
        "max_tokens": 8,
        "temperature": 1.2,
        "seed": 7,
    }
    a = client.chat.completions.create(**kw).choices[0].message.content
    chunks = client.chat.completions.create(**kw, stream=True)
    b = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert a == b


def test_stop_string(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": MODEL, "prompt": "The capital of France is", "temperature": 0}
    full = client.completions.create(**kw, max_tokens=12).choices[0].text
    stop = full.split()[1]  # a word the greedy text reaches
    r = client.completions.create(**kw, max_tokens=12, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[: full.index(stop)]


def test_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.content is not None and len(lp.content) == 4
    assert all(t.logprob <= 0 for t in lp.content)
    assert "".join(t.token for t in lp.content) == r.choices[0].message.content
    c = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, logprobs=0)
    assert c.choices[0].logprobs is not None
    assert len(c.choices[0].logprobs.token_logprobs or []) == 3


def test_batch_prompts(client: openai.OpenAI) -> None:
    prompts = ["The sky is", "Water is"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0)
    single = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0)
        .choices[0]
        .text
        for p in prompts
    ]
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == single


# ---- prefix caching --------------------------------------------------------------------------


def test_shared_system_prompt_is_cached(client: openai.OpenAI) -> None:
    system = f"[{uuid.uuid4().hex}] " + "You are a careful assistant who answers briefly. " * 8
    usages = []
    for q in ("What is the capital of Italy?", "What is the capital of Spain?"):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
            max_tokens=2,
            temperature=0,
        )
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        usages.append(r.usage)
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    cached = usages[1].prompt_tokens_details.cached_tokens
    assert cached is not None and cached >= 64 and cached % 16 == 0


# ---- cancellation ----------------------------------------------------------------------------


def test_cancelled_stream_frees_blocks(client: openai.OpenAI, http: Http) -> None:
    poll_until(lambda: idle(http))
    stream = client.completions.create(
        model=MODEL,
        prompt="Count from one to a thousand: one, two,",
        max_tokens=1000,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    it = iter(stream)
    next(it)
    next(it)
    during = cache_totals(http)
    assert during["num_requests_running"] == 1 and during["num_used_blocks"] >= 1
    stream.close()  # the client goes away mid-stream
    after = poll_until(lambda: idle(http))
    assert after["num_used_blocks"] == 0 and after["num_requests_running"] == 0
    metrics = {
        s.name: s.value
        for fam in text_string_to_metric_families(http.get("/metrics").text)
        for s in fam.samples
    }
    assert metrics["kvserve:num_requests_running"] == 0
    # The server keeps serving.
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason == "length"


def test_client_gone_during_non_stream_request_cancels_it(server: ServeProcess, http: Http) -> None:
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


# ---- errors ----------------------------------------------------------------------------------

BAD_REQUESTS: list[tuple[str, dict[str, Any], int, str | None]] = [
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100_000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 1000}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 6}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "seed": -5}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5}, 400,
     "presence_penalty"),
    # Passes the gateway's context check, fails the worker's KV-cache capacity check.
    ("/v1/completions", {"prompt": "hi", "max_tokens": NUM_BLOCKS * 16 + 100}, 400, "max_tokens"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
def test_bad_requests_get_openai_errors(
    http: Http, path: str, body: dict[str, Any], status: int, param: str | None
) -> None:
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS
    assert err["param"] == param and err["message"]


def test_malformed_bodies_and_routes(http: Http, client: openai.OpenAI) -> None:
    json_header = {"content-type": "application/json"}
    r = http.post("/v1/completions", content=b"{not json", headers=json_header)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = http.post("/v1/completions", json=[1, 2])
    assert r.status_code == 400 and set(r.json()["error"]) == ERROR_KEYS
    r = http.get("/v1/nope")
    assert r.status_code == 404 and set(r.json()["error"]) == ERROR_KEYS
    r = http.get("/v1/completions")
    assert r.status_code == 405 and set(r.json()["error"]) == ERROR_KEYS
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert e.value.status_code == 400 and e.value.param == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-a-model", prompt="hi")
    # ... and the server keeps serving.
    r2 = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0)
    assert r2.choices[0].text


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
    from kvserve.shared.bus import InProcessBus

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


def _spans(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_trace_spans_gateway_to_worker_and_logs(
    client: openai.OpenAI, trace_file: Path, server: ServeProcess
) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0
    )

    def spans_of_request() -> tuple[dict[str, Any], dict[str, Any]] | None:
        spans = _spans(trace_file)
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
    children = {s["name"] for s in _spans(trace_file) if s["parent_span_id"] == wk["span_id"]}
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


def quiet(server: ServeProcess) -> bool:
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


def test_api_keys(server: ServeProcess) -> None:
    for key in (None, "wrong"):
        r = make_http(server, key).get("/v1/models")
        assert r.status_code == 401 and set(r.json()["error"]) == ERROR_KEYS
        assert r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        make_client(server, "wrong").models.list()
    assert make_http(server, None).get("/health").status_code == 200  # not under /v1
    for key in KEYS:
        assert [m.id for m in make_client(server, key).models.list().data]


def test_each_key_has_its_own_cache_partition(server: ServeProcess) -> None:
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


def test_body_limit_413(server: ServeProcess) -> None:
    r = make_http(server).post("/v1/completions", json={"prompt": "x" * (BODY_LIMIT + 10)})
    assert r.status_code == 413
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["code"] == "request_too_large"
    ok = make_client(server).completions.create(
        model=MODEL, prompt="hi", max_tokens=1, temperature=0
    )
    assert ok.choices[0].text is not None


def test_full_queue_answers_503_with_retry_after(server: ServeProcess) -> None:
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


def test_sigterm_drains_running_requests(server: ServeProcess) -> None:
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
