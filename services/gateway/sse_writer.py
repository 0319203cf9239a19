"""SSEWriter: the writes of one SSE response, each bounded by the stream stall timeout.

aiohttp's `StreamResponse.write` hands its bytes to the transport and, once the writes since its
last drain pass 64 KiB, awaits the transport's drain: while the transport holds more than its
high-water mark (64 KiB), until it is back under its low-water mark (16 KiB). A client that stops
reading lets the kernel's socket buffers fill (its receive buffer, this side's send buffer), then
the transport's, and that wait never ends. Here each write waits at most `stall_timeout_s`;
past it the stream has stalled: the connection is aborted (what is buffered for it in this
process is dropped) and the write raises `StreamStalledError`, so the handler stops and its
request is cancelled on the bus as when a client disconnects. A waiting write suspends only its
own handler: the event loop and every other response go on.

Invariant: after `StreamStalledError` the connection is closed and nothing more is written.
With `stall_timeout_s` 0 a write waits as long as the client takes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from aiohttp import web


class StreamStalledError(Exception):
    """A write waited the whole stall timeout for a client that took no bytes."""


class SSEWriter:
    """Owns nothing but the timeout: `response` is prepared by the handler, `transport` is its
    connection's (None once the connection is gone)."""

    def __init__(
        self,
        response: web.StreamResponse,
        transport: asyncio.Transport | None,
        stall_timeout_s: float,
    ) -> None:
        self.response = response
        self.transport = transport
        self.stall_timeout_s = stall_timeout_s

    async def write(self, data: bytes) -> None:
        await self._bounded(self.response.write(data))

    async def write_eof(self) -> None:
        await self._bounded(self.response.write_eof())

    async def _bounded(self, write: Awaitable[None]) -> None:
        if self.stall_timeout_s <= 0:
            await write
            return
        try:
            async with asyncio.timeout(self.stall_timeout_s):
                await write
        except TimeoutError:
            if self.transport is not None:
                self.transport.abort()
            raise StreamStalledError(
                f"the client read nothing for {self.stall_timeout_s:g} s"
            ) from None
