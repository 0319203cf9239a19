"""The OpenAI API as a client sees it, whatever the topology behind the gateway: one suite, run
on `kvserve serve` (tests/services/test_serve_openai.py) and on the disaggregated stack
(tests/services/test_stack_e2e.py) by a `TestOpenAIApi(OpenAIApiSuite)` class in each module.

Each module provides the fixtures the suite uses: `client` (the official `openai` client),
`http` (plain HTTP, with the module's API key if it has one) and `engine_totals` (a callable:
the engines' num_requests_running, num_requests_waiting and num_used_blocks, summed and read
live, not from the gateway's view, which over Redis lags by a heartbeat), for a server that
serves the model as `MODEL` with NUM_BLOCKS KV-cache blocks per engine, started once for the
module (the model loads once; the stack's five processes are shared by its module's tests).
Greedy outputs are compared with `services_engine`, the engine in the test process."""

from __future__ import annotations

import json
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

import openai
import pytest
from kvserve.services.bench.lib.http import Http
from kvserve.services.bench.lib.readiness import poll_until
from kvserve.shared.model.tokenizer import KVTokenizer
from kvserve.shared.sampling_params import SamplingParams
from prometheus_client.parser import text_string_to_metric_families

MODEL = "kvtest-smol"
NUM_BLOCKS = 256  # 4096 tokens of KV cache per engine: less than the model's 8192-token context
ERROR_KEYS = {"message", "type", "param", "code"}

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
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
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


EngineTotals = Callable[[], dict[str, int]]
# The engine numbers the suite watches, by their names in a worker's /metrics.
ENGINE_METRICS = {
    "kvserve:num_requests_running": "num_requests_running",
    "kvserve:num_requests_waiting": "num_requests_waiting",
    "kvserve:kv_cache_used_blocks": "num_used_blocks",
}


def metrics_totals(urls: list[str]) -> dict[str, int]:
    """ENGINE_METRICS summed over the workers' /metrics at `urls`, read now."""
    out = dict.fromkeys(ENGINE_METRICS.values(), 0)
    for url in urls:
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in ENGINE_METRICS:
                    out[ENGINE_METRICS[sample.name]] += int(sample.value)
    return out


def _quiet(engine_totals: EngineTotals, http: Http) -> dict[str, int] | None:
    """The engines' totals once nothing runs or waits, no block is referenced and the gateway
    has nothing in flight; None before."""
    t = engine_totals()
    busy = t["num_requests_running"] or t["num_requests_waiting"] or t["num_used_blocks"]
    in_flight = http.get("/v1/cache/stats").json()["gateway"]["in_flight"]
    return None if busy or in_flight else t


def _stream_text(chunks: Any) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


class OpenAIApiSuite:
    # ---- basics ------------------------------------------------------------------------------

    def test_health_ready_models_version(self, client: openai.OpenAI, http: Http) -> None:
        assert http.get("/health").json() == {"status": "ok"}
        assert http.get("/ready").json() == {"status": "ready"}
        assert [m.id for m in client.models.list().data] == [MODEL]
        assert client.models.retrieve(MODEL).id == MODEL
        assert http.get("/version").json()["version"]

    def test_greedy_completion_streamed_or_not_and_stopped(
        self,
        client: openai.OpenAI,
        http: Http,
        services_engine: Any,
        tokenizer: KVTokenizer,
    ) -> None:
        prompt = "The capital of France is"
        kw: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        r = client.completions.create(**kw)
        expected = services_engine.generate(
            [tokenizer.encode(prompt)], SamplingParams(max_tokens=12)
        )
        tokens = expected[0][0]
        assert r.choices[0].text == tokenizer.decode(tokens)
        assert r.object == "text_completion" and r.model == MODEL
        assert r.usage is not None
        assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))
        assert r.usage.completion_tokens == len(tokens)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        chunks = list(client.completions.create(**kw, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
        assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
        # The raw stream: SSE `data:` lines ending with data: [DONE]
        raw = http.post("/v1/completions", json={**kw, "stream": True})
        assert raw.headers["Content-Type"].startswith("text/event-stream")
        lines = [ln for ln in raw.text.split("\n") if ln]
        assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)
        # A stop string the greedy text reaches ends it just before.
        stop = r.choices[0].text.split()[1]
        cut = client.completions.create(**kw, stop=[stop]).choices[0]
        assert cut.finish_reason == "stop"
        assert cut.text == r.choices[0].text[: r.choices[0].text.index(stop)]

    def test_greedy_chat_matches_engine_streamed_or_not(
        self, client: openai.OpenAI, services_engine: Any, tokenizer: KVTokenizer
    ) -> None:
        """`kvserve generate` is Engine.generate on the chat-templated prompt
        (tests/services/test_cli_generate.py), so matching the engine matches `kvserve generate`
        too. The stream (with usage) says the same."""
        messages: Any = [{"role": "user", "content": "Name two planets."}]
        kw: dict[str, Any] = {
            "model": MODEL,
            "messages": messages,
            "max_tokens": 16,
            "temperature": 0,
        }
        full = client.chat.completions.create(**kw)
        ids = tokenizer.encode_chat(messages)
        tokens = services_engine.generate([ids], SamplingParams(max_tokens=16))[0][0]
        msg = full.choices[0].message
        assert msg.role == "assistant" and msg.content == tokenizer.decode(tokens)
        assert full.object == "chat.completion"
        assert full.usage is not None and full.usage.prompt_tokens == len(ids)
        assert full.choices[0].finish_reason in ("stop", "length")
        chunks = list(
            client.chat.completions.create(
                **kw, stream=True, stream_options={"include_usage": True}
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        assert _stream_text(chunks) == msg.content
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == (
            full.choices[0].finish_reason
        )
        last = chunks[-1]
        assert last.choices == [] and last.usage is not None
        assert last.usage.completion_tokens == full.usage.completion_tokens
        assert last.usage.prompt_tokens == full.usage.prompt_tokens
        assert all(c.usage is None for c in chunks[:-1])

    # ---- sampling parameters -----------------------------------------------------------------

    def test_n2_seed_and_usage(self, client: openai.OpenAI) -> None:
        kw: dict[str, Any] = {
            "model": MODEL,
            "prompt": "My favourite animal is",
            "max_tokens": 8,
            "temperature": 1.0,
            "seed": 1234,
            "n": 2,
            "extra_body": {"ignore_eos": True},
        }
        a = client.completions.create(**kw)
        b = client.completions.create(**kw)
        assert [c.index for c in a.choices] == [0, 1]
        assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
        assert a.usage is not None
        # 2 x max_tokens: with ignore_eos both completions run to the limit.
        assert a.usage.completion_tokens == 16
        assert all(c.finish_reason == "length" for c in a.choices)

    def test_seed_reproducible_chat_stream(self, client: openai.OpenAI) -> None:
        kw: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Tell me a word."}],
            "max_tokens": 8,
            "temperature": 1.2,
            "seed": 7,
        }
        a = client.chat.completions.create(**kw).choices[0].message.content
        assert a == _stream_text(client.chat.completions.create(**kw, stream=True))

    def test_logprobs(self, client: openai.OpenAI) -> None:
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
        c = client.completions.create(
            model=MODEL,
            prompt="Hi",
            max_tokens=3,
            logprobs=0,
            extra_body={"ignore_eos": True},  # sampled at temperature 1: EOS must not end it
        )
        assert c.choices[0].logprobs is not None
        assert len(c.choices[0].logprobs.token_logprobs or []) == 3

    def test_batch_prompts(self, client: openai.OpenAI) -> None:
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

    def test_a_prompt_of_no_tokens_starts_a_new_document(
        self, http: Http, services_engine: Any, tokenizer: KVTokenizer
    ) -> None:
        """As in OpenAI's legacy completions API: "" and control characters that tokenize to
        nothing run as the document-start token alone (one prompt token each), a lone surrogate
        as U+FFFD; streamed usage counts the same."""
        start = tokenizer.document_start_id
        assert start is not None and tokenizer.encode("\x04\x06") == []
        kw = {"model": MODEL, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        from_start, from_fffd = services_engine.generate(
            [[start], tokenizer.encode("\ufffd")], params
        )
        r = http.post("/v1/completions", json={**kw, "prompt": ["", "\x04\x06", "\ud800"]})
        assert r.status_code == 200, r.text
        reply = r.json()
        expected = [tokenizer.decode(t) for t in (from_start[0], from_start[0], from_fffd[0])]
        assert [c["text"] for c in reply["choices"]] == expected and expected[0]
        assert reply["usage"]["prompt_tokens"] == 3
        assert reply["usage"]["completion_tokens"] == 12
        raw = http.post(
            "/v1/completions",
            json={**kw, "prompt": "", "stream": True, "stream_options": {"include_usage": True}},
        )
        events = [json.loads(ln[6:]) for ln in raw.text.split("\n") if ln[6:].startswith("{")]
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == expected[0]
        assert events[-1]["usage"]["prompt_tokens"] == 1

    # ---- prefix caching ----------------------------------------------------------------------

    def test_shared_system_prompt_is_cached(self, client: openai.OpenAI) -> None:
        system = f"[{uuid.uuid4().hex}] " + "You are a careful assistant who answers briefly. " * 8
        cached = []
        for q in ("What is the capital of Italy?", "What is the capital of Spain?"):
            r = client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
                max_tokens=2,
                temperature=0,
            )
            assert r.usage is not None and r.usage.prompt_tokens_details is not None
            details = r.usage.prompt_tokens_details
            cached.append(details.cached_tokens)
            # the kvserve extension, kept by the client: the tiers sum to cached_tokens
            by_tier = (details.model_extra or {})["cached_tokens_by_tier"]
            assert sum(by_tier.values()) == details.cached_tokens
        assert cached[0] == 0
        assert cached[1] is not None and cached[1] >= 64 and cached[1] % 16 == 0

    # ---- cancellation ------------------------------------------------------------------------

    def test_cancelled_stream_frees_blocks(
        self, client: openai.OpenAI, http: Http, engine_totals: EngineTotals
    ) -> None:
        poll_until(lambda: _quiet(engine_totals, http), timeout=30)
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
        during = engine_totals()
        assert during["num_requests_running"] == 1 and during["num_used_blocks"] >= 1
        stream.close()  # the client goes away mid-stream
        after = poll_until(lambda: _quiet(engine_totals, http), timeout=30)
        assert after["num_used_blocks"] == 0 and after["num_requests_running"] == 0
        # The server keeps serving.
        r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
        assert r.choices[0].finish_reason == "length"

    # ---- errors ------------------------------------------------------------------------------

    @pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
    def test_bad_requests_get_openai_errors(
        self, http: Http, path: str, body: dict[str, Any], status: int, param: str | None
    ) -> None:
        r = http.post(path, json=body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == ERROR_KEYS
        assert err["param"] == param and err["message"]

    def test_malformed_bodies_and_routes(self, http: Http, client: openai.OpenAI) -> None:
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
