"""A client that opens a stream and never reads it, against a real `kvserve serve` (the real
model, the in-process bus and worker) with a short `--stream-stall-timeout`: the gateway aborts
the request once a write has waited that long, so the engine frees its blocks; the stall is
counted on /metrics and logged once; meanwhile a client that reads streams the same greedy text
as when it runs alone, never waiting on the stalled one."""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest
from kvserve.services.bench.lib.http import Http
from kvserve.services.bench.lib.process import ServerProcess
from kvserve.services.bench.lib.readiness import poll_until
from kvserve.services.bench.sweeps.chaos_slow_reader import open_unread_stream
from prometheus_client.parser import text_string_to_metric_families

from tests.services.openai_suite import MODEL, NUM_BLOCKS
from tests.services.server_state import cache_totals, idle, read_to_end

STALL_S = 2.0
STALLED_EVENT = "stream stalled, request aborted"
CALM = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def server(start_server) -> ServerProcess:
    return start_server(
        "--store", "memory://",
        "--served-model-name", MODEL,
        "--num-blocks", str(NUM_BLOCKS),
        "--stream-stall-timeout", str(STALL_S),
    )  # fmt: skip


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Http:
    return Http(server.url)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def stalls(http: Http) -> float:
    """kvserve:stream_stalls_total (0 before the first stall)."""
    return sum(
        s.value
        for f in text_string_to_metric_families(http.get("/metrics").text)
        for s in f.samples
        if s.name == "kvserve:stream_stalls_total"
    )


def read_calm_stream(client: openai.OpenAI) -> tuple[str, float]:
    """A short greedy chat stream, read as it comes: its text and the longest wait between two
    of its chunks."""
    stream = client.chat.completions.create(
        model=MODEL, messages=CALM, max_tokens=24, temperature=0, stream=True
    )
    parts, waits, last = [], [], None
    for chunk in stream:
        now = time.monotonic()
        if last is not None:
            waits.append(now - last)
        last = now
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
    return "".join(parts), max(waits)


def events_of(server: ServerProcess, event: str, **fields: Any) -> list[dict[str, Any]]:
    return [
        e
        for e in server.events()
        if e.get("event") == event and all(e.get(k) == v for k, v in fields.items())
    ]


def test_a_client_that_stops_reading_is_aborted_and_others_stream_on(
    server: ServerProcess, http: Http, client: openai.OpenAI
) -> None:
    poll_until(lambda: idle(http))
    calm, _ = read_calm_stream(client)
    before = stalls(http)
    with open_unread_stream(server.url) as sock:
        poll_until(lambda: cache_totals(http)["num_requests_running"] >= 1)
        # Calm streams back to back until the stalled one is aborted: the last ones run while
        # its write waits out the stall timeout.
        texts, waits = [], []
        deadline = time.monotonic() + 120
        while stalls(http) == before:
            assert time.monotonic() < deadline, "the unread stream was never aborted"
            text, wait = read_calm_stream(client)
            texts.append(text)
            waits.append(wait)
        after = poll_until(lambda: idle(http), timeout=30)
        # What the stalled client gets: what the kernel held for it, then the end of the
        # connection, without `data: [DONE]`.
        received = read_to_end(sock)
    assert stalls(http) == before + 1
    assert after["num_used_blocks"] == 0
    assert texts and set(texts) == {calm}
    assert max(waits) < STALL_S
    assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received
    assert received.count(b"data: {") > 20

    (stalled,) = poll_until(lambda: events_of(server, STALLED_EVENT))
    rid = stalled["request_id"]
    assert rid.startswith("chatcmpl-")
    (finished,) = poll_until(lambda: events_of(server, "request finished", request_id=rid))
    assert finished["status"] == "stalled" and finished["completion_tokens"] < 2000
    assert events_of(server, "cancelling request", request_id=rid, reason="stalled")
