"""The gateway alone, over the in-process bus with a scripted worker (no engine): stream
failures mid-way, deadlines, readiness (also over a Redis bus with no Redis behind it), auth
salts, admission, the `user` field as the router's session key; and the gateway side of the
code never imports torch."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from kvserve.services.bench.lib.process import free_port
from kvserve.services.gateway.admission import Admission
from kvserve.services.gateway.app import Gateway, GatewayConfig
from kvserve.services.gateway.auth import ApiKeys, key_salt
from kvserve.services.gateway.errors import APIError
from kvserve.services.gateway.generation import BusGeneration
from kvserve.services.gateway.schema import ModelInfo, parse_chat, parse_completion
from kvserve.shared.bus.base import Bus, Delivery, WorkerPort
from kvserve.shared.bus.memory import InProcessBus
from kvserve.shared.bus.redis import RedisBus
from kvserve.shared.model.tokenizer import KVTokenizer
from kvserve.shared.protocol import ErrorInfo, TokenEvent, WorkerInfo
from kvserve.shared.store.hashing import validate_cache_salt

Script = Callable[[WorkerPort, Delivery], Awaitable[None]]


class Harness:
    def __init__(self, tokenizer: KVTokenizer, bus: Bus | None = None, **config: Any) -> None:
        self.bus = bus or InProcessBus()
        info = ModelInfo("m", tokenizer, 8192, tokenizer.vocab_size)
        self.gateway = Gateway(GatewayConfig(**config), self.bus, info)
        self.server = TestServer(self.gateway.app)
        self.port = self.bus.worker("fake")
        self.script: Script | None = None
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Harness:
        await self.server.start_server()
        self.session = aiohttp.ClientSession(str(self.server.make_url("")))
        return self

    async def start_worker(self, script: Script) -> None:
        await self.port.start()
        self.script = script
        self._task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            for d in await self.port.receive(timeout=1):
                assert self.script is not None
                await self.script(self.port, d)

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.session.close()
        await self.server.close()

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any, str]:
        async with self.session.post(path, json=body) as r:
            text = await r.text()
            is_json = r.content_type == "application/json"
            return r.status, json.loads(text) if is_json else None, text


@pytest.fixture
async def harness(tokenizer: KVTokenizer) -> AsyncIterator[Harness]:
    async with Harness(tokenizer, request_timeout_s=0.5) as h:
        yield h


def tokens(rid: str, seq: int, text: str, finish: str | None = None) -> TokenEvent:
    return TokenEvent(rid, seq, 0, [42], text, finish_reason=finish, num_prompt_tokens=3)


async def one_token_then_error(port: WorkerPort, d: Delivery) -> None:
    rid = d.request.request_id
    await port.emit(tokens(rid, 0, "Hel"))
    await port.emit(TokenEvent(rid, 1, error=ErrorInfo("the engine failed", "server_error")))


async def silent(port: WorkerPort, d: Delivery) -> None:
    pass


async def one_token_then_silence(port: WorkerPort, d: Delivery) -> None:
    await port.emit(tokens(d.request.request_id, 0, "Hel"))


async def test_stream_failing_midway_sends_error_event_then_done(harness: Harness) -> None:
    await harness.start_worker(one_token_then_error)
    status, _, text = await harness.post(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "stream": True},
    )
    assert status == 200
    events = [ln.removeprefix("data: ") for ln in text.split("\n\n") if ln]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["message"] == "the engine failed" and err["type"] == "server_error"
    assert set(err) == {"message", "type", "param", "code"}
    assert json.loads(events[-3])["choices"][0]["delta"]["content"] == "Hel"


async def test_error_before_first_token_is_an_http_error(harness: Harness) -> None:
    async def reject(port: WorkerPort, d: Delivery) -> None:
        err = ErrorInfo("cannot fit", "invalid_request_error", "max_tokens")
        await port.emit(TokenEvent(d.request.request_id, 0, error=err))

    await harness.start_worker(reject)
    status, body, _ = await harness.post("/v1/completions", {"prompt": "hi", "stream": True})
    assert status == 400 and body["error"]["param"] == "max_tokens"


async def test_deadline_504_and_mid_stream_timeout(harness: Harness) -> None:
    await harness.start_worker(silent)
    status, body, _ = await harness.post("/v1/completions", {"prompt": "hi"})
    assert status == 504 and body["error"]["type"] == "timeout"
    harness.script = one_token_then_silence
    status, _, text = await harness.post("/v1/completions", {"prompt": "hi", "stream": True})
    assert status == 200
    events = [ln.removeprefix("data: ") for ln in text.split("\n\n") if ln]
    assert json.loads(events[-2])["error"]["code"] == "timeout" and events[-1] == "[DONE]"


async def test_ready_once_both_disaggregated_roles_are_live(tokenizer: KVTokenizer) -> None:
    """A prefill worker alone cannot answer (nor a decode one): /ready says starting until
    both roles are live; an aggregated worker alone is enough."""

    def described(role: str) -> WorkerInfo:
        return WorkerInfo(role, role, "i1", 16, "m", "t", "fp32")

    async with Harness(tokenizer) as h:
        prefill, decode = h.bus.worker("p"), h.bus.worker("d")
        ready = []
        for port, role in ((prefill, "prefill"), (decode, "decode")):
            await port.start(info=described(role))
            async with h.session.get("/ready") as r:
                ready.append((r.status, (await r.json())["status"]))
        assert ready == [(503, "starting"), (200, "ready")]
    async with Harness(tokenizer) as h:
        await h.bus.worker("w").start(info=described("worker"))
        async with h.session.get("/ready") as r:
            assert r.status == 200


async def test_not_ready_without_worker_then_ready(harness: Harness) -> None:
    async with harness.session.get("/ready") as r:
        assert r.status == 503 and (await r.json()) == {"status": "starting"}
    status, body, _ = await harness.post("/v1/completions", {"prompt": "hi"})
    assert status == 503 and body["error"]["code"] == "not_ready"

    async def done(port: WorkerPort, d: Delivery) -> None:
        await port.emit(tokens(d.request.request_id, 0, "ok", "stop"))

    await harness.start_worker(done)
    async with harness.session.get("/ready") as r:
        assert r.status == 200
    status, body, _ = await harness.post("/v1/completions", {"prompt": "hi"})
    assert status == 200 and body["choices"][0]["text"] == "ok"
    harness.gateway.start_draining()
    async with harness.session.get("/ready") as r:
        assert r.status == 503 and (await r.json()) == {"status": "draining"}


async def test_redis_unreachable_is_not_reported_as_waiting_for_a_worker(
    tokenizer: KVTokenizer,
) -> None:
    """With Redis down nobody can tell whether a worker is up: /ready and generation requests
    say that the bus is unreachable, not that a worker is still starting."""
    bus = RedisBus(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    async with Harness(tokenizer, bus=bus) as harness:
        async with harness.session.get("/ready") as r:
            assert r.status == 503 and (await r.json()) == {"status": "bus_unavailable"}
        status, body, _ = await harness.post("/v1/completions", {"prompt": "hi"})
        assert status == 503 and body["error"]["code"] == "bus_unavailable"
    await bus.close()


def test_key_salts_are_valid_distinct_and_nest_client_salts() -> None:
    keys = ApiKeys(["a", "b"], allow_client_salt=True)
    sa = keys.authenticate("Bearer a")
    sb = keys.authenticate("bearer b")
    assert sa == key_salt("a") and sb == key_salt("b") and sa != sb
    assert validate_cache_salt(sa) == sa and "a" not in (sa or "")[4:5]
    assert keys.effective_salt(sa, None) == sa
    assert keys.effective_salt(sa, "team1") == f"{sa}.team1"
    for header in (None, "", "Bearer", "Bearer c", "Basic a"):
        with pytest.raises(APIError) as e:
            keys.authenticate(header)
        assert e.value.status == 401
    with pytest.raises(APIError):
        keys.effective_salt(sa, "bad salt!")
    with pytest.raises(APIError):
        keys.effective_salt(sa, "")  # would leave "{key salt}."
    with pytest.raises(APIError):
        ApiKeys(["a"]).effective_salt(sa, "x")  # not allowed by default
    assert ApiKeys().authenticate(None) is None
    assert ApiKeys().effective_salt(None, "tenant-7") == "tenant-7"


async def test_admission_bound_and_drain() -> None:
    adm = Admission(1)
    with adm.admit():
        with pytest.raises(APIError) as e, adm.admit():
            pass
        assert e.value.status == 503 and e.value.headers["Retry-After"] == "1"
        assert not await adm.drained(0.01)
    assert await adm.drained(0.01)
    adm.start_draining()
    with pytest.raises(APIError) as e, adm.admit():
        pass
    assert e.value.code == "shutting_down"


def test_gateway_side_never_imports_torch() -> None:
    """The gateway, the bus and the messages, and the CLI modules of `serve` and `gateway`
    (which load the engine lazily)."""
    code = (
        "import sys\n"
        "import kvserve.services.gateway.app, kvserve.shared.protocol\n"
        "import kvserve.shared.bus.memory, kvserve.shared.bus.redis\n"
        "import kvserve.shared.telemetry, kvserve.services.serve, kvserve.services.gateway.main\n"
        "import kvserve.services.cli_support, kvserve.services.engine_options\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


async def test_sampled_requests_without_a_seed_get_one(harness: Harness) -> None:
    """A worker that takes a request over from a dead one runs it again from the start: with
    the same seed it draws the same tokens, so the client's stream stays one generation."""
    seen: list[Any] = []

    async def record(port: WorkerPort, d: Delivery) -> None:
        seen.append(d.request)
        await port.emit(tokens(d.request.request_id, 0, "ok", finish="stop"))

    await harness.start_worker(record)
    body = {"model": "m", "prompt": "Hi", "max_tokens": 1}
    for extra in ({"temperature": 1.0}, {"temperature": 1.0}, {"temperature": 1.0, "seed": 7},
                  {"temperature": 0.0}):  # fmt: skip
        status, _, text = await harness.post("/v1/completions", {**body, **extra})
        assert status == 200, text
    seeds = [r.sampling.seed for r in seen]
    assert all(isinstance(s, int) for s in seeds[:2]) and seeds[0] != seeds[1]
    assert seeds[2:] == [7, None]  # a client's seed is kept; greedy needs none


# What schema fuzzing (tests/services/test_schema_fuzz.py) found the gateway accepting or
# refusing against its document; each fixed here, checked without an engine.
REFUSED: list[tuple[str, dict[str, Any]]] = [
    ("/tokenize", {}),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}),
    ("/tokenize", {"prompt": "a", "return_token_strs": "yes"}),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": 1}),
    ("/tokenize", {"prompt": 5}),
    ("/detokenize", {"tokens": [1.5]}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "user"}], "max_completion_tokens": 2,
                              "max_tokens": "many"}),
    ("/v1/completions", {"prompt": []}),
    ("/v1/completions", {"prompt": ["a", [1]]}),
    ("/v1/completions", {"prompt": "a", "n": 1.5}),
    ("/v1/cache/warmup", {"prefixes": [{"messages": [{}]}]}),
    ("/v1/cache/warmup", {"prefixes": [{"messages": [{"role": "bot", "content": "x"}]}]}),
    ("/v1/cache/warmup", {"prefixes": [{"messages": [{"role": "user", "content": ["x"]}]}]}),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body"), REFUSED)
async def test_requests_outside_the_document_are_refused(
    harness: Harness, path: str, body: dict[str, Any]
) -> None:
    status, reply, text = await harness.post(path, body)
    assert status == 400, text
    assert set(reply["error"]) == {"message", "type", "param", "code"}


def test_a_prompt_of_no_tokens_is_the_document_start_token(tokenizer: KVTokenizer) -> None:
    """Valid by the document (any string): as in OpenAI's legacy completions API, a prompt
    string of no tokens runs from the start of a new document (SmolLM2's <|endoftext|>, id 0);
    a lone surrogate is U+FFFD. An empty token id list stays refused."""
    info = ModelInfo("m", tokenizer, 8192, tokenizer.vocab_size)
    assert tokenizer.encode("\x04\x06") == [] and tokenizer.encode("\x13\x1d") == []
    assert tokenizer.document_start_id == 0
    prompts = ["", "\x04\x06", ["a", "\x13\x1d"], "\ud800"]
    expected = [[[0]], [[0]], [tokenizer.encode("a"), [0]], [tokenizer.encode("\ufffd")]]
    assert [parse_completion({"prompt": p}, info).prompts for p in prompts] == expected
    with pytest.raises(APIError, match="'prompt' must not be empty"):
        parse_completion({"prompt": [[]]}, info)


def test_a_top_k_of_the_whole_vocabulary_or_more_is_off(tokenizer: KVTokenizer) -> None:
    """top_k -1 and 0 are off, and so is any top_k that keeps every token, however large (one
    past 2**64 could not even travel the bus)."""
    info = ModelInfo("m", tokenizer, 8192, tokenizer.vocab_size)
    v = tokenizer.vocab_size
    for k, want in ((-1, 0), (0, 0), (5, 5), (v - 1, v - 1), (v, 0), (2**70, 0)):
        assert parse_completion({"prompt": "hi", "top_k": k}, info).params.top_k == want
    with pytest.raises(APIError, match="top_k"):
        parse_completion({"prompt": "hi", "top_k": -2}, info)


def test_min_tokens_is_parsed_and_bounded_by_max_tokens(tokenizer: KVTokenizer) -> None:
    """vLLM's min_tokens reaches the engine's parameters; above max_tokens or below 0 it is a
    400 naming it (no longer an unknown field, silently dropped)."""
    info = ModelInfo("m", tokenizer, 8192, tokenizer.vocab_size)
    body = {"prompt": "hi", "max_tokens": 8, "min_tokens": 8, "ignore_eos": True}
    assert parse_completion(body, info).params.min_tokens == 8
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "min_tokens": 2}
    assert parse_chat(chat, info).params.min_tokens == 2
    assert parse_completion({"prompt": "hi"}, info).params.min_tokens == 0
    for bad in (9, -1, "two"):
        with pytest.raises(APIError) as e:
            parse_completion({**body, "min_tokens": bad}, info)
        assert e.value.status == 400 and e.value.param == "min_tokens"


async def test_whole_floats_are_integers_and_tokenize_answers_token_strs(
    harness: Harness, tokenizer: KVTokenizer
) -> None:
    status, reply, text = await harness.post("/detokenize", {"tokens": [19556.0, 28]})
    assert status == 200, text
    assert reply == {"prompt": tokenizer.decode([19556, 28])}
    status, reply, text = await harness.post(
        "/tokenize", {"prompt": "Hi there", "return_token_strs": True}
    )
    ids = tokenizer.encode("Hi there")
    assert status == 200 and reply["tokens"] == ids, text
    assert reply["token_strs"] == [tokenizer.id_to_token(t) for t in ids]
    # Past validation, a completion with whole-float integers waits for a worker (none here).
    body = {"prompt": [1.0, 2.0], "n": 2.0, "max_tokens": 3.0, "seed": 7.0}
    status, reply, text = await harness.post("/v1/completions", body)
    assert status == 503 and reply["error"]["code"] == "not_ready", text


CHAT = "/v1/chat/completions"
CHAT_HI = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("path", "parse", "body"),
    [("/v1/completions", parse_completion, {"prompt": "hi"}), (CHAT, parse_chat, CHAT_HI)],
)
def test_user_is_parsed_into_the_plan_and_must_be_a_string(
    tokenizer: KVTokenizer, path: str, parse: Callable[..., Any], body: dict[str, Any]
) -> None:
    info = ModelInfo("m", tokenizer, 8192, tokenizer.vocab_size)
    doc = Gateway(GatewayConfig(), InProcessBus(), info).openapi
    schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert schema["properties"]["user"]["anyOf"][0]["type"] == "string"
    assert "user" not in schema["required"]
    plan = parse({**body, "user": "alice"}, info)
    assert plan.user == "alice"
    assert parse(body, info).params == plan.params  # not a sampling parameter
    assert parse({**body, "user": None}, info).user is None
    with pytest.raises(APIError) as refused:
        parse({**body, "user": 7}, info)
    assert (refused.value.status, refused.value.param) == (400, "user")


async def test_the_plans_user_is_the_routing_key(tokenizer: KVTokenizer) -> None:
    class Routing:
        def __init__(self) -> None:
            self.calls: list[tuple[Any, ...]] = []

        def route(self, prompt: list[int], salt: str | None, user: str | None) -> None:
            self.calls.append((prompt, salt, user))

    info = ModelInfo("m", tokenizer, 8192, tokenizer.vocab_size)
    plan = parse_completion({"prompt": [[1, 2], [3]], "user": "alice"}, info)
    routing = Routing()
    gen = BusGeneration(InProcessBus(), plan, "r", "salt", 1.0, None, "m", routing=routing)
    await gen.submit()
    await gen.close()
    assert routing.calls == [([1, 2], "salt", "alice"), ([3], "salt", "alice")]


async def test_reset_prefix_cache_is_the_keyed_rate_limited_flush(tokenizer: KVTokenizer) -> None:
    """vLLM's POST /reset_prefix_cache, outside /v1, is POST /v1/cache/flush: the same key,
    the same rate limit bucket, the same flush job and answer."""
    ops: list[str] = []

    async def flush(port: WorkerPort, d: Delivery) -> None:
        ops.append(getattr(d.request, "op", "?"))
        info = {"worker": "fake", "device_blocks": 3, "host_blocks": 2}
        await port.emit(TokenEvent(d.request.request_id, 0, info=info, finish_reason="stop"))

    async with Harness(tokenizer, api_keys=("k",), rate_limit=1.0) as h:
        await h.start_worker(flush)
        for key in (None, "wrong"):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            async with h.session.post("/reset_prefix_cache", headers=headers) as r:
                assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        assert ops == []
        keyed = {"Authorization": "Bearer k"}
        async with h.session.post("/reset_prefix_cache", headers=keyed) as r:
            assert r.status == 200
            assert await r.json() == {
                "object": "cache.flush", "flushed": True, "workers": ["fake"],
                "device_blocks": 3, "host_blocks": 2,
            }  # fmt: skip
        assert ops == ["flush"]
        for path in ("/reset_prefix_cache", "/v1/cache/flush"):  # one bucket for the key
            async with h.session.post(path, headers=keyed) as r:
                assert r.status == 429 and "Retry-After" in r.headers
        assert ops == ["flush"]
