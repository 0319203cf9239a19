"""The bad-message fault of `kvserve bench chaos`: garbage written straight into the bus, where
the gateway and the workers read it.

Into every stream a gateway or worker reads (the request streams, each worker's own
`kvserve:to:NAME`, `kvserve:cancel`, `kvserve:kv_events`, and every stream of the bus's
namespace there at that moment: the `kvserve:out:*` of the requests in flight among them, first,
while those are still running), one entry of each of GARBAGE: random bytes, a real message of
the stream's kind cut short, the same of another protocol version, the same with a field of the
wrong type, an entry without its `m` field, and (but into the token-event streams, of which
there are hundreds) an entry over the bus's bound on a message. Into the hashes
`kvserve:worker_info` and `kvserve:worker_stats`, the same values under fake worker names, each
registered as alive in `kvserve:workers` so that the gateway reads them; names and values are
removed when the fault ends.
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgpack
from kvserve.services.bench.sweeps.chaos_redis import PREFIX, stream_keys
from kvserve.shared.protocol import (
    Cancel,
    GenerateRequest,
    KVEvent,
    Message,
    TokenEvent,
    encode,
)
from kvserve.shared.sampling_params import SamplingParams

GARBAGE = ("random", "truncated", "version", "mistyped", "no_m", "oversized")
OVERSIZED_BYTES = 9 << 20  # past the bus's bound on a message (8 MiB)
FAKE = "chaos-garbage"  # the request id and worker names the garbage claims
HASHES = (f"{PREFIX}:worker_info", f"{PREFIX}:worker_stats")
WORKERS = f"{PREFIX}:workers"  # the registered workers (score: last heartbeat)
FAKE_WORKERS = [f"{FAKE}-{g}" for g in GARBAGE if g != "no_m"]  # a hash value has no fields


def real_message(stream: str) -> Message:
    """A valid message of the kind `stream` carries (what the garbage is made from)."""
    name = stream.removeprefix(f"{PREFIX}:")
    if name == "cancel":
        return Cancel(FAKE)
    if name.startswith("out:"):
        return TokenEvent(FAKE, seq=0, token_ids=[1])
    if name == "kv_events":
        return KVEvent(FAKE, "0", 0, "stored", "device", [bytes(16)])
    return GenerateRequest(FAKE, [1, 2, 3], SamplingParams(max_tokens=1))


def garbage(kind: str, real: bytes) -> dict[bytes, bytes]:
    """One stream entry of `kind` (GARBAGE), made from `real`, an encoded message."""
    if kind == "random":
        return {b"m": os.urandom(64)}
    if kind == "truncated":
        return {b"m": real[: len(real) // 2]}
    if kind == "no_m":
        return {b"x": real}
    if kind == "oversized":
        return {b"m": os.urandom(OVERSIZED_BYTES)}
    body = msgpack.unpackb(real, raw=False)
    if kind == "version":
        body["v"] = 99
    else:  # mistyped: the first text field (the request id, the worker) a number
        first = next(k for k, v in body.items() if isinstance(v, str) and k != "kind")
        body[first] = 12345
    return {b"m": msgpack.packb(body, use_bin_type=True)}


def target_streams(r: Any, kind: str, workers: list[str]) -> list[str]:
    """The streams the bus's readers read in a `kind` topology, and any other stream there."""
    named = [f"{PREFIX}:prefill", f"{PREFIX}:cancel", f"{PREFIX}:kv_events"]
    named += [f"{PREFIX}:decode"] if kind == "disagg" else []
    named += [f"{PREFIX}:to:{w}" for w in workers]
    # the token-event streams first: their requests may be over by the time the rest is written
    return sorted(set(named) | set(stream_keys(r)), key=lambda k: (":out:" not in k, k))


def inject_garbage(r: Any, kind: str, workers: list[str]) -> int:
    """Write the garbage (module docstring) with the client `r`; the entries written."""
    n = 0
    for stream in target_streams(r, kind, workers):
        real = encode(real_message(stream))
        pipe = r.pipeline(transaction=False)
        for g in GARBAGE:
            if g == "oversized" and stream.startswith(f"{PREFIX}:out:"):
                continue
            pipe.xadd(stream, garbage(g, real))
            n += 1
        pipe.execute()
    real = encode(GenerateRequest(FAKE, [1], SamplingParams(max_tokens=1)))
    for key in HASHES:
        for name in FAKE_WORKERS:
            r.hset(key, name, garbage(name.removeprefix(f"{FAKE}-"), real)[b"m"])
            n += 1
    r.zadd(WORKERS, dict.fromkeys(FAKE_WORKERS, time.time()))
    return n


def remove_garbage(r: Any) -> None:
    """The fake workers and their hash values (stream entries stay: their readers have moved
    past them, and a worker deletes a request it refused)."""
    r.zrem(WORKERS, *FAKE_WORKERS)
    for key in HASHES:
        r.hdel(key, *FAKE_WORKERS)
