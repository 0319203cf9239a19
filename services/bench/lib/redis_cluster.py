"""A throwaway Redis Cluster for tests and benchmarks: three (`masters`) cluster-enabled
`RedisServer`s joined by `redis-cli --cluster create`, on free loopback ports, no replicas, no
persistence. Readiness (`cluster_state:ok` on every node) is polled under a deadline."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import redis
from kvserve.services.bench.lib.process import StartError, free_port
from kvserve.services.bench.lib.redis_server import POLL_S, RedisServer
from redis.crc import key_slot


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
            raise StartError(f"redis-cli --cluster create failed: {done.stdout}{done.stderr}")
        self.wait_ok()

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Poll until every node answers ``cluster_state:ok`` and flags no node as failing."""
        deadline = time.monotonic() + timeout_s
        while not all(self._node_ok(n.port) for n in self.nodes):
            if time.monotonic() > deadline:
                raise StartError("cluster did not reach cluster_state:ok")
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
