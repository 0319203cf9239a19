"""The scale-out fleet end to end: a throwaway redis-server (bus and shared prefix store), the real
`kvserve gateway` (cache-aware routing) and two `kvserve worker` processes, the official `openai`
client. A conversation follows its cache; KV events lost or repeated on purpose cost at most a
recompute; a SIGKILLed worker loses no request, drops out of routing and comes back with an
empty index; a sampled stream whose worker is SIGKILLed goes on from the client's last token;
Redis killed and restarted empty: 503 with Retry-After meanwhile, then routing resumes without
a restart."""

from __future__ import annotations

import concurrent.futures
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
from kvserve.services.bench.lib.http import Http
from kvserve.services.bench.lib.process import ServerProcess, free_port
from kvserve.services.bench.lib.readiness import poll_until
from kvserve.services.bench.lib.redis_server import redis_binaries_present
from kvserve.shared.model.tokenizer import KVTokenizer
from kvserve.shared.protocol import GenerateRequest, decode, encode
from kvserve.shared.sampling_params import SamplingParams

from tests.services.openai_suite import MODEL, NUM_BLOCKS
from tests.services.redis_fleet import RedisFleet

pytestmark = pytest.mark.redis

WORKERS = ("worker-0", "worker-1")
EVENTS = "kvserve:kv_events"
SYSTEM = (
    "You are a careful assistant for a public library. You answer questions about opening "
    "hours, borrowing rules, rooms for study groups and the catalogue, in short sentences."
)
# The bus's worker TTL (10 s) plus a refresh and a heartbeat: when a dead worker is out.
DEAD_S = 20.0


class Fleet(RedisFleet):
    """The gateway and workers on a redis-server of their own."""

    def worker(self, name: str) -> ServerProcess:
        url = self.redis.url
        return self.process(
            name, ("worker",), "--bus", url, "--store", url, "--store-format", "native",
            "--name", name, "--threads", "1",
            "--metrics-port", str(free_port()), "--num-blocks", str(NUM_BLOCKS),
            "--claim-idle", "3", "--drain-timeout", "5",
        ).spawn()  # fmt: skip


@pytest.fixture(scope="module")
def fleet(model_path: Path) -> Iterator[Fleet]:
    if not redis_binaries_present():
        pytest.skip("redis-server not installed")
    f = Fleet(model_path)
    try:
        f.gateway("--routing", "cache-aware")
        for n in WORKERS:
            f.worker(n)
        f.wait_ready()
        poll_until(lambda: set(f.router()["workers"]) == set(WORKERS), timeout=30)
        yield f
    finally:
        f.stop()


@pytest.fixture(scope="module")
def client(fleet: Fleet) -> openai.OpenAI:
    return fleet.client()


def chat(client: openai.OpenAI, messages: list[Any], max_tokens: int = 8) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0
    )


def conversation(client: openai.OpenAI, rounds: int) -> list[Any]:
    """A user's rounds, each carrying the conversation so far."""
    messages = [{"role": "system", "content": SYSTEM}]
    replies = []
    for r in range(rounds):
        messages.append({"role": "user", "content": f"Question {r}: may I borrow {r + 2} books?"})
        reply = chat(client, messages)
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    return replies


def cached(reply: Any) -> int:
    return int(reply.usage.prompt_tokens_details.cached_tokens or 0)


def test_a_conversation_follows_its_cache(client: openai.OpenAI, fleet: Fleet) -> None:
    before = fleet.router()["decisions"].get("cache", 0)
    replies = conversation(client, 4)
    assert all(cached(r) > 0 for r in replies[1:])  # every later round finds the earlier ones
    assert [cached(r) for r in replies[1:]] == sorted(cached(r) for r in replies[1:])
    router = fleet.router()
    # Most later rounds are placed by their cache; on a loaded machine a worker's load report
    # can still count the previous round and outweigh a few blocks of overlap once.
    assert router["decisions"].get("cache", 0) - before >= 2
    assert router["predicted_cached_tokens"] > 0


def test_lost_and_repeated_kv_events_cost_at_most_a_recompute(
    client: openai.OpenAI, fleet: Fleet
) -> None:
    """Repeat the latest KV events, and lose some: with the gateway stopped (SIGSTOP), requests
    put straight on worker-0's stream make it publish events, and those between the first (a
    stopped reader may hold it already) and the last are deleted before the gateway reads."""
    reference = [r.choices[0].message.content for r in conversation(client, 2)]
    r = redis.Redis.from_url(fleet.redis.url)
    latest: Any = r.xrevrange(EVENTS, count=4)
    for _id, fields in reversed(latest):
        mark = r.xadd(EVENTS, fields)
    before = fleet.router()["workers"]["worker-0"]
    gateway = fleet.procs["gateway"].proc
    gateway.send_signal(signal.SIGSTOP)
    try:
        for k in range(2):  # 5 full blocks each, stored in new events
            tokens = list(range(1000 + 100 * k, 1000 + 100 * k + 5 * 16 + 1))
            request = GenerateRequest(f"lost-events-{k}", tokens, SamplingParams(max_tokens=1))
            r.xadd("kvserve:to:worker-0", {b"m": encode(request)})
        mine = poll_until(lambda: ours(r, mark, "worker-0", 3), timeout=30)
        r.xdel(EVENTS, *mine[1:-1])
    finally:
        gateway.send_signal(signal.SIGCONT)
    # The gap asks worker-0 for a snapshot: the router knows its blocks again, the lost ones too.
    poll_until(lambda: fleet.router()["workers"]["worker-0"]["resyncs"] > before["resyncs"])
    want = before["indexed_blocks"] + 10
    poll_until(lambda: fleet.router()["workers"]["worker-0"]["indexed_blocks"] >= want)
    assert fleet.router()["events"].get("duplicate", 0) >= len(latest)
    again = [r.choices[0].message.content for r in conversation(client, 2)]
    assert again == reference  # a misprediction recomputes; it never changes an answer


def ours(r: redis.Redis, after: Any, worker: str, n: int) -> list[Any] | None:
    """The ids of `worker`'s events after entry `after`, once there are at least `n`."""
    entries: Any = r.xrange(EVENTS, min=b"(" + after)
    ids = [i for i, f in entries if getattr(decode(f[b"m"]), "worker", None) == worker]
    return ids if len(ids) >= n else None


@pytest.mark.slow  # the default run stays within its time on the slowest CPUs
def test_a_killed_worker_loses_no_request_and_comes_back_empty(
    client: openai.OpenAI, fleet: Fleet
) -> None:
    prompts = [f"Write a list of {n} fruits, one per line, numbered." for n in range(3, 9)]
    old = fleet.router()["workers"]["worker-1"]["incarnation"]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(chat, client, [{"role": "user", "content": p}], 48) for p in prompts]
        poll_until(lambda: fleet.router()["workers"]["worker-1"]["in_flight"] > 0, timeout=30)
        fleet.procs["worker-1"].kill()
        replies = [f.result(timeout=120) for f in futures]
    assert all(r.choices[0].finish_reason in ("length", "stop") for r in replies)  # none lost
    # The same greedy requests, uninterrupted, on the survivor: the same texts.
    texts = [r.choices[0].message.content for r in replies]
    again = [chat(client, [{"role": "user", "content": p}], 48) for p in prompts]
    assert [r.choices[0].message.content for r in again] == texts
    poll_until(lambda: "worker-1" not in fleet.router()["workers"], timeout=DEAD_S)
    fleet.worker("worker-1").wait_ready()
    poll_until(lambda: "worker-1" in fleet.router()["workers"], timeout=DEAD_S)
    back = fleet.router()["workers"]["worker-1"]
    assert back["indexed_blocks"] == 0 and back["incarnation"] != old
    for n in range(4):  # raw prompts that share no block: equal workers alternate
        text = f"{n} {uuid.uuid4().hex} is a code; spell it out slowly, one character at a time"
        client.completions.create(model=MODEL, prompt=text, max_tokens=2, temperature=0)
    poll_until(lambda: fleet.router()["workers"]["worker-1"]["indexed_blocks"] > 0)


@pytest.mark.slow  # the default run stays within its time on the slowest CPUs
def test_a_sampled_stream_taken_over_mid_way_is_one_generation(
    client: openai.OpenAI, fleet: Fleet, tokenizer: KVTokenizer
) -> None:
    """Temperature 1.0, no seed: the worker streaming the answer is SIGKILLed after a few
    chunks; the other one goes on from the client's last token. The text the client got is
    the detokenization of the token ids it got, none repeated or missing."""
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a long story about a lighthouse."}],
        max_tokens=160,
        temperature=1.0,
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    text, ids, finish, usage, victim = "", [], None, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.logprobs is not None and choice.logprobs.content:
                ids += [int(t.token.removeprefix("token_id:")) for t in choice.logprobs.content]
            finish = choice.finish_reason or finish
        if victim is None and len(ids) >= 4:
            busy = [n for n, w in fleet.router()["workers"].items() if w["in_flight"] > 0]
            victim, sent_before = busy[0], len(ids)
            fleet.procs[victim].kill()
    assert victim is not None and sent_before < 160
    assert finish == "length" and len(ids) == 160
    assert usage is not None and usage.completion_tokens == 160
    assert text == tokenizer.decode(ids)
    (survivor,) = set(WORKERS) - {victim}
    took = [e for e in fleet.procs[survivor].events() if e.get("event") == "taking over a request"]
    assert took and took[-1]["tokens"] >= sent_before  # it went on, it did not start again
    fleet.worker(victim).wait_ready()
    poll_until(lambda: victim in fleet.router()["workers"], timeout=DEAD_S)


def test_redis_down_is_503_then_routing_resumes(client: openai.OpenAI, fleet: Fleet) -> None:
    http = Http(fleet.procs["gateway"].url)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    fleet.redis.kill()
    down = http.post("/v1/completions", body)
    assert down.status_code == 503 and down.headers.get("Retry-After")
    assert down.json()["error"]["type"]
    fleet.redis.restart()  # empty: no groups, no registrations, no store
    poll_until(lambda: http.post("/v1/completions", body).status_code == 200, timeout=30)
    before = sum(fleet.router()["decisions"].values())
    poll_until(lambda: set(fleet.router()["workers"]) == set(WORKERS), timeout=DEAD_S)
    replies = [chat(client, [{"role": "user", "content": f"Say {uuid.uuid4().hex[:4]}"}])]
    replies += [chat(client, [{"role": "user", "content": "Say hello."}])]
    assert all(r.choices[0].finish_reason for r in replies)
    assert sum(fleet.router()["decisions"].values()) >= before + 2
