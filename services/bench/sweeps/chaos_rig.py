"""Rig: what the faults of `kvserve bench chaos` act on."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.services.bench.sweeps.chaos_load import Load
from kvserve.services.bench.sweeps.chaos_redis import RedisNode
from kvserve.services.bench.sweeps.chaos_supervisor import Supervisor
from kvserve.services.bench.sweeps.chaos_target import Target


@dataclass
class Rig:
    """What the faults act on: the Redis servers (the store, and the bus in a fleet) behind
    their proxies, the target, the load, the supervisor of the target's processes."""

    redis: list[RedisNode]
    target: Target
    load: Load
    supervisor: Supervisor

    @property
    def store(self) -> RedisNode:
        return next(n for n in self.redis if n.role == "store")

    @property
    def bus(self) -> RedisNode | None:
        return next((n for n in self.redis if n.role == "bus"), None)
