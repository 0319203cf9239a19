"""The stream stall timeout on the gateway as `kvserve gateway` runs it: the Redis bus (a
throwaway redis-server), a scripted worker that emits token events until its request is
cancelled, no engine. A client that stops reading has its request cancelled on the bus with
the reason `stalled`, counted on /metrics, and its connection closed; and the flag that sets
the timeout, shared by `serve` and `gateway`."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from kvserve.services.bench.lib.redis_server import RedisServer
from kvserve.services.bench.sweeps.chaos_slow_reader import post_unread
from kvserve.services.cli import build_parser
from kvserve.services.cli_support import CliError
from kvserve.services.gateway.app import Gateway, GatewayConfig
from kvserve.services.gateway.main import check_gateway_arguments, gateway_config
from kvserve.services.gateway.schema import ModelInfo
from kvserve.shared.bus.base import WorkerPort
from kvserve.shared.bus.redis import RedisBus
from kvserve.shared.model.tokenizer import KVTokenizer
from kvserve.shared.protocol import Cancel, TokenEvent
from prometheus_client.parser import text_string_to_metric_families

from tests.polling import until
from tests.services.server_state import read_to_end

STALL_S = 0.5
MAX_EVENTS = 4000  # 16 MB of text: far more than the socket buffers hold
TEXT = "x" * 4096


async def flood_until_cancelled(port: WorkerPort) -> tuple[str, int]:
    """Take one request and emit a 4 KB token event after another until it is cancelled (at
    most MAX_EVENTS, then finish it): (its id, the events emitted)."""
    deliveries = []
    while not deliveries:
        deliveries = await port.receive(max_count=1, timeout=1.0)
    rid = deliveries[0].request.request_id
    for seq in range(MAX_EVENTS):
        if await port.is_cancelled(rid):
            return rid, seq
        await port.emit(TokenEvent(rid, seq, 0, [42], TEXT, num_prompt_tokens=3))
    await port.emit(TokenEvent(rid, MAX_EVENTS, 0, [42], "", "length", num_prompt_tokens=3))
    return rid, MAX_EVENTS


async def cancel_of(port: WorkerPort, rid: str, timeout: float = 10.0) -> Cancel:
    """The cancel the workers were sent for `rid`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for c in await port.cancels(timeout=1.0):
            if c.request_id == rid:
                return c
    raise AssertionError(f"no cancel for {rid} within {timeout} s")


def connections(server: TestServer) -> int:
    """The connections the server holds open."""
    assert server.runner is not None and server.runner.server is not None
    return len(server.runner.server.connections)


def samples(metrics_text: str, name: str) -> list[Any]:
    return [
        s for f in text_string_to_metric_families(metrics_text) for s in f.samples if s.name == name
    ]


async def test_a_stalled_stream_is_cancelled_on_the_redis_bus(
    tokenizer: KVTokenizer, redis_server: RedisServer
) -> None:
    bus = RedisBus(redis_server.url)
    info = ModelInfo("m", tokenizer, 8192, tokenizer.vocab_size)
    gateway = Gateway(GatewayConfig(stream_stall_timeout_s=STALL_S), bus, info)
    server = TestServer(gateway.app, host="127.0.0.1")
    await server.start_server()
    port = bus.worker("fake")
    await port.start()
    worker = asyncio.create_task(flood_until_cancelled(port))
    try:
        body = {"prompt": "hi", "max_tokens": 5000, "stream": True}
        sock = post_unread(f"http://127.0.0.1:{server.port}", "/v1/completions", body)
        with sock:
            rid, emitted = await asyncio.wait_for(worker, 60)
            assert emitted < MAX_EVENTS
            assert (await cancel_of(port, rid)).reason == "stalled"
            # The server let go of the connection (and what it had buffered for it) without
            # the client reading a byte; its request left the gateway.
            await until(lambda: not connections(server) and not gateway.admission.in_flight)
            received = await asyncio.to_thread(read_to_end, sock)
        async with aiohttp.ClientSession() as http, http.get(server.make_url("/metrics")) as r:
            metrics = await r.text()
    finally:
        worker.cancel()
        await port.close()
        await server.close()
        await bus.close()
    assert [(s.labels, s.value) for s in samples(metrics, "kvserve:stream_stalls_total")] == [
        ({"model_name": "m"}, 1.0)
    ]
    assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received
    assert received.count(b"data: {") > 10


@pytest.mark.parametrize("command", [["serve"], ["gateway", "--bus", "redis://127.0.0.1:1/0"]])
def test_the_stream_stall_timeout_flag(command: list[str]) -> None:
    def parse(*flags: str) -> Any:
        argv = [*command, *flags]
        args = build_parser(argv).parse_args(argv)
        check_gateway_arguments(args)
        return args

    assert gateway_config(parse()).stream_stall_timeout_s == 30.0
    assert gateway_config(parse("--stream-stall-timeout", "2.5")).stream_stall_timeout_s == 2.5
    assert gateway_config(parse("--stream-stall-timeout", "0")).stream_stall_timeout_s == 0.0
    for bad in ("-1", "nan"):
        with pytest.raises(CliError, match="--stream-stall-timeout must be >= 0"):
            parse("--stream-stall-timeout", bad)
