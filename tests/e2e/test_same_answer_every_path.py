"""Same answer on every path: for one greedy request and one configuration, the tokens are those
a cold engine computes (each prompt alone, prefix caching off), whichever path the request's KV
took: computed locally, found in the device cache, brought back from the host tier, loaded from
Redis by another engine, handed off by a prefill worker to a decode worker (the real processes,
HTTP and the `openai` client), or taken over by a decode worker from one SIGKILLed mid-stream.

Both the default fp32 cache and `--kv-dtype int8`, always with the default store format `auto`
(the cache's own format: native fp32 frames, int8 frames; asserted on the frames in Redis),
which is what makes a block loaded from the store bit for bit the block the engine computed.
Each test also shows its path was taken (cached tokens by tier, the decode workers' store
loads, the survivor's take-over log). The process-level paths are `slow` (two fleets)."""

from __future__ import annotations

import re
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import openai
import pytest
import redis
from kvserve.services.bench.lib.process import ServerProcess, free_port
from kvserve.services.bench.lib.readiness import poll_until
from kvserve.services.bench.lib.redis_server import redis_binaries_present
from kvserve.shared.config import StoreConfig
from kvserve.shared.model.tokenizer import KVTokenizer
from kvserve.shared.sampling_params import SamplingParams
from prometheus_client.parser import text_string_to_metric_families

from tests.services.openai_suite import MODEL
from tests.services.redis_fleet import RedisFleet
from tests.shared.engine.helpers import run_one

pytestmark = pytest.mark.redis

# Read by the `prompts` fixture (tests/conftest.py): SYSTEM with each of QUESTIONS as a chat.
SYSTEM = (
    "You are the help desk of the Northfield Public Library. The library opens at nine in the "
    "morning and closes at eight in the evening from Monday to Friday, and at five on "
    "Saturdays; it is closed on Sundays and public holidays. Members may borrow up to twelve "
    "items at a time for three weeks, renew each item twice online or at the desk, and reserve "
    "titles that are on loan. Study rooms seat four to eight people and are booked by the hour "
    "at the front desk. Printing costs ten cents a page. Answer every question politely, in "
    "plain words and in no more than three short sentences."
)
QUESTIONS = [
    "Can I borrow fifteen books at once?",
    "When does the library close on Saturday?",
    "How do I book a study room for my group?",
]
GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)
# Streamed by the fleet and cut short by a SIGKILL: longer, so that the kill lands mid-stream.
TAKE_OVER_QUESTION = "What does printing cost, and can I pay for it by card?"
TAKE_OVER = SamplingParams(max_tokens=48, ignore_eos=True)
KV_DTYPES = ["auto", "int8"]
FRAME_FORMAT = {"auto": "native", "int8": "int8"}  # what `--store-format auto` writes
REDIS = "redis://127.0.0.1:6379/15"


def full_blocks(prompt: list[int], bs: int = 16) -> int:
    """The prompt tokens a cache can hold for it: its full blocks before the last token."""
    return (len(prompt) - 1) // bs * bs


def shared_blocks(a: list[int], b: list[int], bs: int = 16) -> int:
    """The tokens of b's cacheable full blocks that a's blocks hold too (the system prompt's)."""
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return min(n, full_blocks(b, bs)) // bs * bs


def frame_formats(url: str, namespace: str) -> set[str]:
    """The formats (`fmt`) of the block frames under `namespace` in the Redis at `url`."""
    client = redis.Redis.from_url(url)
    try:
        frames = [client.get(k) for k in client.scan_iter(match=f"{namespace}:blk:*")]
    finally:
        client.close()
    return {msgpack.unpackb(f)["fmt"] for f in frames if f is not None}


def assert_same(tokenizer: KVTokenizer, got: list[int], want: list[int], path: str) -> None:
    assert got == want, (
        f"{path}: {tokenizer.decode(got)!r} != cold {tokenizer.decode(want)!r} ({got} != {want})"
    )


@pytest.fixture(scope="module", params=KV_DTYPES)
def kv_dtype(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# Not promised for an int8 cache across processes (docs/architecture.md, "Same answer"): it
# quantizes every new K/V, so a last-bit difference between the kernels a step's shape picks
# (the decode worker computes a prompt's last token as a one-token step; a take-over recomputes
# generated tokens as prompt ones) can flip a stored value and, later, a greedy token. The
# frames are exact and the engine-level paths above pass.
INT8_ACROSS_PROCESSES = "int8 cache: a one-token step's kernels differ in the last bit"


def _int8_not_promised(request: pytest.FixtureRequest, kv_dtype: str) -> None:
    if kv_dtype == "int8":
        request.applymarker(pytest.mark.xfail(reason=INT8_ACROSS_PROCESSES, strict=False))


@pytest.fixture(scope="module")
def reference(make_engine, prompts: list[list[int]], kv_dtype: str) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Path 1, local compute: each prompt alone on a fresh engine with prefix caching off."""
    engine = make_engine(enable_prefix_caching=False, kv_dtype=kv_dtype)
    try:
        return [run_one(engine, f"cold-{i}", p, GREEDY)[0] for i, p in enumerate(prompts)]
    finally:
        engine.close()


@pytest.fixture
def redis_store() -> Iterator[tuple[str, str]]:
    """(URL, namespace): a namespace of its own in the local Redis, deleted after the test."""
    client = redis.Redis.from_url(REDIS)
    try:
        client.ping()
    except redis.RedisError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    ns = f"same-answer-{uuid.uuid4().hex[:12]}"
    yield f"{REDIS}?namespace={ns}&ttl=600", ns
    keys = list(client.scan_iter(match=f"{ns}:*"))
    if keys:
        client.delete(*keys)
    client.close()


# ---- the engine's paths ----------------------------------------------------------------------


def test_device_cache_hit(make_engine, prompts, reference, tokenizer, kv_dtype: str) -> None:  # type: ignore[no-untyped-def]
    """A fresh engine with prefix caching computes the first prompt, then finds all of it in its
    device cache, then the system prompt's blocks for each next question (computing only the
    question)."""
    engine = make_engine(kv_dtype=kv_dtype)
    try:
        tokens, cached = run_one(engine, "first", prompts[0], GREEDY)
        assert cached == 0
        assert_same(tokenizer, tokens, reference[0], "local compute, prefix caching on")
        tokens, cached = run_one(engine, "again", prompts[0], GREEDY)
        assert cached == full_blocks(prompts[0])
        assert_same(tokenizer, tokens, reference[0], "device cache, whole prompt")
        for i in range(1, len(prompts)):
            tokens, cached = run_one(engine, f"q{i}", prompts[i], GREEDY)
            assert cached == shared_blocks(prompts[0], prompts[i]) > 0  # the system prompt's
            assert_same(tokenizer, tokens, reference[i], f"device cache, prefix of q{i}")
        stats = engine.prefix_cache_stats
        assert stats["hits_tokens_device"] == stats["hits_tokens"] > 0
    finally:
        engine.close()


def test_host_tier_hit(make_engine, prompts, reference, tokenizer, kv_dtype: str) -> None:  # type: ignore[no-untyped-def]
    """Room for one request: a prompt of the same length sharing no block evicts every block of
    the first one to the host tier, from which the first prompt, asked again, gets them all."""
    need = -(-(len(prompts[0]) + GREEDY.max_tokens) // 16)
    engine = make_engine(num_blocks=need, kv_dtype=kv_dtype, store=StoreConfig("memory://"))
    try:
        tokens, _ = run_one(engine, "a", prompts[0], GREEDY)
        assert_same(tokenizer, tokens, reference[0], "local compute, small cache")
        run_one(engine, "evict", list(reversed(prompts[0])), GREEDY)
        tokens, cached = run_one(engine, "back", prompts[0], GREEDY)
        assert cached == full_blocks(prompts[0])
        stats = engine.prefix_cache_stats
        assert stats["hits_tokens_host"] == cached and stats["hits_tokens_store"] == 0
        assert_same(tokenizer, tokens, reference[0], "host tier, whole prompt")
    finally:
        engine.close()


def test_redis_hit(make_engine, prompts, reference, tokenizer, kv_dtype: str, redis_store) -> None:  # type: ignore[no-untyped-def]
    """One engine computes the first prompt and writes its blocks to Redis, in the cache's own
    format; a fresh engine on the same store loads all of them, another one the system
    prompt's blocks for the next question (computing only the question)."""
    url, ns = redis_store
    writer = make_engine(kv_dtype=kv_dtype, store=StoreConfig(url))
    try:
        tokens, _ = run_one(writer, "w", prompts[0], GREEDY)
        assert_same(tokenizer, tokens, reference[0], "local compute with a store")
    finally:
        writer.close()  # writes out the write-behind queue
    assert frame_formats(REDIS, ns) == {FRAME_FORMAT[kv_dtype]}
    for i, what in enumerate(["whole prompt", "system prompt"][: len(prompts)]):
        reader = make_engine(kv_dtype=kv_dtype, store=StoreConfig(url))
        try:
            tokens, cached = run_one(reader, f"r{i}", prompts[i], GREEDY)
            assert cached == shared_blocks(prompts[0], prompts[i])
            assert reader.prefix_cache_stats["hits_tokens_store"] == cached
            assert_same(tokenizer, tokens, reference[i], f"Redis, {what} of q{i}")
        finally:
            reader.close()


# ---- the fleet's paths: real processes, HTTP and the openai client ---------------------------


class Fleet(RedisFleet):
    """A gateway, a prefill worker and two decode workers (the disaggregated topology) on a
    redis-server of their own, bus and store; every worker's cache of `kv_dtype`, its store
    format left at the default (auto)."""

    def __init__(self, model_path: Path, kv_dtype: str) -> None:
        super().__init__(model_path)
        self.kv_dtype = kv_dtype

    def worker(self, role: str, name: str) -> ServerProcess:
        url = self.redis.url
        return self.process(
            name, (role,), "--bus", url, "--store", url, "--kv-dtype", self.kv_dtype,
            "--name", name, "--threads", "1", "--metrics-port", str(free_port()),
            "--num-blocks", "256", "--claim-idle", "3", "--drain-timeout", "5",
        ).spawn()  # fmt: skip

    def decoders(self) -> dict[str, ServerProcess]:
        return {n: p for n, p in self.procs.items() if n.startswith("decode") and p.running}

    def store_loaded_tokens(self) -> int:
        """Prompt tokens the live decode workers loaded from the store, from their /metrics."""
        total = 0
        for p in self.decoders().values():
            for family in text_string_to_metric_families(metrics(p)):
                for s in family.samples:
                    if s.name == "kvserve:cached_tokens_total" and s.labels["source"] == "store":
                        total += int(s.value)
        return total

    def frame_formats(self) -> set[str]:
        """The formats of the block frames in the store."""
        return frame_formats(self.redis.url, "kvserve:v1")


def metrics(p: ServerProcess) -> str:
    """A worker's /metrics text (its ready event's URL), read live."""
    with urllib.request.urlopen(p.url, timeout=5) as resp:
        return str(resp.read().decode())


@pytest.fixture(scope="module")
def fleet(model_path: Path, kv_dtype: str) -> Iterator[Fleet]:
    if not redis_binaries_present():
        pytest.skip("redis-server not installed")
    f = Fleet(model_path, kv_dtype)
    try:
        f.gateway()
        f.worker("prefill", "prefill-0")
        for i in range(2):
            f.worker("decode", f"decode-{i}")
        f.wait_ready()
        yield f
    finally:
        f.stop()


@pytest.fixture(scope="module")
def client(fleet: Fleet) -> openai.OpenAI:
    return fleet.client()


def messages(question: str) -> list[Any]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def token_ids(logprobs: Any) -> list[int]:
    """The tokens of a choice's logprobs, as `return_tokens_as_token_ids` names them."""
    return [int(t.token.removeprefix("token_id:")) for t in logprobs.content or []]


GREEDY_HTTP: dict[str, Any] = {
    "model": MODEL,
    "max_tokens": GREEDY.max_tokens,
    "temperature": 0,
    "logprobs": True,
    "extra_body": {"ignore_eos": True, "return_tokens_as_token_ids": True},
}


@pytest.mark.slow
def test_prefill_decode_hand_off(  # type: ignore[no-untyped-def]
    fleet: Fleet, client: openai.OpenAI, prompts, reference, tokenizer, request
) -> None:
    """Each question through the gateway: the prefill worker computes the prompt but its last
    token and hands it to a decode worker through the store, which answers what a cold engine
    does. The first question finds the decode workers empty (this is the fleet's first test):
    all but the last prompt token come from the store."""
    _int8_not_promised(request, fleet.kv_dtype)
    for i, q in enumerate(QUESTIONS):
        before = fleet.store_loaded_tokens()
        r = client.chat.completions.create(messages=messages(q), **GREEDY_HTTP)
        assert r.usage is not None and r.usage.prompt_tokens == len(prompts[i])
        if i == 0:
            assert fleet.store_loaded_tokens() - before == len(prompts[0]) - 1
            assert fleet.frame_formats() == {FRAME_FORMAT[fleet.kv_dtype]}
        assert r.choices[0].logprobs is not None
        assert_same(tokenizer, token_ids(r.choices[0].logprobs), reference[i], f"P/D, q{i}")


@pytest.mark.slow
def test_take_over_mid_stream(  # type: ignore[no-untyped-def]
    fleet: Fleet, client: openai.OpenAI, make_engine, tokenizer, kv_dtype: str, request
) -> None:
    """A question not asked before, streamed: the decode worker streaming the answer is
    SIGKILLed after the first tokens; the other one claims the request and goes on from the
    client's last token (the prompt from the store, the tokens sent so far recomputed). The
    stream is the cold engine's answer."""
    _int8_not_promised(request, kv_dtype)
    prompt = tokenizer.encode_chat(messages(TAKE_OVER_QUESTION))
    cold = make_engine(enable_prefix_caching=False, kv_dtype=kv_dtype)
    try:
        want, _ = run_one(cold, "cold", prompt, TAKE_OVER)
    finally:
        cold.close()
    stream = client.chat.completions.create(
        messages=messages(TAKE_OVER_QUESTION), stream=True,
        **{**GREEDY_HTTP, "max_tokens": TAKE_OVER.max_tokens},
    )  # fmt: skip
    ids: list[int] = []
    victim, sent_before = None, 0
    busy = re.compile(r"^kvserve:num_requests_running\{.*\} [1-9]", re.M)
    for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs is not None:
                ids += token_ids(choice.logprobs)
        if victim is None and ids:
            victim = poll_until(
                lambda: next((n for n, p in fleet.decoders().items() if busy.search(metrics(p))),
                             None),
                timeout=10,
            )  # fmt: skip
            sent_before = len(ids)
            fleet.procs[victim].kill()
    assert victim is not None and sent_before < TAKE_OVER.max_tokens
    assert_same(tokenizer, ids, want, "take-over")
    (survivor,) = fleet.decoders().values()
    took = [e for e in survivor.events() if e.get("event") == "taking over a request"]
    assert took and took[-1]["tokens"] >= sent_before  # it went on, it did not start again
