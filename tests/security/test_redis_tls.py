"""kvserve on a locked-down Redis, as docs/deployment.md ("Securing Redis") describes it: TLS
only (`rediss://`, the CA given in the URL's `ssl_ca_certs`), the default user off, and one ACL
user whose password is in the URL and whose rule (`ACL_RULE`, quoted in the doc) confines it to
kvserve's keys and to the commands it needs.

A throwaway redis-server with a self-signed CA and server certificate (made with the openssl
command) serves: the prefix store (frames written, read back, verified, pinned, deleted) and a
bus round trip (a request submitted, received by a worker, its events streamed back, acked)
work over it; a plaintext client, a client that does not trust the CA and a client without
the password get nothing (misses and counted errors, never an exception); the ACL refuses keys
outside `kvserve:*` and the dangerous commands (FLUSHALL, CONFIG, KEYS). Skipped, with the
reason, where redis-server was built without TLS or openssl is missing."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import torch
from kvserve.services.bench.lib.process import free_port
from kvserve.services.bench.lib.redis_server import answers
from kvserve.shared.bus.redis import RedisBus
from kvserve.shared.bus.redis_layout import RedisBusConfig
from kvserve.shared.protocol import Cancel, GenerateRequest, TokenEvent
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.store.backends import open_store
from kvserve.shared.store.codec import BlockMeta, DecodedBlock, decode_block, encode_block
from kvserve.shared.store.hashing import BlockHash, block_hashes, root_hash
from kvserve.shared.store.redis import RedisStore

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parents[2]
USER = "kvserve"
PASSWORD = "correct-horse-battery-staple"
# The ACL rule of docs/deployment.md, after `ACL SETUSER kvserve on >PASSWORD`: kvserve's keys
# (bus and store share the `kvserve:` prefix), no pub/sub channels, and the read, write, keyspace
# and connection commands less the dangerous ones.
ACL_RULE = (
    "~kvserve:* resetchannels -@all +@read +@write +@keyspace +@connection "
    "+eval +evalsha +script|load -@dangerous"
)
READY_TIMEOUT_S = 10.0

META = BlockMeta("m", "float32", block_size=4, num_layers=2, num_kv_heads=1, head_dim=8)
ROOT_HASH = root_hash("m", "t", "float32", 4)


@dataclass
class TlsRedis:
    port: int
    ca: Path
    other_ca: Path  # a CA that did not sign the server's certificate

    def url(self, *, scheme: str = "rediss", auth: bool = True, ca: Path | None = None) -> str:
        cred = f"{USER}:{PASSWORD}@" if auth else ""
        query = f"?ssl_ca_certs={ca or self.ca}" if scheme == "rediss" else ""
        return f"{scheme}://{cred}127.0.0.1:{self.port}/0{query}"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _make_ca(name: str, cwd: Path) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "1",
             "-subj", f"/CN=kvserve test {name}", cwd=cwd)  # fmt: skip


def _make_certificates(cwd: Path) -> None:
    """ca.crt, and server.crt/server.key for 127.0.0.1 signed by it; other.crt, another CA."""
    _make_ca("ca", cwd)
    _make_ca("other", cwd)
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1",
             cwd=cwd)  # fmt: skip
    (cwd / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-set_serial", "1", "-days", "1", "-extfile", "san.ext", "-out", "server.crt",
             cwd=cwd)  # fmt: skip


def _output(proc: subprocess.Popen[bytes], log: Path) -> str:
    """What an exited redis-server said: its log file, then its stderr."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return text + (proc.stderr.read() if proc.stderr else b"").decode(errors="replace")


@pytest.fixture(scope="module")
def tls_redis() -> Iterator[TlsRedis]:
    exe = shutil.which("redis-server")
    if exe is None or shutil.which("openssl") is None:
        pytest.skip("needs redis-server and the openssl command")
    workdir = Path(tempfile.mkdtemp(prefix="kvserve-tls-redis-"))
    _make_certificates(workdir)
    server = TlsRedis(free_port(), workdir / "ca.crt", workdir / "other.crt")
    args = ["--port", "0", "--tls-port", str(server.port), "--bind", "127.0.0.1"]
    args += ["--tls-cert-file", "server.crt", "--tls-key-file", "server.key"]
    args += ["--tls-ca-cert-file", "ca.crt", "--tls-auth-clients", "no"]
    args += ["--save", "", "--appendonly", "no", "--dir", str(workdir)]
    args += ["--logfile", "redis.log", "--user", "default", "off"]
    args += ["--user", USER, "on", f">{PASSWORD}", *ACL_RULE.split()]
    proc = subprocess.Popen([exe, *args], cwd=workdir, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)  # fmt: skip
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not answers(server.url()):
            if proc.poll() is not None:
                said = _output(proc, workdir / "redis.log")
                if "tls" in said.lower() and "support" in said.lower():
                    pytest.skip(f"redis-server was built without TLS: {said[-300:]}")
                raise RuntimeError(f"redis-server exited: {said[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError("TLS redis-server did not answer")
            time.sleep(0.02)
        yield server
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def _frames(n: int) -> list[tuple[BlockHash, bytes]]:
    """n chained blocks of META: (hash, frame)."""
    g = torch.Generator().manual_seed(0)
    tokens = list(range(1, 4 * n + 1))
    hashes = block_hashes(ROOT_HASH, tokens, 4)
    out: list[tuple[BlockHash, bytes]] = []
    parent = ROOT_HASH
    for i, h in enumerate(hashes):
        k = torch.randn(META.block_shape, generator=g)
        v = torch.randn(META.block_shape, generator=g)
        out.append((h, encode_block(META, tokens[4 * i : 4 * i + 4], k, v, "native", parent)))
        parent = h
    return out


async def test_the_store_works_over_tls_with_an_acl_user(tls_redis: TlsRedis) -> None:
    store = open_store(tls_redis.url())
    assert isinstance(store, RedisStore)
    frames = _frames(3)
    hashes = [h for h, _ in frames]
    try:
        assert await store.put_many(frames) == 3
        got = await store.get_many(hashes)
        assert got == [f for _, f in frames]
        for h, value in zip(hashes, got, strict=True):
            assert value is not None
            assert isinstance(decode_block(value, META, h, ROOT_HASH), DecodedBlock)
        await store.pin(hashes[:1])
        await store.unpin(hashes[:1])
        await store.delete(hashes[1:])
        assert await store.contains(hashes) == [True, False, False]
        stats = store.stats()
        assert (stats["get_errors"], stats["put_errors"], store.other_errors) == (0, 0, 0)
    finally:
        await store.close()


async def test_the_bus_works_over_tls_with_an_acl_user(tls_redis: TlsRedis) -> None:
    bus = RedisBus(tls_redis.url(), RedisBusConfig())
    port = bus.worker("w1")
    try:
        await port.start()
        sent = GenerateRequest("r1", [1, 2, 3], SamplingParams(max_tokens=2), cache_salt="t")
        stream = await bus.submit(sent)
        (delivery,) = await port.receive(timeout=5)
        assert delivery.request == sent
        await port.emit(TokenEvent("r1", 0, 0, [7], "a"))
        await port.emit(TokenEvent("r1", 1, 0, [8], "b", finish_reason="length"))
        got = [event async for event in stream]
        assert [(e.seq, e.text, e.finish_reason) for e in got] == [
            (0, "a", None),
            (1, "b", "length"),
        ]
        await port.ack(delivery)
        assert await bus.ready()
        await bus.cancel("r2", "client")
        assert await port.cancels(timeout=5) == [Cancel("r2", "client")]
        await stream.close()
    finally:
        await port.close()
        await bus.close()


@pytest.mark.parametrize(
    "how",
    ["plaintext", "untrusted CA", "no password"],
)
async def test_other_clients_get_nothing(tls_redis: TlsRedis, how: str) -> None:
    url = {
        "plaintext": tls_redis.url(scheme="redis"),
        "untrusted CA": tls_redis.url(ca=tls_redis.other_ca),
        "no password": tls_redis.url(auth=False),
    }[how]
    store = open_store(url + ("&" if "?" in url else "?") + "timeout=0.5&attempts=1")
    try:
        h, frame = _frames(1)[0]
        assert await store.put_many([(h, frame)]) == 0
        assert await store.get_many([h]) == [None]
        stats = store.stats()
        assert stats["put_errors"] == 1 and stats["get_errors"] == 1, stats
    finally:
        await store.close()


def test_the_acl_confines_kvserve_to_its_keys(tls_redis: TlsRedis) -> None:
    client = redis.Redis.from_url(tls_redis.url())
    try:
        client.set("kvserve:probe", b"1", ex=10)
        for command in (
            ("SET", "elsewhere", "1"),
            ("GET", "elsewhere"),
            ("FLUSHALL",),
            ("KEYS", "*"),
            ("CONFIG", "GET", "maxmemory"),
            ("ACL", "LIST"),
            ("RESTORE", "kvserve:restored", "0", "not a dump"),
            ("EVAL", "return redis.call('GET', KEYS[1])", "1", "elsewhere"),
            ("SCRIPT", "FLUSH"),
            ("PUBLISH", "kvserve:x", "1"),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.execute_command(*command)
        # A script may run (the bus's own), but not reach another key.
        with pytest.raises(redis.exceptions.ResponseError, match="can't access"):
            client.eval("return redis.call('GET', 'elsewhere')", 0)
        assert client.eval("return redis.call('GET', KEYS[1])", 1, "kvserve:probe") == b"1"
    finally:
        client.close()


def test_the_documented_rule_is_the_tested_one() -> None:
    doc = (ROOT / "docs" / "deployment.md").read_text()
    assert f"ACL SETUSER kvserve on >PASSWORD {ACL_RULE}" in doc
    assert "ssl_ca_certs=" in doc and "rediss://kvserve:" in doc
