"""MGET straight off the socket: a store load's replies read into one buffer per call, each value
handed back as a memoryview of it.

redis-py hands each value back as a `bytes` of its own: the reply goes from the socket into
asyncio's buffer, from there into hiredis's, and from that into the value, three copies of
every byte of a store load (~0.2 MB a block), fresh allocations each time. Here the reply
goes from the socket into the call's buffer (one copy, made by the kernel while the GIL is
free) and each value is a view of it; a 2,048-token load's gets took 10 ms this way against
15 ms through redis-py (docs/benchmarks.md, "Prefix store").

It speaks RESP2 over plain TCP or a Unix socket (AUTH and SELECT on connect) and does
nothing but MGET, pipelined (`mget_chunks`); everything else, and TLS, stays with redis-py
(RedisStore uses this for its loads when its URL allows). A connection is used by one call at
a time and closed when a call on it fails or is cancelled: its stream may then be anywhere
inside a reply. Errors: a transport failure raises redis's ConnectionError (or OSError); an
error reply, redis's ResponseError (the connection stays usable).

The replies are read into buffers the reader keeps: values a caller is done with go back with
`recycle`, and their buffer takes a later reply (a reply of no values, every key empty, hands
its buffer back itself). `open` can make them resident beforehand. A
fresh buffer per reply had its pages faulted in, and zero-filled, while the reply waited: in a
fresh engine's first load, ~2,300-3,900 faults, and 13-17 ms of the store thread's CPU per
2,048-token load against 6-9 ms with kept buffers (docs/benchmarks.md, "Prefix store").
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

from redis.exceptions import AuthenticationError, NoPermissionError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

MAX_LINE = 64  # longest header line a reply to MGET may have (a bulk's "$<length>")
MAX_VALUE_BYTES = 512 << 20  # Redis's own limit on a string value
MAX_KEPT_BYTES = 32 << 20  # reply buffers kept for reuse, in all


@dataclass(frozen=True)
class Endpoint:
    """Where the server is and how to log in: `path` (a Unix socket) or `host` and `port`."""

    host: str = "127.0.0.1"
    port: int = 6379
    path: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = None


def command(*args: str | bytes) -> bytes:
    """A command as RESP's array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        raw = a.encode() if isinstance(a, str) else a
        parts += [b"$%d\r\n" % len(raw), raw, b"\r\n"]
    return b"".join(parts)


class _Connection:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()

    def close(self) -> None:
        self.sock.close()

    async def call(self, payload: bytes) -> None:
        """Send a command whose reply is a simple string (+OK); an error reply raises."""
        await self.loop.sock_sendall(self.sock, payload)
        reply = _Reply(self, 256)
        line = await reply.line()
        if line.startswith(b"-"):
            raise _error(line)
        if not line.startswith(b"+") or reply.pos != reply.filled:
            raise RedisConnectionError(f"unexpected reply {bytes(line[:32])!r}")

    async def read_mget(self, keys: Sequence[str], reply: _Reply) -> list[memoryview | None]:
        """The reply to an MGET of `keys`, read into `reply` (which may hold its first bytes);
        bytes past its end (the next pipelined reply's) stay in `reply` from `reply.pos`."""
        head = await reply.line()
        if head.startswith(b"-"):
            raise _error(head)
        if not head.startswith(b"*") or _int(head[1:]) != len(keys):
            raise RedisConnectionError(f"unexpected reply to MGET: {bytes(head[:32])!r}")
        spans: list[tuple[int, int] | None] = []
        for _ in keys:
            line = await reply.line()
            if not line.startswith(b"$"):
                raise RedisConnectionError(f"unexpected value in MGET: {bytes(line[:32])!r}")
            size = _int(line[1:])
            if size == -1:
                spans.append(None)
                continue
            if not 0 <= size <= MAX_VALUE_BYTES:
                raise RedisConnectionError(f"bad value length {size}")
            start = reply.pos
            await reply.fill(start + size + 2)
            if reply.buf[start + size : start + size + 2] != b"\r\n":
                raise RedisConnectionError("value not followed by CRLF")
            reply.pos = start + size + 2
            spans.append((start, start + size))
        view = memoryview(reply.buf)  # views only now: `fill` may have moved the buffer
        return [None if s is None else view[s[0] : s[1]] for s in spans]


class _Reply:
    """One reply read into `buf` (a new one of the size hint unless given; grown, by copying,
    when the reply outruns it), starting with `head`: what the read of the reply before it
    received past its end."""

    def __init__(
        self,
        conn: _Connection,
        size_hint: int,
        head: bytes | bytearray = b"",
        buf: bytearray | None = None,
    ) -> None:
        self.conn = conn
        need = max(size_hint, len(head), 256)
        self.buf = buf if buf is not None and len(buf) >= len(head) else bytearray(need)
        self.buf[: len(head)] = head
        self.filled = len(head)  # bytes received into buf
        self.pos = 0  # bytes parsed

    def rest(self) -> bytearray:
        """The bytes received past the parsed reply (the next reply's first bytes)."""
        return self.buf[self.pos : self.filled]

    async def fill(self, end: int) -> None:
        """Receive until `buf` holds its first `end` bytes."""
        if end > len(self.buf):
            grown = bytearray(max(end, 2 * len(self.buf)))
            grown[: self.filled] = self.buf[: self.filled]
            self.buf = grown
        view = memoryview(self.buf)
        while self.filled < end:
            n = await self.conn.loop.sock_recv_into(self.conn.sock, view[self.filled :])
            if n == 0:
                raise RedisConnectionError("connection closed by the server")
            self.filled += n

    async def line(self) -> bytearray:
        """The next CRLF-terminated line, without its CRLF."""
        while True:
            end = self.buf.find(b"\r\n", self.pos, self.filled)
            if end >= 0:
                line = self.buf[self.pos : end]
                self.pos = end + 2
                return line
            if self.filled - self.pos > MAX_LINE:
                raise RedisConnectionError("reply line too long")
            await self.fill(self.filled + 1)


def _int(raw: bytes | bytearray) -> int:
    try:
        return int(raw)
    except ValueError:
        raise RedisConnectionError(f"bad length {bytes(raw[:32])!r}") from None


def _error(line: bytes | bytearray) -> RedisError:
    message = bytes(line[1:]).decode(errors="replace")
    if message.startswith(("WRONGPASS", "NOAUTH", "ERR invalid password")):
        return AuthenticationError(message)
    if message.startswith("NOPERM"):
        return NoPermissionError(message)
    return ResponseError(message)


class BulkReader:
    """MGET over connections of its own to one server (a few, kept while idle)."""

    def __init__(self, endpoint: Endpoint, max_idle: int = 4, max_buffers: int = 8) -> None:
        """`max_buffers`: reply buffers kept for reuse, MAX_KEPT_BYTES at most (a pipelined
        stream's `ahead` + 1 in reading, the rest with callers that have not recycled them
        yet)."""
        self.endpoint = endpoint
        self.max_idle = max_idle
        self.max_buffers = max_buffers
        self._idle: list[_Connection] = []
        self._buffers: list[bytearray] = []
        self._bytes_per_key = 0  # the last reply's, to size the next one's buffer

    async def mget(self, keys: Sequence[str]) -> list[memoryview | None]:
        """The values of `keys` (None where a key holds none), views of one buffer (a kept
        one, which `recycle` takes back)."""
        out: list[memoryview | None] = []
        async for values in self.mget_chunks([keys]):
            out = values
        return out

    async def mget_chunks(
        self, chunks: Sequence[Sequence[str]], ahead: int = 2
    ) -> AsyncGenerator[list[memoryview | None], None]:
        """One MGET per chunk, pipelined on one connection, `ahead` of them asked before their
        replies are read (the server answers them in order, one after the other, and holds at
        most `ahead` + 1 replies for this client, whose output buffers count against `maxmemory`);
        each chunk's values as soon as its reply is in, views of a buffer of its own (a kept
        one, where there is one: `recycle`). An error reply raises after the chunks before it
        were yielded (the connection is kept once the rest of the replies are read); a
        generator left before its last reply was read, or any other failure, closes the
        connection."""
        conn = self._idle.pop() if self._idle else await self._connect()
        error: ResponseError | None = None
        commands = [command("MGET", *c) for c in chunks]
        kept = False
        try:
            await conn.loop.sock_sendall(conn.sock, b"".join(commands[:ahead]))
            rest = bytearray()
            for i, keys in enumerate(chunks):
                if i + ahead < len(commands):
                    await conn.loop.sock_sendall(conn.sock, commands[i + ahead])
                hint = (self._bytes_per_key + 16) * len(keys) + 16
                reply = _Reply(conn, hint, rest, self._buffer(hint))
                values: list[memoryview | None] | None = None
                try:
                    values = await conn.read_mget(keys, reply)
                except ResponseError as e:  # the server answered: the stream is intact
                    error = error or e
                rest = reply.rest()
                sizes = [len(v) for v in values or () if v is not None]
                if sizes:
                    self._bytes_per_key = max(sizes)
                if i == len(chunks) - 1:  # every reply read: kept even if the caller stops here
                    if rest:
                        raise RedisConnectionError("data after the replies")
                    self._keep(conn)
                    kept = True
                if not (error is None and values and any(v is not None for v in values)):
                    self._give(reply.buf)  # no value is a view of it: free again now
                if error is None and values is not None:
                    yield values
        except BaseException:
            if not kept:
                conn.close()
            raise
        if not kept:  # no chunks
            self._keep(conn)
        if error is not None:
            raise error

    def recycle(self, values: Sequence[memoryview | bytes | None]) -> None:
        """Take back the buffer of a chunk's `values` (as `mget_chunks` yielded them), for a
        later reply to be read into: the caller must not read them afterwards."""
        for v in values:
            if isinstance(v, memoryview) and isinstance(v.obj, bytearray):
                self._give(v.obj)
                return

    def _buffer(self, size: int) -> bytearray | None:
        """A kept buffer for a reply of about `size` bytes (the largest where none holds it:
        the reply grows it), or None."""
        if not self._buffers:
            return None
        fits = [b for b in self._buffers if len(b) >= size]
        buf = min(fits, key=len) if fits else max(self._buffers, key=len)
        self._buffers.remove(buf)
        return buf

    def _give(self, buf: bytearray) -> None:
        if self._room_for(len(buf)) and all(b is not buf for b in self._buffers):
            self._buffers.append(buf)

    def _room_for(self, size: int) -> bool:
        kept = sum(len(b) for b in self._buffers)
        return len(self._buffers) < self.max_buffers and kept + size <= MAX_KEPT_BYTES

    async def open(self, reply_bytes: int = 0) -> None:
        """One connection opened now and kept idle for the next call; with `reply_bytes`, the
        reply buffers too, resident (their pages written once here rather than during a
        load)."""
        if not self._idle:
            self._keep(await self._connect())
        while reply_bytes > 0 and self._room_for(reply_bytes):
            self._buffers.append(bytearray(reply_bytes))

    def _keep(self, conn: _Connection) -> None:
        if len(self._idle) < self.max_idle:
            self._idle.append(conn)
        else:
            conn.close()

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        e = self.endpoint
        if e.path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, e.path)
            except BaseException:
                sock.close()
                raise
        else:
            sock = await _tcp(loop, e.host, e.port)
        conn = _Connection(sock)
        try:
            if e.password is not None:
                user = () if e.username is None else (e.username,)
                await conn.call(command("AUTH", *user, e.password))
            if e.db:
                await conn.call(command("SELECT", str(e.db)))
        except BaseException:
            conn.close()
            raise
        return conn

    def drop_idle(self) -> None:
        """Close the idle connections (they may predate an outage)."""
        for conn in self._idle:
            conn.close()
        self._idle.clear()


async def _tcp(loop: asyncio.AbstractEventLoop, host: str, port: int) -> socket.socket:
    """A connected non-blocking TCP socket to the first address of `host` that answers."""
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    error: OSError = OSError(f"no address for {host}")
    for family, kind, proto, _, addr in infos:
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, addr)
        except OSError as err:
            sock.close()
            error = err
            continue
        except BaseException:
            sock.close()
            raise
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    raise error
