"""Throwaway Redis servers for tests: one server (``RedisServer``) or a three-master cluster
(``RedisCluster``), each on free loopback ports with its own temporary directory and no
persistence. Readiness is polled (PING, ``cluster_state:ok``) under a deadline, never slept for.

Fixtures (imported into tests/conftest.py, so every test directory has them):

- ``redis_server``: function-scoped, a started server that the test may kill and restart.
- ``redis_cluster``: session-scoped, started once; a test that kills a node must restart it
  (``RedisCluster.restart`` waits until the cluster is whole again) before it ends.

Use from a test module: ``from tests.redis_servers import RedisCluster, RedisServer, free_port``;
``redis_answers(url)`` says whether a server (such as the shared one on 6379) is there at all.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from redis.crc import key_slot

READY_TIMEOUT_S = 10.0
POLL_S = 0.02


def free_port(exclude: Sequence[int] = ()) -> int:
    """A loopback TCP port nobody listens on now (and not in ``exclude``)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in exclude:
            return port


def redis_binaries_present() -> bool:
    return shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None


async def redis_answers(url: str) -> bool:
    """Whether a Redis server at ``url`` answers PING (within half a second): a test of the
    shared server on 6379 skips when it does not."""
    client = aioredis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        return bool(await client.ping())
    except Exception:
        return False
    finally:
        await client.aclose()


def answers(url: str) -> bool:
    """Whether the Redis at ``url`` (redis:// or rediss://) answers PING within half a second."""
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


class RedisServer:
    """A redis-server subprocess on a fixed port: no persistence, its own working directory.

    ``kill`` is SIGKILL (a crash); ``restart`` starts it again on the same port and directory, so
    a cluster node comes back with its ``nodes.conf`` (and, without persistence, no data)."""

    def __init__(
        self,
        port: int | None = None,
        workdir: Path | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.port = port if port is not None else free_port()
        self._own_dir = workdir is None
        self.workdir = (
            Path(tempfile.mkdtemp(prefix="kvserve-redis-")) if workdir is None else workdir
        )
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Start the server and return once it answers PING."""
        assert not self.running, "already running"
        exe = shutil.which("redis-server")
        assert exe is not None, "redis-server not installed"
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--daemonize", "no", "--dir", str(self.workdir)]
        args += ["--logfile", str(self.workdir / "redis.log"), *self.extra_args]
        self.proc = subprocess.Popen(
            [exe, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not answers(self.url):  # readiness poll, not a timing assumption
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} exited: {self._log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not come up")
            time.sleep(POLL_S)

    def kill(self) -> None:
        """SIGKILL, as a crash; waits until the process is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> None:
        """Kill if running, then start again on the same port and directory."""
        self.kill()
        self.start()

    def stop(self) -> None:
        """Kill and remove the working directory when this object made it."""
        self.kill()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _log_tail(self) -> str:
        log = self.workdir / "redis.log"
        return log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"


class RedisCluster:
    """Three (``masters``) cluster-enabled redis-servers joined with ``redis-cli --cluster create
    --cluster-replicas 0``: no replicas, no persistence. Servers run with
    ``cluster-require-full-coverage no`` (the masters left serve their slots when one is down) and
    a short ``cluster-node-timeout``. Each node has its own bus port (``cluster-port``) and
    directory (holding ``nodes.conf``) under one temporary directory."""

    def __init__(self, masters: int = 3, node_timeout_ms: int = 1000) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="kvserve-cluster-"))
        taken: list[int] = []
        self.nodes: list[RedisServer] = []
        for i in range(masters):
            port = free_port(taken)
            bus = free_port([*taken, port])
            taken += [port, bus]
            workdir = self.root / f"node{i}"
            workdir.mkdir()
            args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            args += ["--cluster-port", str(bus), "--cluster-node-timeout", str(node_timeout_ms)]
            args += ["--cluster-require-full-coverage", "no"]
            self.nodes.append(RedisServer(port, workdir, args))

    @property
    def url(self) -> str:
        """``redis+cluster://`` URL naming every node as a startup node (no query)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    def start(self) -> None:
        """Start the nodes, assign all slots, and return once every node reports
        ``cluster_state:ok`` and sees no failed node."""
        for node in self.nodes:
            node.start()
        cli = shutil.which("redis-cli")
        assert cli is not None, "redis-cli not installed"
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        done = subprocess.run(
            [cli, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout}{done.stderr}")
        self.wait_ok()

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Poll until every node answers ``cluster_state:ok`` and flags no node as failing."""
        deadline = time.monotonic() + timeout_s
        while not all(self._node_ok(n.port) for n in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("cluster did not reach cluster_state:ok")
            time.sleep(POLL_S * 5)

    def _node_ok(self, port: int) -> bool:
        client = redis.Redis(port=port, socket_connect_timeout=0.5, socket_timeout=0.5)
        try:
            info = client.execute_command("CLUSTER INFO")  # parsed by redis-py into a dict
            nodes = client.execute_command("CLUSTER NODES")  # {addr: {flags, connected, ...}}
        except redis.RedisError:
            return False
        finally:
            client.close()
        return (
            info.get("cluster_state") == "ok"
            and len(nodes) == len(self.nodes)
            and all(n["connected"] and "fail" not in n["flags"] for n in nodes.values())
        )

    def kill(self, i: int) -> None:
        """SIGKILL node ``i`` (a master crash)."""
        self.nodes[i].kill()

    def restart(self, i: int) -> None:
        """Start node ``i`` again on its port with its ``nodes.conf`` (it rejoins, empty) and wait
        until the cluster is whole again."""
        self.nodes[i].restart()
        self.wait_ok()

    def node_of_key(self, key: str) -> int:
        """Index of the node that owns ``key``'s slot."""
        return self.nodes_of_keys([key])[0]

    def nodes_of_keys(self, keys: Sequence[str]) -> list[int]:
        """Index of the node owning each key's slot (one CLUSTER SLOTS on a live node)."""
        live = next(n for n in self.nodes if n.running)
        client = redis.Redis(port=live.port, socket_timeout=2)
        try:
            ranges = client.execute_command("CLUSTER SLOTS")
        finally:
            client.close()
        owner: dict[int, int] = {}
        for first, last, master, *_ in ranges:
            for slot in range(int(first), int(last) + 1):
                owner[slot] = self.ports.index(int(master[1]))
        return [owner[key_slot(k.encode())] for k in keys]

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A started redis-server on a free port, killed after the test."""
    if not redis_binaries_present():
        pytest.skip("redis-server not installed")
    server = RedisServer(workdir=tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """A three-master Redis Cluster, started once per session and stopped at its end."""
    if not redis_binaries_present():
        pytest.skip("redis-server / redis-cli not installed")
    cluster = RedisCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
