"""BulkReader: MGET read in place against real Redis servers (the shared one, and one of the
test's own with a password and an ACL user), and what a broken stream does to it."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from kvserve.services.bench.lib.process import free_port
from kvserve.services.bench.lib.redis_server import RedisServer, redis_answers
from kvserve.shared.store.bulk_reader import BulkReader, Endpoint, command
from kvserve.shared.store.hashing import BlockHash
from kvserve.shared.store.redis import RedisStore
from redis.exceptions import AuthenticationError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

pytestmark = pytest.mark.redis
LOCAL_REDIS = "redis://127.0.0.1:6379/15"


@pytest.fixture
async def local() -> AsyncIterator[tuple[aioredis.Redis, str]]:
    """A redis-py client on db 15 of the shared server and a key prefix of the test's own."""
    if not await redis_answers(LOCAL_REDIS):
        pytest.skip("no Redis at 127.0.0.1:6379")
    client = aioredis.from_url(LOCAL_REDIS)
    prefix = f"kvtest:bulk:{uuid.uuid4().hex}"
    yield client, prefix
    keys = [k async for k in client.scan_iter(match=f"{prefix}:*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


async def test_values_match_redis_py_and_the_buffer_grows(
    local: tuple[aioredis.Redis, str],
) -> None:
    client, prefix = local
    values = {
        "empty": b"",
        "crlf": b"\r\n$5\r\n*2\r\n" * 3,  # RESP framing inside a value is only data
        "small": b"x",
        "large": bytes(range(256)) * 4096,  # 1 MiB: far past the first call's size hint
    }
    for name, value in values.items():
        await client.set(f"{prefix}:{name}", value)
    keys = [f"{prefix}:{n}" for n in ("small", "missing", "empty", "crlf", "large", "small")]
    reader = BulkReader(Endpoint(port=6379, db=15))
    try:
        for _ in range(2):  # the second call reuses the connection and sizes from the first
            got = await reader.mget(keys)
            expected = await client.mget(keys)
            assert [None if v is None else bytes(v) for v in got] == expected
            assert got[1] is None and bytes(got[4] or b"") == values["large"]
        assert len(reader._idle) == 1
    finally:
        reader.drop_idle()


async def test_chunks_pipelined_on_one_connection(local: tuple[aioredis.Redis, str]) -> None:
    """Every chunk's MGET sent at once: each chunk's values in order, from one connection,
    replies that arrive in the same read split where they end; leaving early drops it."""
    client, prefix = local
    values = {f"{prefix}:{i}": bytes([i]) * (70_000 * (i % 3)) for i in range(9)}
    await client.mset(values)
    keys = list(values)
    chunks = [keys[0:4], [f"{prefix}:none", keys[4]], keys[5:9], keys[0:1]]
    reader = BulkReader(Endpoint(port=6379, db=15))
    try:
        for ahead in (1, 2, 4):  # commands sent before their replies are read
            got = [c async for c in reader.mget_chunks(chunks, ahead)]
            assert [[None if v is None else bytes(v) for v in c] for c in got] == [
                await client.mget(c) for c in chunks
            ]
            assert len(reader._idle) == 1
        async for _ in reader.mget_chunks(chunks):
            break  # replies left unread: the connection cannot be reused
        assert reader._idle == []
    finally:
        reader.drop_idle()


async def test_a_stream_read_to_its_last_reply_keeps_its_connection(
    local: tuple[aioredis.Redis, str],
) -> None:
    """A caller that takes every chunk and then closes the stream, as a load does, leaves the
    connection for the next call; through RedisStore.stream_views too."""
    client, prefix = local
    values = {f"{prefix}:{i}": bytes([i]) * 50_000 for i in range(6)}
    await client.mset(values)
    keys = list(values)
    reader = BulkReader(Endpoint(port=6379, db=15))
    try:
        stream = reader.mget_chunks([keys[:3], keys[3:]])
        first = await anext(stream)
        assert reader._idle == []  # the second reply is still being read
        last = await anext(stream)
        await stream.aclose()
        assert [bytes(v or b"") for v in first + last] == list(values.values())
        assert len(reader._idle) == 1
        conn = reader._idle[0]
        assert [bytes(v or b"") for v in await reader.mget(keys[:1])] == [values[keys[0]]]
        assert reader._idle == [conn]
    finally:
        reader.drop_idle()

    hashes = [BlockHash(hashlib.sha256(bytes([i])).digest()) for i in range(5)]
    store = RedisStore.from_url(f"{LOCAL_REDIS}?namespace={prefix}&timeout=2")
    try:
        await store.put_many([(h, bytes([i]) * 1000) for i, h in enumerate(hashes)])
        for _ in range(2):
            stream2 = store.stream_views(hashes, 2)
            got = [await anext(stream2) for _ in range(3)]
            await stream2.aclose()
            assert [bytes(v or b"") for c in got for v in c] == [
                bytes([i]) * 1000 for i in range(5)
            ]
            assert store.bulk is not None and len(store.bulk._idle) == 1
    finally:
        await store.close()


async def test_recycled_buffers_take_later_replies(local: tuple[aioredis.Redis, str]) -> None:
    """`open(reply_bytes)` makes the buffers; a recycled chunk's buffer takes a later reply,
    which reads correctly over the earlier one's bytes; a chunk not recycled keeps its values
    while later replies are read."""
    client, prefix = local
    keys = [f"{prefix}:{i}" for i in range(8)]
    chunks = [keys[:4], keys[4:]]
    reader = BulkReader(Endpoint(port=6379, db=15), max_buffers=2)

    async def read(rnd: int, recycle: bool, size: int = 25_000) -> list[list[memoryview | None]]:
        want = {k: bytes([rnd * 16 + i]) * (size + 100 * i) for i, k in enumerate(keys)}
        await client.mset(want)
        got = []
        async for chunk in reader.mget_chunks(chunks):
            assert [bytes(v or b"") for v in chunk] == [want[k] for k in chunks[len(got)]]
            got.append(chunk)
            if recycle:
                reader.recycle(chunk)
        return got

    try:
        await reader.open(reply_bytes=4 * 30_000)
        made = list(reader._buffers)
        assert len(made) == 2 and all(len(b) == 120_000 for b in made)
        for rnd in range(3):  # each round other values
            for chunk in await read(rnd, recycle=True):
                assert chunk[0] is not None and any(chunk[0].obj is m for m in made)
        await read(3, recycle=True, size=40_000)  # longer than the buffers: grown
        kept = await read(3, recycle=False)
        before = [[bytes(v or b"") for v in c] for c in kept]
        await read(4, recycle=True)
        assert [[bytes(v or b"") for v in c] for c in kept] == before
        assert len(reader._buffers) <= reader.max_buffers
    finally:
        reader.drop_idle()


async def test_a_reply_of_no_values_keeps_its_buffer(local: tuple[aioredis.Redis, str]) -> None:
    """A chunk whose keys hold nothing yields Nones, no view of its buffer: the buffer is the
    reader's again at once (a load whose blocks were all evicted after its presence question
    hands nothing back to `recycle`, and must not cost the reader one of its kept buffers)."""
    _, prefix = local
    reader = BulkReader(Endpoint(port=6379, db=15), max_buffers=2)
    try:
        await reader.open(reply_bytes=4096)
        made = list(reader._buffers)
        for _ in range(3):
            assert await reader.mget([f"{prefix}:absent:{i}" for i in range(8)]) == [None] * 8
            assert len(reader._buffers) == 2
        assert all(any(b is m for m in made) for b in reader._buffers)
    finally:
        reader.drop_idle()


async def test_store_get_views_equals_get_many_in_chunks(local: tuple[aioredis.Redis, str]) -> None:
    """RedisStore's loads read through the bulk reader, one MGET per `batch` keys."""
    _, prefix = local
    store = RedisStore.from_url(f"{LOCAL_REDIS}?namespace={prefix}&batch=2&timeout=2")
    assert store.bulk is not None
    hashes = [BlockHash(hashlib.sha256(bytes([i])).digest()) for i in range(5)]
    try:
        await store.put_many([(hh, bytes([i]) * (1000 * i)) for i, hh in enumerate(hashes[:4])])
        views = await store.get_views(hashes)
        assert [None if v is None else bytes(v) for v in views] == await store.get_many(hashes)
        assert views[4] is None and all(isinstance(v, memoryview) for v in views[:4])
        st = store.stats()
        assert st["hits"] == 8 and st["misses"] == 2 and st["get_errors"] == 0
    finally:
        await store.close()


async def test_tls_and_resp3_urls_stay_with_redis_py() -> None:
    for url in ("rediss://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0?protocol=3"):
        store = RedisStore.from_url(url)
        assert store.bulk is None, url
        await store.close()


async def test_a_unix_socket_url_with_store_options() -> None:
    """`unix:///path?db=&namespace=&timeout=`: the store's own options taken out, the rest
    (the socket's path, the db) left for redis-py and the bulk reader, whose loads go through
    the socket (a URL with no host once lost its `//` on the way and was refused)."""
    import shutil
    import tempfile

    from kvserve.services.bench.lib.redis_server import redis_binaries_present

    if not redis_binaries_present():
        pytest.skip("no redis-server")
    workdir = Path(tempfile.mkdtemp(prefix="kvr"))  # a socket's path must stay short
    sock = workdir / "r.sock"
    server = RedisServer(workdir=workdir, extra_args=["--unixsocket", str(sock)])
    server.start()
    try:
        store = RedisStore.from_url(f"unix://{sock}?db=3&namespace=kvtest-unix&timeout=2")
        assert store.bulk is not None
        assert (store.bulk.endpoint.path, store.bulk.endpoint.db) == (str(sock), 3)
        hashes = [BlockHash(hashlib.sha256(bytes([i])).digest()) for i in range(3)]
        try:
            await store.put_many([(h, bytes([i]) * 5000) for i, h in enumerate(hashes)])
            got = [v async for chunk in store.stream_views(hashes, 2) for v in chunk]
            assert [bytes(v or b"") for v in got] == [bytes([i]) * 5000 for i in range(3)]
        finally:
            await store.close()
        client = aioredis.from_url(f"unix://{sock}?db=3")
        keys = [k async for k in client.scan_iter(match="kvtest-unix:*")]
        await client.aclose()
        assert len(keys) == 3
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
async def locked_server(tmp_path: Path) -> AsyncIterator[RedisServer]:
    """A server of the test's own whose default user needs a password (set once it answers)."""
    server = RedisServer(workdir=tmp_path)
    server.start()
    client = aioredis.Redis(port=server.port)
    await client.config_set("requirepass", "s3cret")
    await client.aclose()
    yield server
    server.stop()


async def test_auth_select_and_an_error_reply(locked_server: RedisServer) -> None:
    """The default user with its password, db 3 and db 0; a wrong password; a user that may
    read only `ok:*` keys, whose MGET of another key gets an error reply."""
    server = locked_server
    admin = aioredis.Redis(port=server.port, password="s3cret", db=3)
    try:
        await admin.execute_command(
            "ACL", "SETUSER", "reader", "on", ">r-pass", "~ok:*", "+@read", "+select"
        )
        await admin.set("ok:a", b"A")
        await admin.set("secret:b", b"B")
        good = BulkReader(Endpoint(port=server.port, db=3, password="s3cret"))
        assert [bytes(v or b"") for v in await good.mget(["ok:a", "secret:b"])] == [b"A", b"B"]
        other_db = BulkReader(Endpoint(port=server.port, db=0, password="s3cret"))
        assert await other_db.mget(["ok:a"]) == [None]
        with pytest.raises(AuthenticationError):
            await BulkReader(Endpoint(port=server.port, db=3, password="wrong")).mget(["ok:a"])
        user = BulkReader(Endpoint(port=server.port, db=3, username="reader", password="r-pass"))
        assert [bytes(v or b"") for v in await user.mget(["ok:a"])] == [b"A"]
        with pytest.raises(ResponseError, match="NOPERM"):  # the server answered: kept
            await user.mget(["ok:a", "secret:b"])
        assert len(user._idle) == 1
        seen = []
        with pytest.raises(ResponseError, match="NOPERM"):  # the chunks before it still come
            async for c in user.mget_chunks([["ok:a"], ["secret:b"], ["ok:a"]]):
                seen.append([bytes(v or b"") for v in c])
        assert seen == [[b"A"]] and len(user._idle) == 1
        assert [bytes(v or b"") for v in await user.mget(["ok:a"])] == [b"A"]
        for reader in (good, other_db, user):
            reader.drop_idle()
    finally:
        await admin.aclose()


async def test_a_reply_cut_short_fails_the_call_and_drops_the_connection() -> None:
    """A server that dies in the middle of a reply (a stand-in speaking RESP: a real Redis cannot
    be stopped at a chosen byte of its reply): the call raises, the connection is not kept."""
    replies = [
        b"*2\r\n$5\r\nhello\r\n$10\r\nonly",  # cut inside the second value
        b"*2\r\n$5\r\nhello\r\n",  # cut between values
        b"*3\r\n$5\r\nhello\r\n$-1\r\n$3\r\nabc\r\n",  # a whole reply, answered next time
    ]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reply = replies.pop(0)
        expected = len(command("MGET", *(["k"] * (3 if not replies else 2))))
        await reader.readexactly(expected)
        writer.write(reply)
        await writer.drain()
        if replies:
            writer.close()
        else:
            await reader.read()  # keep the last connection open until the client lets go

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader = BulkReader(Endpoint(port=port))
    try:
        for _ in range(2):
            with pytest.raises(RedisConnectionError):
                await reader.mget(["k", "k"])
            assert reader._idle == []
        got = await reader.mget(["k", "k", "k"])
        assert [None if v is None else bytes(v) for v in got] == [b"hello", None, b"abc"]
    finally:
        reader.drop_idle()
        server.close()
        await server.wait_closed()


async def test_connect_opens_the_loads_connection_and_never_raises() -> None:
    """`connect` (the connector calls it at start) leaves the bulk reader a connection; against
    a server that is not there it returns, having opened nothing."""
    if not await redis_answers(LOCAL_REDIS):
        pytest.skip("no Redis at 127.0.0.1:6379")
    store = RedisStore.from_url(LOCAL_REDIS)
    assert store.bulk is not None and store.bulk._idle == []
    await store.connect()
    assert len(store.bulk._idle) == 1
    await store.close()
    dead = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2)
    await dead.connect()
    assert dead.bulk is not None and dead.bulk._idle == []
    await dead.close()
