"""The disaggregated stack end to end: a throwaway redis-server (bus and prefix store), the real
`kvserve gateway`, `kvserve prefill` and `kvserve decode` processes, the official `openai`
client. One stack for the module (the model loads once per worker). The OpenAI API suite
(tests/services/openai_suite.py, shared with `kvserve serve`) runs on it first; then the
traces of every process are checked for one trace per request, a warm-up job runs on a
prefill worker and a flush on every worker, and a decode worker is killed last."""

from __future__ import annotations

import re
import signal
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from kvserve.services.bench.lib import fleet as harness
from kvserve.services.bench.lib.http import Http
from kvserve.services.bench.lib.process import STOP_GRACE_S, ServerProcess, free_port
from kvserve.services.bench.lib.readiness import poll_until
from kvserve.services.bench.lib.redis_server import RedisServer, redis_binaries_present
from kvserve.shared.model.tokenizer import KVTokenizer
from kvserve.shared.sampling_params import SamplingParams

from tests.services.openai_suite import MODEL, NUM_BLOCKS, OpenAIApiSuite, metrics_totals
from tests.services.server_state import read_spans

pytestmark = pytest.mark.redis

WORKER_FLAGS = ("--num-blocks", str(NUM_BLOCKS), "--claim-idle", "3", "--drain-timeout", "5")


class Stack(harness.Fleet):
    """The gateway, prefill and decode workers (the harness's Fleet) on a redis-server of their
    own, each process writing its spans to traces/NAME.jsonl."""

    def __init__(self, model_path: Path, traces: Path) -> None:
        super().__init__(model_path)
        self.redis = RedisServer()
        self.redis.start()
        self.traces = traces

    def start(self, name: str, command: tuple[str, ...], *args: str) -> ServerProcess:
        env = {"KVSERVE_TRACE_FILE": str(self.traces / f"{name}.jsonl")}
        return self.process(name, command, *args, env=env).spawn()

    def worker(self, role: str, name: str) -> ServerProcess:
        url = self.redis.url
        return self.start(
            name,
            (role,),
            "--bus",
            url,
            "--store",
            url,
            "--store-format",
            "native",
            "--name",
            name,
            "--metrics-port",
            str(free_port()),
            *WORKER_FLAGS,
        )  # fmt: skip  (native frames: the suite compares texts with recomputation)

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        super().stop(grace)
        self.redis.stop()


@pytest.fixture(scope="module")
def stack(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if not redis_binaries_present():
        pytest.skip("redis-server not installed")
    s = Stack(model_path, tmp_path_factory.mktemp("stack-traces"))
    try:
        gw = s.start(
            "gateway", ("gateway", "--port", "0"), "--bus", s.redis.url,
            "--served-model-name", MODEL,
        )  # fmt: skip
        # Two decode workers from the start (they load in parallel): one is killed last.
        s.worker("prefill", "prefill-0")
        for i in range(2):
            s.worker("decode", f"decode-{i}")
        s.wait_ready()
        http = Http(gw.url)
        poll_until(lambda: http.get("/ready").status_code == 200, timeout=30)
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def http(stack: Stack) -> Http:
    return Http(stack.procs["gateway"].url)


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.procs["gateway"].url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def engine_totals(stack: Stack) -> Callable[[], dict[str, int]]:
    """The live workers' numbers, summed, from each worker's own /metrics (the gateway's view
    of them waits for the workers' next heartbeat)."""

    def totals() -> dict[str, int]:
        live = [p for name, p in stack.procs.items() if name != "gateway" and p.proc.poll() is None]
        return metrics_totals([p.url for p in live])

    return totals


def spans(traces: Path) -> list[dict[str, Any]]:
    return [span for f in traces.glob("*.jsonl") for span in read_spans(f)]


class TestOpenAIApi(OpenAIApiSuite):
    """The OpenAI API suite on the disaggregated stack."""


# ---- the stack's own -------------------------------------------------------------------------


def test_one_trace_across_gateway_prefill_decode(client: openai.OpenAI, stack: Stack) -> None:
    text = "Tell me about the history of paper making in a few lines. " * 3
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=3, temperature=0
    )

    def chain() -> tuple[dict[str, Any], ...] | None:
        all_spans = spans(stack.traces)
        mine = [s for s in all_spans if s["attributes"].get("kvserve.request_id") == r.id]
        gw = [s for s in mine if s["name"] == f"chat {MODEL}"]
        pre = [s for s in mine if s["name"] == "kvserve.prefill.request"]
        dec = [s for s in mine if s["name"] == "kvserve.worker.generate"]
        return (gw[0], pre[0], dec[0]) if gw and pre and dec else None

    gw, pre, dec = poll_until(chain, timeout=20)
    assert gw["service"] == "kvserve-gateway"
    assert pre["service"] == "kvserve-prefill" and dec["service"] == "kvserve-decode"
    assert gw["trace_id"] == pre["trace_id"] == dec["trace_id"]
    assert pre["parent_span_id"] == gw["span_id"] and dec["parent_span_id"] == pre["span_id"]
    trace = [s for s in spans(stack.traces) if s["trace_id"] == gw["trace_id"]]
    under_pre = {s["name"] for s in trace if s["parent_span_id"] == pre["span_id"]}
    under_dec = {s["name"] for s in trace if s["parent_span_id"] == dec["span_id"]}
    assert {"kvserve.queue", "kvserve.prefix_match", "kvserve.compute",
            "kvserve.store_publish"} <= under_pre  # fmt: skip
    match = next(s for s in trace if s["name"] == "kvserve.prefix_match")["attributes"]
    assert match["kvserve.prefix.full_blocks"] >= 1
    local = match["kvserve.cached_tokens.device"] + match["kvserve.cached_tokens.host"]
    assert (
        match["kvserve.usage.cached_tokens"]
        == local
        == match["gen_ai.usage.cache_read.input_tokens"]
    )
    assert {"kvserve.queue", "kvserve.store_fetch", "kvserve.decode"} <= under_dec
    fetch = next(s for s in trace if s["name"] == "kvserve.store_fetch")
    assert fetch["attributes"]["kvserve.tail_found"] is True
    assert r.usage is not None
    for s in (gw, pre, dec):
        a = s["attributes"]
        assert a["gen_ai.usage.input_tokens"] == r.usage.prompt_tokens
        assert a["gen_ai.request.model"]
        assert "gen_ai.usage.cache_read.input_tokens" in a
    assert gw["attributes"]["gen_ai.operation.name"] == "chat"
    assert dec["attributes"]["gen_ai.usage.output_tokens"] == 3


def test_warmup_runs_on_a_prefill_worker_and_flush_on_every_worker(
    client: openai.OpenAI, stack: Stack, http: Http
) -> None:
    system = f"[{uuid.uuid4().hex}] " + "You answer in one short sentence, always. " * 8
    r = http.post("/v1/cache/warmup", json={"prefixes": [{"system": system}]})
    assert r.status_code == 202, r.text

    def finished() -> dict[str, Any] | None:
        body: dict[str, Any] = http.get(f"/v1/cache/warmup/{r.json()['id']}").json()
        return body if body["status"] != "running" else None

    job = poll_until(finished, timeout=120)
    assert job["status"] == "completed" and job["blocks"] >= 4, job
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "Hi"}],
        max_tokens=1,
        temperature=0,
    )
    assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
    assert (chat.usage.prompt_tokens_details.cached_tokens or 0) >= job["blocks"] * 16
    flush = http.post("/v1/cache/flush")
    assert flush.status_code == 200
    assert sorted(flush.json()["workers"]) == ["decode-0", "decode-1", "prefill-0"]
    # The prefill worker's store-call latencies reach the gateway's /metrics.
    text = http.get("/metrics").text
    assert "kvserve:store_put_seconds_count{model_name=" in text
    assert "kvserve:store_errors_total{" in text


def test_killed_decode_worker_request_completes(
    client: openai.OpenAI,
    http: Http,
    stack: Stack,
    services_engine: Any,
    tokenizer: KVTokenizer,
) -> None:
    prompt = "Count from one to a hundred: one, two,"
    expected = services_engine.generate(
        [tokenizer.encode(prompt)], SamplingParams(max_tokens=64, ignore_eos=True)
    )[0][0]
    stream = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=64,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    it = iter(stream)
    text = next(it).choices[0].text

    def running_decoder() -> str | None:
        """The decode worker computing the request, from its own /metrics (live, where the
        gateway's view waits for a heartbeat and can miss a short decode)."""
        for name, p in stack.procs.items():
            if name.startswith("decode") and p.proc.poll() is None:
                with urllib.request.urlopen(p.url, timeout=5) as resp:
                    metrics = resp.read().decode()
                if re.search(r"^kvserve:num_requests_running\{.*\} [1-9]", metrics, re.M):
                    return name
        return None

    name = poll_until(running_decoder, timeout=10)
    stack.procs[name].proc.send_signal(signal.SIGKILL)  # the other one claims the request
    stack.procs[name].proc.wait(10)
    text += "".join(c.choices[0].text for c in it)
    assert text == tokenizer.decode(expected)
