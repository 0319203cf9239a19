"""A TCP proxy that injects network faults between a client and a server (kvserve and Redis in
the fault-injection benchmark): added latency, cut connections and a black hole.

`FaultProxy` runs on the caller's event loop; `ThreadedFaultProxy` owns a thread with its own
loop and one `FaultProxy` on it, for synchronous callers (its methods may be called from any
thread but the loop's own, and return once the change has taken effect).

A link is one accepted client connection and the connection the proxy dials to the target for
it. Each direction of a link is a receiver task (reads chunks from one side into a bounded
queue, each stamped with the time it may leave) and a sender task (writes them to the other
side in queue order), so a delay adds latency without serialising chunks behind each other.

Invariants:
- The proxy owns every link and every task: a link lives in `_links` from accept until its task
  is done, and its transports are closed when the task ends, however it ends. `close()` stops
  listening, cancels every link task and awaits it; nothing of the proxy's runs afterwards (a
  connection the kernel accepted while `close()` runs is closed at once).
- Per direction, bytes leave in the order they arrived; the delay applies to each chunk (and to
  the end of stream) from the moment it was read, with the delay in force at that moment.
- Half-close: when one side reaches end of stream the other side's write half is shut
  (`write_eof`) after the chunks before it; a link closes once both directions have ended.
- An error on a link (a reset, a refused dial) ends that link only, never another one or the
  listener.
- Black hole: while it is on, no link reads or writes (the peers' writes back up in their socket
  buffers, after at most the stream's read-ahead; their reads hang) and new clients are accepted
  but the target is not dialed. Switching it off closes every link that was open, which is every
  link that was stalled by it, then lets new links flow.
- `cut()` and the end of a black hole close links abruptly (pending bytes are dropped); both
  count in `ProxyStats.cut`. Links closed by `close()` do not.
- Counters change only on the loop thread; `stats()` is a consistent snapshot.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import logging
import math
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 * 1024
# Chunks in flight per direction (read, not yet written): the window a delayed direction can
# keep moving, at most QUEUE_CHUNKS * CHUNK_BYTES bytes.
QUEUE_CHUNKS = 64

T = TypeVar("T")


class Direction(enum.Enum):
    TO_TARGET = "to_target"
    TO_CLIENT = "to_client"


@dataclass(frozen=True)
class ProxyStats:
    """A snapshot of the proxy's counters; bytes count what was handed to the receiving side."""

    accepted: int
    open: int
    bytes_to_target: int
    bytes_to_client: int
    cut: int


@dataclass(frozen=True)
class _Chunk:
    due: float  # loop time at which it may be written
    data: bytes  # b"": end of stream


class _Link:
    """One client connection and, once dialed, its connection to the target."""

    def __init__(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter):
        self.client_reader = client_reader
        self.client_writer = client_writer
        self.target_reader: asyncio.StreamReader | None = None
        self.target_writer: asyncio.StreamWriter | None = None

    def writers(self) -> list[asyncio.StreamWriter]:
        return [w for w in (self.client_writer, self.target_writer) if w is not None]

    def close(self) -> None:
        """Close both sides after their buffered bytes are sent."""
        for w in self.writers():
            if not w.transport.is_closing():
                w.close()

    def abort(self) -> None:
        """Close both sides now, dropping buffered bytes; idempotent."""
        for w in self.writers():
            if not w.transport.is_closing():
                w.transport.abort()

    async def wait_closed(self) -> None:
        for w in self.writers():
            # The exception (if any) is the reason the connection was lost: already handled.
            await asyncio.gather(w.wait_closed(), return_exceptions=True)


class FaultProxy:
    """Forwards TCP connections from listen_host:listen_port (`listen`) to
    target_host:target_port (`target`), with faults switched on and off at any time; see the
    module docstring for the invariants."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
    ) -> None:
        self.target = (target_host, target_port)
        self.listen = (listen_host, listen_port)
        self._server: asyncio.Server | None = None
        self._port: int | None = None
        self._links: dict[_Link, asyncio.Task[None]] = {}
        self._delay = 0.0
        self._flowing = asyncio.Event()  # clear while the black hole is on
        self._flowing.set()
        self._accepted = 0
        self._cut = 0
        self._bytes = dict.fromkeys(Direction, 0)

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("FaultProxy already started")
        self._server = await asyncio.start_server(self._on_accept, *self.listen)
        self._port = int(self._server.sockets[0].getsockname()[1])

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("FaultProxy not started")
        return self._port

    async def close(self) -> None:
        """Stop listening, close every link and wait for all of its tasks; idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        await self._drop(list(self._links))
        await server.wait_closed()

    async def __aenter__(self) -> FaultProxy:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- faults ---------------------------------------------------------------------------------

    def set_delay(self, seconds: float) -> None:
        """Hold every chunk read from now on for `seconds` before writing it (0: no delay)."""
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"delay must be a finite number >= 0, got {seconds!r}")
        self._delay = seconds

    async def cut(self) -> int:
        """Close every open link now, both sides; new connections are served as usual.
        Returns the number of links cut, once they are closed."""
        links = list(self._links)
        self._cut += len(links)
        await self._drop(links)
        return len(links)

    async def set_blackhole(self, on: bool) -> None:
        """Stall every link (on); close the stalled links and flow again (off)."""
        if on:
            self._flowing.clear()
            return
        if self._flowing.is_set():
            return
        links = list(self._links)
        self._cut += len(links)
        # Cancel before waking the waiters, in one step: a stalled link never forwards a byte,
        # and a link accepted after this point is a new one.
        tasks = self._cancel(links)
        self._flowing.set()
        await self._settle(links, tasks)

    @property
    def blackhole(self) -> bool:
        return not self._flowing.is_set()

    @property
    def delay(self) -> float:
        return self._delay

    def stats(self) -> ProxyStats:
        return ProxyStats(
            accepted=self._accepted,
            open=len(self._links),
            bytes_to_target=self._bytes[Direction.TO_TARGET],
            bytes_to_client=self._bytes[Direction.TO_CLIENT],
            cut=self._cut,
        )

    # -- links ----------------------------------------------------------------------------------

    def _on_accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A plain callback, not a coroutine, so that the proxy (not asyncio's server) owns the
        # task and the link is registered before anything can cut it.
        if self._server is None:  # accepted by the kernel while close() is under way
            writer.transport.abort()
            return
        self._accepted += 1
        link = _Link(reader, writer)
        task = asyncio.get_running_loop().create_task(self._serve(link))
        self._links[link] = task
        task.add_done_callback(lambda t: self._forget(link, t))

    def _forget(self, link: _Link, task: asyncio.Task[None]) -> None:
        # Runs however the task ended, even if it was cancelled before it started.
        self._links.pop(link, None)
        link.abort()
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("fault proxy link failed", exc_info=exc)

    async def _serve(self, link: _Link) -> None:
        try:
            await self._flowing.wait()  # in the black hole the target is not dialed
            link.target_reader, link.target_writer = await asyncio.open_connection(*self.target)
            await self._forward(link, link.target_reader, link.target_writer)
            link.close()
        except* OSError:
            pass  # a refused dial or a reset peer ends this link only
        finally:
            link.abort()

    async def _forward(
        self, link: _Link, target_reader: asyncio.StreamReader, target_writer: asyncio.StreamWriter
    ) -> None:
        up: asyncio.Queue[_Chunk] = asyncio.Queue(QUEUE_CHUNKS)
        down: asyncio.Queue[_Chunk] = asyncio.Queue(QUEUE_CHUNKS)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._receive(link.client_reader, up))
            tg.create_task(self._send(up, target_writer, Direction.TO_TARGET))
            tg.create_task(self._receive(target_reader, down))
            tg.create_task(self._send(down, link.client_writer, Direction.TO_CLIENT))

    async def _receive(self, src: asyncio.StreamReader, queue: asyncio.Queue[_Chunk]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._flowing.wait()  # in the black hole, leave the bytes with the peer
            data = await src.read(CHUNK_BYTES)
            await queue.put(_Chunk(loop.time() + self._delay, data))
            if not data:
                return

    async def _send(
        self, queue: asyncio.Queue[_Chunk], dst: asyncio.StreamWriter, direction: Direction
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            chunk = await queue.get()
            if (wait := chunk.due - loop.time()) > 0:
                await asyncio.sleep(wait)
            await self._flowing.wait()
            if not chunk.data:
                if dst.can_write_eof() and not dst.transport.is_closing():
                    dst.write_eof()
                return
            dst.write(chunk.data)
            self._bytes[direction] += len(chunk.data)
            await dst.drain()

    def _cancel(self, links: list[_Link]) -> list[asyncio.Task[None]]:
        tasks = [self._links[link] for link in links if link in self._links]
        for task in tasks:
            task.cancel()
        return tasks

    async def _settle(self, links: list[_Link], tasks: list[asyncio.Task[None]]) -> None:
        await asyncio.gather(*tasks, return_exceptions=True)
        for link in links:
            link.abort()
            await link.wait_closed()

    async def _drop(self, links: list[_Link]) -> None:
        await self._settle(links, self._cancel(links))


class ThreadedFaultProxy:
    """A `FaultProxy` on an event loop in a thread of its own, driven from synchronous code
    (`listen`: the proxy's listen host and port, as FaultProxy's).

    The thread and its loop live from `start()` to `close()`; every method runs its work on that
    loop and waits for it (at most `call_timeout_s`), so a fault is in force when the call
    returns. Calling from the loop's own thread would deadlock and raises instead."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        listen: tuple[str, int] = ("127.0.0.1", 0),
        *,
        call_timeout_s: float = 10.0,
    ) -> None:
        self._proxy = FaultProxy(target_host, target_port, *listen)
        self._call_timeout_s = call_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("ThreadedFaultProxy already started")
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=_run_loop, args=(loop,), name="fault-proxy", daemon=True)
        thread.start()
        self._loop, self._thread = loop, thread
        try:
            self._call(self._proxy.start())
        except BaseException:
            self._stop_loop()
            raise

    def close(self) -> None:
        """Close the proxy (every link, the listener), then stop the loop and its thread."""
        if self._thread is None:
            return
        try:
            self._call(self._proxy.close())
        finally:
            self._stop_loop()

    def __enter__(self) -> ThreadedFaultProxy:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def port(self) -> int:
        return self._proxy.port

    def set_delay(self, seconds: float) -> None:
        self._call(_now(lambda: self._proxy.set_delay(seconds)))

    def cut(self) -> int:
        return self._call(self._proxy.cut())

    def set_blackhole(self, on: bool) -> None:
        self._call(self._proxy.set_blackhole(on))

    def stats(self) -> ProxyStats:
        """The counters; after `close()` (no loop left to change them) the final ones."""
        if self._thread is None:
            return self._proxy.stats()
        return self._call(_now(self._proxy.stats))

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            coro.close()
            raise RuntimeError("ThreadedFaultProxy not running")
        if threading.current_thread() is thread:
            coro.close()
            raise RuntimeError("ThreadedFaultProxy called from its own loop thread")
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result(self._call_timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def _stop_loop(self) -> None:
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is None or thread is None:
            return
        if thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
        thread.join()


async def _now(fn: Callable[[], T]) -> T:
    """Run `fn` on the loop (the proxy's state is the loop thread's alone)."""
    return fn()


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
        # Anything still pending (a close that timed out) is cancelled, not leaked.
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()
