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
    """One reply read into `buf` (grown, by copying, when it outruns the size hint), starting
    with `head`: what the read of the reply before it received past its end."""

    def __init__(self, conn: _Connection, size_hint: int, head: bytes | bytearray = b"") -> None:
        self.conn = conn
        self.buf = bytearray(max(size_hint, len(head), 256))
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

    def __init__(self, endpoint: Endpoint, max_idle: int = 4) -> None:
        self.endpoint = endpoint
        self.max_idle = max_idle
        self._idle: list[_Connection] = []
        self._bytes_per_key = 0  # the last reply's, to size the next one's buffer

    async def mget(self, keys: Sequence[str]) -> list[memoryview | None]:
        """The values of `keys` (None where a key holds none), views of one buffer."""
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
        each chunk's values as soon as its reply is in,
        views of a buffer of its own. An error reply raises after the chunks before it were
        yielded (the connection is kept once the rest of the replies are read); a generator
        left before its end, or any other failure, closes the connection."""
        conn = self._idle.pop() if self._idle else await self._connect()
        error: ResponseError | None = None
        commands = [command("MGET", *c) for c in chunks]
        try:
            await conn.loop.sock_sendall(conn.sock, b"".join(commands[:ahead]))
            rest = bytearray()
            for i, keys in enumerate(chunks):
                if i + ahead < len(commands):
                    await conn.loop.sock_sendall(conn.sock, commands[i + ahead])
                hint = (self._bytes_per_key + 16) * len(keys) + 16
                reply = _Reply(conn, hint, rest)
                try:
                    values = await conn.read_mget(keys, reply)
                except ResponseError as e:  # the server answered: the stream is intact
                    error = error or e
                    rest = reply.rest()
                    continue
                rest = reply.rest()
                sizes = [len(v) for v in values if v is not None]
                if sizes:
                    self._bytes_per_key = max(sizes)
                if error is None:
                    yield values
            if rest:
                raise RedisConnectionError("data after the replies")
        except BaseException:
            conn.close()
            raise
        self._keep(conn)
        if error is not None:
            raise error

    async def open(self) -> None:
        """One connection opened now and kept idle for the next call."""
        if not self._idle:
            self._keep(await self._connect())

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
