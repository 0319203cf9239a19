"""Simulated workers behind the real gateway (DESIGN.md section 2.2): a throwaway redis-server,
`kvserve gateway` (cache-aware routing) and two `kvserve worker --simulate PROFILE` processes,
the official `openai` client. They answer as workers do (stream and not, usage, cached
tokens); their KV events drive the real router (a conversation follows its cache); one
SIGKILLed mid-stream is taken over by the other, which goes on with the very words the first
would have sent. A profile that cannot be used is a one-line error naming the field."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from kvserve.services.bench.lib import fleet as harness
from kvserve.services.bench.lib.http import Http
from kvserve.services.bench.lib.process import ServerProcess
from kvserve.services.bench.lib.readiness import poll_until
from kvserve.services.bench.lib.redis_server import RedisServer, redis_binaries_present

from tests.services.openai_suite import MODEL
from tests.services.redis_fleet import RedisFleet
from tests.shared.engine.sim.profiles import profile_dict, write_profile

pytestmark = pytest.mark.redis

WORKERS = ("worker-0", "worker-1")
DEAD_S = 20.0  # the bus's worker TTL (10 s) plus a refresh and a heartbeat
# A decode step of ~20 ms: a 60-token answer streams for over a second, time to kill its worker.
STEP = {"base_s": 0.02}


class SimFleet(RedisFleet):
    def __init__(self, model_path: Path, profile: Path) -> None:
        super().__init__(model_path)
        self.profile = profile

    def worker(self, name: str) -> ServerProcess:
        url = self.redis.url
        return self.process(
            name, ("worker",), "--bus", url, "--store", url, "--store-format", "native",
            "--name", name, "--metrics-port", "0", "--simulate", str(self.profile),
            "--claim-idle", "3", "--drain-timeout", "5",
        ).spawn()  # fmt: skip


@pytest.fixture(scope="module")
def fleet(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimFleet]:
    if not redis_binaries_present():
        pytest.skip("redis-server not installed")
    profile = write_profile(tmp_path_factory.mktemp("sim") / "profile.json", step=STEP)
    f = SimFleet(model_path, profile)
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
def client(fleet: SimFleet) -> openai.OpenAI:
    return fleet.client()


def ask(client: openai.OpenAI, messages: list[Any], max_tokens: int = 8) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0
    )


def streamed(client: openai.OpenAI, messages: list[Any], max_tokens: int) -> Iterator[Any]:
    return client.chat.completions.create(  # type: ignore[no-any-return]
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip


def test_the_openai_client_gets_words_streamed_or_not(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name three rivers."}]
    reply = ask(client, messages, 12)
    text = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 12 and reply.usage.prompt_tokens > 0
    assert all(w.isalpha() for w in text.split()) and len(text.split()) >= 6
    chunks = list(streamed(client, messages, 12))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == 12


def test_a_conversation_follows_its_cache(client: openai.OpenAI, fleet: SimFleet) -> None:
    """Each round after the first goes where the conversation's blocks are, once the router
    has them: a round waits for the last one's KV events (a round's prompt and answer fill at
    least one new block), since a round routed before they arrive has no overlap to follow,
    and for the router to count the last round finished (while its load still counts, a less
    loaded worker can win the round: a 'balance')."""

    def indexed() -> int:
        return sum(w["indexed_blocks"] for w in fleet.router()["workers"].values())

    def settled(seen: int) -> bool:
        workers = fleet.router()["workers"].values()
        indexed = sum(w["indexed_blocks"] for w in workers)
        return indexed > seen and all(w["in_flight"] == 0 for w in workers)

    before = fleet.router()["decisions"].get("cache", 0)
    messages = [{"role": "system", "content": "You answer questions about trains. " * 8}]
    cached = []
    for r in range(4):
        messages.append({"role": "user", "content": f"Round {r}: which line goes north?"})
        seen = indexed()
        reply = ask(client, messages)
        poll_until(lambda seen=seen: settled(seen), timeout=30)
        cached.append(reply.usage.prompt_tokens_details.cached_tokens or 0)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    assert all(c > 0 for c in cached[1:]) and cached[1:] == sorted(cached[1:])
    assert fleet.router()["decisions"].get("cache", 0) - before >= 3


@pytest.mark.slow  # ~17 s (the claim timeout); the real fleet's take-over tests run by default
def test_a_killed_worker_mid_stream_is_taken_over_with_the_same_words(
    client: openai.OpenAI, fleet: SimFleet
) -> None:
    messages = [{"role": "user", "content": "Tell me about lighthouses, at length."}]
    text, victim, sent = "", None, 0
    for chunk in streamed(client, messages, 60):
        for choice in chunk.choices:
            text += choice.delta.content or ""
        if victim is None and len(text.split()) >= 5:
            busy = [n for n, w in fleet.router()["workers"].items() if w["in_flight"] > 0]
            victim, sent = busy[0], len(text.split())
            fleet.procs[victim].kill()
    assert victim is not None and chunk.usage.completion_tokens == 60
    (survivor,) = set(WORKERS) - {victim}
    took = [e for e in fleet.procs[survivor].events() if e.get("event") == "taking over a request"]
    assert took and took[-1]["tokens"] >= sent  # it went on from the client's last token
    # the words an uninterrupted run sends (the prompt is cached on the survivor now)
    assert ask(client, messages, 60).choices[0].message.content == text
    fleet.worker(victim).wait_ready()
    poll_until(lambda: victim in fleet.router()["workers"], timeout=DEAD_S)


@pytest.mark.parametrize("command", ["worker", "sim-fleet"])
def test_a_profile_lacking_a_term_is_a_one_line_error(tmp_path: Path, command: str) -> None:
    raw = profile_dict()
    del raw["store"]["load_s_per_block"]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(raw))
    flag = "--simulate" if command == "worker" else "--profile"
    args = [command, "--bus", "redis://127.0.0.1:1/0", "--store", "redis://127.0.0.1:1/0",
            flag, str(path), *(["--workers", "2"] if command == "sim-fleet" else [])]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-P", "-m", "kvserve.services.cli", *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "'store.load_s_per_block' is missing" in lines[0]


def test_a_disaggregated_sim_fleet_hands_off_and_skips_prefill_for_short_parts(
    model_path: Path, tmp_path: Path
) -> None:
    """`kvserve sim-fleet --prefill 1 --decode 1` behind a gateway with --pd-threshold 64: a
    long prompt goes through the prefill worker (its blocks through the store to the decode
    worker); asked again, its uncached part is a few tokens and it goes straight to decode."""
    if not redis_binaries_present():
        pytest.skip("redis-server not installed")
    profile = write_profile(tmp_path / "profile.json")
    f = harness.Fleet(model_path)
    server = RedisServer()
    server.start()
    try:
        f.process(
            "gateway", ("gateway", "--port", "0"), "--bus", server.url,
            "--served-model-name", MODEL, "--pd-threshold", "64",
        ).spawn()  # fmt: skip
        f.process(
            "sim-fleet", ("sim-fleet",), "--bus", server.url, "--store", server.url,
            "--profile", str(profile), "--prefill", "1", "--decode", "1",
        ).spawn()  # fmt: skip
        f.wait_ready()
        http = Http(f.procs["gateway"].url)

        def router() -> dict[str, Any]:
            return dict(http.get("/v1/cache/stats").json()["router"])

        poll_until(lambda: len(router()["workers"]) == 2, timeout=30)
        client = openai.OpenAI(base_url=f.procs["gateway"].url + "/v1", api_key="x")
        prompt = "Describe the harbour at dawn, its boats and its birds. " * 12
        first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8)
        second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8)
        assert first.choices[0].text == second.choices[0].text  # the same words either way
        decisions = router()["decisions"]
        assert decisions.get("short-prefill", 0) >= 1 and sum(decisions.values()) == 2
        assert (second.usage.prompt_tokens_details.cached_tokens or 0) > 0
    finally:
        f.stop()
        server.stop()
