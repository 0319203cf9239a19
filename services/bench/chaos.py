"""`kvserve bench chaos`: what kvserve survives. A steady load against a real server while
faults are injected one at a time, and per fault what became of every request.

Targets (`--targets`): `serve` (`kvserve serve --store redis://...`), `fleet` (`kvserve
gateway` + 2 `kvserve worker`s on the Redis bus and shared store) and `disagg` (`kvserve
gateway` + 2 `kvserve prefill` + 2 `kvserve decode`), the last two started here one process
each so that one can be killed. Redis is a redis-server of the tool's own behind a FaultProxy
(tcp_proxy.py): every byte between kvserve and Redis crosses it. Stores use the native format,
so that a greedy answer is the same whichever tier served its prefix.

Load: `--rate` requests/s, cycling through streaming and non-streaming, greedy and sampled
(temperature 1.0) /v1/completions of a shared system prompt + one of QUESTIONS, `--max-tokens`
each. Before any fault, every question's greedy answer is taken once (the fault-free reference).

Faults (`--faults`), each: `--calm-s` of load, the fault for `--fault-s`, `--recover-s` of load,
then the load pauses until the server is idle, and blocks and RSS are read:
- redis-kill: SIGKILL, restarted empty after the fault window; redis-pause: SIGSTOP / SIGCONT;
  redis-oom: maxmemory at what is used now with `noeviction`, restored after;
- net-delay (50 ms each way per chunk), net-cut (every connection closed at once),
  net-blackhole (nothing forwarded; stalled connections closed at the end);
- worker-kill (fleet), prefill-kill, decode-kill (disagg): SIGKILL worker-1 / prefill-1 /
  decode-1, restarted after the window; gateway-term (SIGTERM the gateway or the serve
  process: it drains and exits; restarted after the window);
- client-disconnect (8 streams dropped after their first chunk), burst (4 x --max-queue requests
  at once).

`--soak-min N` first runs the load without faults for N minutes; after each minute the load
pauses until the server is idle and it reads the KV blocks in use, the servers' RSS, their open
file descriptors, Redis's connected clients and the error lines logged; it reports them per
minute and their least-squares slopes (`--faults none`: the soak alone).

A request's outcome: `ok` (finished; greedy ones compared with the reference: `wrong` if the
text differs), `http_NNN` (an error status; Retry-After noted), `stream_error` (an error event),
`refused` (no server listening), `disconnected` (the client dropped it on purpose), `lost` (no
terminal answer within --timeout, or a stream cut without one). Per fault, for requests sent
from its start to the end of its recovery: sent, ok, wrong, lost, failed by kind, p99 TTFT
against the calm period's, seconds until the store took writes again after Redis came back, KV
blocks in use when idle after the fault against before the run (0 leaked), RSS growth.
Prints a table per target; the last line printed is one JSON object; `--out DIR` keeps the
servers' logs, requests.jsonl and chaos.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvserve.services.bench import arms
from kvserve.services.bench.tcp_proxy import ThreadedFaultProxy
from kvserve.services.cli_support import CliError

TARGETS = ("serve", "fleet", "disagg")
REDIS_FAULTS = ("redis-kill", "redis-pause", "redis-oom")
NET_FAULTS = ("net-delay", "net-cut", "net-blackhole")
KILLS = {"worker-kill": "worker-1", "prefill-kill": "prefill-1", "decode-kill": "decode-1"}
FAULTS = (*REDIS_FAULTS, *NET_FAULTS, *KILLS, "gateway-term", "client-disconnect", "burst")
SYSTEM = (
    "You are the help desk of a city library. Answer in one or two short sentences, politely, "
    "about opening hours, borrowing rules, study rooms, the catalogue and library cards. "
) * 3
QUESTIONS = [f"Question {i}: may I borrow {i + 2} books for {i + 1} weeks?" for i in range(8)]
KINDS = ("stream-greedy", "plain-greedy", "stream-sampled", "plain-sampled")
BLOCK_KEYS = "kvserve:v1:blk:*"  # the Redis store's block keys (default namespace)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--targets", default=",".join(TARGETS), help=f"comma list of {TARGETS}")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma list of {FAULTS}, or none")
    p.add_argument("--rate", type=float, default=1.0, help="requests per second")
    p.add_argument("--calm-s", type=float, default=15.0)
    p.add_argument("--fault-s", type=float, default=10.0)
    p.add_argument("--recover-s", type=float, default=15.0)
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--max-queue", type=int, default=8, help="the gateway's bound (burst fault)")
    p.add_argument("--timeout", type=float, default=120.0, help="a request's, seconds")
    p.add_argument("--model", default=None, help="GGUF (default: the default model)")
    p.add_argument("--out", type=Path, default=Path("bench-chaos"))
    p.add_argument("--soak-min", type=int, default=0,
                   help="first a soak: this many minutes of load without faults")  # fmt: skip


def _check(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    targets = [t for t in args.targets.split(",") if t]
    faults = [f for f in args.faults.split(",") if f and f != "none"]
    if not targets or set(targets) - set(TARGETS):
        raise CliError(f"--targets must be a comma list of {', '.join(TARGETS)}")
    if (not faults and args.faults != "none") or set(faults) - set(FAULTS):
        raise CliError(f"--faults must be a comma list of {', '.join(FAULTS)}")
    if min(args.rate, args.fault_s, args.recover_s, args.timeout) <= 0 or args.calm_s < 0:
        raise CliError("--rate, --fault-s, --recover-s and --timeout must be > 0, --calm-s >= 0")
    if args.soak_min < 0:
        raise CliError("--soak-min must be >= 0")
    if args.max_tokens < 1 or args.max_queue < 1:
        raise CliError("--max-tokens and --max-queue must be >= 1")
    return targets, faults


# ---- processes ---------------------------------------------------------------------------------


@dataclass
class Proc:
    """One server process in its own session, restartable with the same command."""

    name: str
    cmd: list[str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(
                self.cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip

    def send(self, sig: int) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.killpg(self.popen.pid, sig)

    def wait(self, timeout: float) -> None:
        if self.popen is None:
            return
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.send(signal.SIGKILL)
            self.popen.wait()

    def rss_mb(self) -> float:
        if self.popen is None or self.popen.poll() is not None:
            return 0.0
        try:
            for line in Path(f"/proc/{self.popen.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0


class Target:
    """A kvserve topology on the proxied Redis: one `serve`, or a gateway and 2 workers."""

    def __init__(self, kind: str, redis_url: str, args: argparse.Namespace, out: Path) -> None:
        self.kind = kind
        self.port = arms.free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        exe = arms._kvserve_exe()
        model = ["--model", str(args.model)] if args.model else []
        engine = [*model, "--num-blocks", "512", "--log-level", "warning"]
        http = ["--port", str(self.port), "--max-queue", str(args.max_queue)]
        if kind == "serve":
            cmd = [exe, "serve", *http, *engine, "--store", redis_url, "--store-format", "native",
                   "--threads", "2"]  # fmt: skip
            self.procs = {"gateway": Proc("gateway", cmd, out / "serve.log")}
            self.workers = 0
        else:
            gw = [exe, "gateway", *http, *model, "--bus", redis_url, "--log-level", "warning"]
            self.procs = {"gateway": Proc("gateway", gw, out / "gateway.log")}
            roles = ["worker"] * 2 if kind == "fleet" else ["prefill"] * 2 + ["decode"] * 2
            for i, role in enumerate(roles):
                name = f"{role}-{i % 2}"
                cmd = [exe, role, "--bus", redis_url, "--store", redis_url, *engine,
                       "--store-format", "native", "--name", name, "--threads", "1",
                       "--metrics-port", "0", "--claim-idle", "3",
                       "--drain-timeout", "5"]  # fmt: skip
                self.procs[name] = Proc(name, cmd, out / f"{name}.log")
            self.workers = len(roles)

    def start(self) -> None:
        for p in self.procs.values():
            p.start()
        self.wait_ready()

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            if time.monotonic() > deadline:
                raise CliError(f"{self.kind}: not ready after {timeout:.0f} s (logs: --out)")
            time.sleep(0.5)

    def ready(self) -> bool:
        return arms.server_ready(self.base_url, self.base_url + "/ready", self.workers)

    def stats(self) -> dict[str, Any]:
        return arms.gateway_stats(self.base_url)

    def rss_mb(self) -> float:
        return sum(p.rss_mb() for p in self.procs.values())

    def stop(self) -> None:
        for p in self.procs.values():
            p.send(signal.SIGTERM)
        for p in self.procs.values():
            p.wait(30)


# ---- the load ----------------------------------------------------------------------------------


@dataclass
class Outcome:
    index: int
    kind: str
    question: int
    sent_s: float  # seconds after the run's start
    phase: str = ""  # "calm:FAULT" or FAULT (from its start to the end of its recovery)
    result: str = "lost"
    status: int | None = None
    retry_after: bool = False
    ttft_s: float | None = None
    text: str = ""


class Load:
    """Sends requests at a steady rate (while `running`) and records their outcomes."""

    def __init__(self, target: Target, args: argparse.Namespace, http: Any) -> None:
        self.target, self.args, self.http = target, args, http
        self.outcomes: list[Outcome] = []
        self.reference: dict[int, str] = {}
        self.phase = "warm-up"
        self.running = False
        self.t0 = time.monotonic()
        self._tasks: set[asyncio.Task[None]] = set()

    def body(self, kind: str, question: int, stream: bool) -> dict[str, Any]:
        return {
            "prompt": SYSTEM + QUESTIONS[question],
            "max_tokens": self.args.max_tokens,
            "temperature": 0.0 if kind.endswith("greedy") else 1.0,
            "ignore_eos": True,
            "stream": stream,
        }

    async def one(self, kind: str, question: int, drop_after_first: bool = False) -> Outcome:
        o = Outcome(len(self.outcomes), kind, question, time.monotonic() - self.t0, self.phase)
        self.outcomes.append(o)
        stream = kind.startswith("stream")
        t = time.monotonic()
        try:
            async with asyncio.timeout(self.args.timeout):
                async with self.http.post(
                    self.target.base_url + "/v1/completions", json=self.body(kind, question, stream)
                ) as resp:
                    o.status = resp.status
                    if resp.status != 200:
                        o.result = f"http_{resp.status}"
                        o.retry_after = "Retry-After" in resp.headers
                        return o
                    if not stream:
                        data = await resp.json()
                        o.ttft_s = time.monotonic() - t
                        o.text = data["choices"][0]["text"]
                        o.result = "ok" if data["choices"][0].get("finish_reason") else "lost"
                        return o
                    await self._stream(o, resp, t, drop_after_first)
        except TimeoutError:
            o.result = "lost"
        except OSError as e:  # aiohttp's connection errors are OSErrors
            refused = isinstance(e, ConnectionRefusedError) or "Cannot connect" in str(e)
            o.result = "refused" if refused and o.status is None else "lost"
        if o.result == "ok" and kind.endswith("greedy") and question in self.reference:
            o.result = "ok" if o.text == self.reference[question] else "wrong"
        return o

    async def _stream(self, o: Outcome, resp: Any, t: float, drop: bool) -> None:
        parts, finished = [], False
        async for raw in resp.content:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                o.result = "stream_error"
                return
            for c in chunk.get("choices") or []:
                if o.ttft_s is None:
                    o.ttft_s = time.monotonic() - t
                parts.append(c.get("text") or "")
                finished = finished or bool(c.get("finish_reason"))
            if drop and o.ttft_s is not None:
                o.result = "disconnected"
                return
        o.text = "".join(parts)
        o.result = "ok" if finished else "lost"

    async def references(self) -> None:
        """Every question's greedy answer, fault-free (also warms the caches)."""
        for q in range(len(QUESTIONS)):
            o = await self.one("plain-greedy", q)
            if o.result != "ok":
                raise CliError(f"{self.target.kind}: a fault-free request failed: {o.result}")
            self.reference[q] = o.text
        self.outcomes.clear()

    async def run(self) -> None:
        """Send at the rate while `running` (a task per request)."""
        i = 0
        while True:
            if self.running:
                task = asyncio.create_task(self._send(i))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                i += 1
            await asyncio.sleep(1.0 / self.args.rate)

    async def _send(self, i: int) -> None:
        await self.one(KINDS[i % len(KINDS)], i % len(QUESTIONS))

    async def drain(self) -> None:
        """Stop sending and wait for every request in flight to end."""
        self.running = False
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


# ---- faults ------------------------------------------------------------------------------------


@dataclass
class Rig:
    """What the faults act on: the Redis, the proxy in front of it, the target."""

    redis: arms.OwnRedis
    proxy: ThreadedFaultProxy
    target: Target
    load: Load

    def redis_client(self) -> Any:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        return redis.Redis(port=self.redis.port, socket_timeout=5, retry=Retry(NoBackoff(), 0))

    def stored_blocks(self) -> int:
        """Store blocks in Redis now (asked directly, not through the proxy)."""
        r = self.redis_client()
        try:
            return sum(1 for _ in r.scan_iter(match=BLOCK_KEYS, count=1000))
        except Exception:  # Redis down or paused: none to be seen
            return 0
        finally:
            r.close()


async def _redis_kill(rig: Rig, secs: float) -> Callable[[], None]:
    assert rig.redis.proc is not None
    rig.redis.proc.send_signal(signal.SIGKILL)
    rig.redis.proc.wait()
    await asyncio.sleep(secs)

    def restart() -> None:  # empty, on the same port
        rig.redis.stop()
        rig.redis.start()

    return restart


async def _redis_pause(rig: Rig, secs: float) -> Callable[[], None]:
    assert rig.redis.proc is not None
    rig.redis.proc.send_signal(signal.SIGSTOP)
    await asyncio.sleep(secs)
    proc = rig.redis.proc
    return lambda: proc.send_signal(signal.SIGCONT)


async def _redis_oom(rig: Rig, secs: float) -> Callable[[], None]:
    r = rig.redis_client()
    used = int(r.info("memory")["used_memory"])
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", str(used + (1 << 20)))
    await asyncio.sleep(secs)

    def restore() -> None:
        r.config_set("maxmemory", rig.redis.maxmemory)
        r.config_set("maxmemory-policy", "allkeys-lru")
        r.close()

    return restore


async def _net(rig: Rig, fault: str, secs: float) -> Callable[[], None]:
    p = rig.proxy
    if fault == "net-delay":
        p.set_delay(0.05)
    elif fault == "net-cut":
        p.cut()
    else:
        p.set_blackhole(True)
    await asyncio.sleep(secs)

    def heal() -> None:
        p.set_delay(0.0)
        p.set_blackhole(False)

    return heal


async def _kill_restart(rig: Rig, name: str, sig: int, secs: float) -> Callable[[], None]:
    proc = rig.target.procs[name]
    proc.send(sig)
    await asyncio.to_thread(proc.wait, 60)
    await asyncio.sleep(secs)
    return proc.start


async def _client_disconnect(rig: Rig, secs: float) -> Callable[[], None]:
    drops = [rig.load.one("stream-greedy", q, drop_after_first=True) for q in range(8)]
    await asyncio.gather(*drops, asyncio.sleep(secs))
    return lambda: None


async def _burst(rig: Rig, secs: float) -> Callable[[], None]:
    n = 4 * rig.load.args.max_queue
    burst = [rig.load.one("plain-greedy", q % len(QUESTIONS)) for q in range(n)]
    await asyncio.gather(asyncio.gather(*burst), asyncio.sleep(secs))
    return lambda: None


async def inject(rig: Rig, fault: str, secs: float) -> Callable[[], None]:
    """Start the fault and hold it `secs`; returns what ends it."""
    if fault == "redis-kill":
        return await _redis_kill(rig, secs)
    if fault == "redis-pause":
        return await _redis_pause(rig, secs)
    if fault == "redis-oom":
        return await _redis_oom(rig, secs)
    if fault in NET_FAULTS:
        return await _net(rig, fault, secs)
    if fault in KILLS:
        return await _kill_restart(rig, KILLS[fault], signal.SIGKILL, secs)
    if fault == "gateway-term":
        return await _kill_restart(rig, "gateway", signal.SIGTERM, secs)
    if fault == "client-disconnect":
        return await _client_disconnect(rig, secs)
    return await _burst(rig, secs)


# ---- one target --------------------------------------------------------------------------------


@dataclass
class FaultReport:
    fault: str
    sent: int = 0
    ok: int = 0
    wrong: int = 0
    lost: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    failed_with_retry_after: int = 0
    p99_ttft_s: float | None = None
    p99_ttft_calm_s: float | None = None
    store_back_s: float | None = None  # Redis faults: until the store took writes again
    used_blocks_before: int = 0
    used_blocks_after: int = 0
    rss_growth_mb: float = 0.0


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(0.99 * len(s)))]


async def _idle(target: Target, timeout: float = 120.0) -> dict[str, Any]:
    """The server's stats once nothing runs or waits there (or after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await asyncio.to_thread(target.stats)
        t = stats.get("totals") or {}
        if stats and not t.get("num_requests_running") and not t.get("num_requests_waiting"):
            return stats
        if time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.5)


async def _store_back(rig: Rig, since: int, timeout: float = 60.0) -> float | None:
    """Seconds until Redis holds more store blocks than `since`, its count when the fault
    began (0 for a Redis that restarted empty); None: not within `timeout`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if await asyncio.to_thread(rig.stored_blocks) > since:
            return time.monotonic() - t0
        await asyncio.sleep(0.25)
    return None


async def run_fault(
    rig: Rig, fault: str, args: argparse.Namespace, base: dict[str, Any]
) -> FaultReport:
    load, target = rig.load, rig.target
    rep = FaultReport(fault, used_blocks_before=int(base["totals"].get("num_used_blocks", 0)))
    rss0 = target.rss_mb()
    load.phase, load.running = f"calm:{fault}", True
    await asyncio.sleep(args.calm_s)
    load.phase = fault
    stored = 0 if fault == "redis-kill" else await asyncio.to_thread(rig.stored_blocks)
    end = await inject(rig, fault, args.fault_s)
    await asyncio.to_thread(end)
    back = None
    if fault in REDIS_FAULTS + NET_FAULTS:
        back = asyncio.create_task(_store_back(rig, stored))
    if fault in KILLS or fault == "gateway-term":
        await asyncio.to_thread(target.wait_ready)
    await asyncio.sleep(args.recover_s)
    await load.drain()
    rep.store_back_s = await back if back is not None else None
    after = await _idle(target)
    rep.used_blocks_after = int((after.get("totals") or {}).get("num_used_blocks", -1))
    rep.rss_growth_mb = target.rss_mb() - rss0
    mine = [o for o in load.outcomes if o.phase == fault]
    calm = [o for o in load.outcomes if o.phase == f"calm:{fault}"]
    counts = Counter(o.result for o in mine)
    rep.sent, rep.ok, rep.wrong, rep.lost = len(mine), counts["ok"], counts["wrong"], counts["lost"]
    rep.failed = {k: n for k, n in counts.items() if k not in ("ok", "wrong", "lost")}
    rep.failed_with_retry_after = sum(o.retry_after for o in mine)
    rep.p99_ttft_s = _p99([o.ttft_s for o in mine if o.ttft_s is not None])
    rep.p99_ttft_calm_s = _p99([o.ttft_s for o in calm if o.ttft_s is not None])
    return rep


async def run_target(kind: str, faults: list[str], args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    out = args.out / kind
    out.mkdir(parents=True, exist_ok=True)
    redis_server = arms.OwnRedis(arms.free_port(), "2gb", out / "redis.log")
    redis_server.start()
    proxy = ThreadedFaultProxy("127.0.0.1", redis_server.port)
    proxy.start()
    target = Target(kind, f"redis://127.0.0.1:{proxy.port}/0", args, out)
    reports: list[FaultReport] = []
    try:
        await asyncio.to_thread(target.start)
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            load = Load(target, args, http)
            await load.references()
            base = await _idle(target)
            rig = Rig(redis_server, proxy, target, load)
            sender = asyncio.create_task(load.run())
            try:
                if args.soak_min:
                    soak = await run_soak(rig, args)
                for fault in faults:
                    if fault in KILLS and KILLS[fault] not in target.procs:
                        continue  # no such process in this topology
                    print(f"[{kind}] {fault} ...", flush=True)
                    reports.append(await run_fault(rig, fault, args, base))
                    print(f"[{kind}] {fault}: {asdict(reports[-1])}", flush=True)
            finally:
                sender.cancel()
            with (out / "requests.jsonl").open("w") as f:
                for o in load.outcomes:
                    f.write(json.dumps(asdict(o)) + "\n")
    finally:
        await asyncio.to_thread(target.stop)
        proxy.close()
        redis_server.stop()
    result: dict[str, Any] = {"target": kind, "faults": [asdict(r) for r in reports]}
    if args.soak_min:
        result["soak"] = soak
    return result


# ---- soak --------------------------------------------------------------------------------------


def _fds(procs: dict[str, Proc]) -> int:
    n = 0
    for p in procs.values():
        if p.popen is not None and p.popen.poll() is None:
            with contextlib.suppress(OSError):
                n += len(os.listdir(f"/proc/{p.popen.pid}/fd"))
    return n


def _errors_logged(procs: dict[str, Proc]) -> int:
    """Lines at level error (structlog JSON) or with a traceback in the servers' logs."""
    n = 0
    for p in procs.values():
        for line in p.log.read_text(errors="replace").splitlines():
            n += '"level": "error"' in line or line.startswith("Traceback")
    return n


def _slope(ys: list[float]) -> float:
    """Least-squares slope of ys against 0, 1, 2, ... (per minute)."""
    n = len(ys)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, sum(ys) / n
    return sum((x - mx) * (y - my) for x, y in enumerate(ys)) / sum((x - mx) ** 2 for x in range(n))


async def run_soak(rig: Rig, args: argparse.Namespace) -> dict[str, Any]:
    """The load without faults for --soak-min minutes; after each, the load pauses until the
    server is idle and the minute's figures are read: KV blocks in use, RSS, open file
    descriptors, Redis clients, error lines logged, requests and their outcomes, and the
    device cache's cached and evicted blocks (evicted blocks fill the bounded host tier, which
    RSS shows until it is full)."""
    load, target = rig.load, rig.target
    minutes: list[dict[str, Any]] = []
    for m in range(args.soak_min):
        load.phase, load.running = f"soak:{m}", True
        await asyncio.sleep(60)
        await load.drain()
        stats = await _idle(target)
        r = rig.redis_client()
        try:
            clients = int(r.info("clients")["connected_clients"])
        finally:
            r.close()
        outcomes = Counter(o.result for o in load.outcomes if o.phase == f"soak:{m}")
        totals = stats.get("totals") or {}
        row = {
            "minute": m + 1,
            "used_blocks": int(totals.get("num_used_blocks", -1)),
            "cached_blocks": int(totals.get("cached_blocks", -1)),
            "evicted_blocks": int(totals.get("evicted_blocks", -1)),
            "rss_mb": target.rss_mb(),
            "fds": _fds(target.procs),
            "redis_clients": clients,
            "errors_logged": _errors_logged(target.procs),
            "outcomes": dict(outcomes),
        }
        minutes.append(row)
        print(f"[{target.kind}] soak {json.dumps(row)}", flush=True)
    return {
        "minutes": minutes,
        "slopes_per_min": {
            k: _slope([float(row[k]) for row in minutes])
            for k in ("rss_mb", "fds", "redis_clients", "used_blocks")
        },
    }


def table(result: dict[str, Any]) -> str:
    head = (
        f"{'fault':<18} {'sent':>5} {'ok':>5} {'wrong':>5} {'lost':>5}  {'failed (kind: n)':<46}"
        f" {'p99 TTFT / calm s':>18} {'store back s':>12} {'blocks':>9} {'RSS MB':>7}"
    )
    lines = [f"target {result['target']}", head, "-" * len(head)]
    for r in result["faults"]:
        failed = ", ".join(f"{k}: {n}" for k, n in sorted(r["failed"].items())) or "-"
        if r["failed_with_retry_after"]:
            failed += f" ({r['failed_with_retry_after']} w/ Retry-After)"
        p99 = r["p99_ttft_s"]
        calm = r["p99_ttft_calm_s"]
        ttft = f"{p99:.2f} / {calm:.2f}" if p99 is not None and calm is not None else "-"
        back = f"{r['store_back_s']:.1f}" if r["store_back_s"] is not None else "-"
        blocks = f"{r['used_blocks_before']}->{r['used_blocks_after']}"
        lines.append(
            f"{r['fault']:<18} {r['sent']:>5} {r['ok']:>5} {r['wrong']:>5} {r['lost']:>5}  "
            f"{failed:<46} {ttft:>18} {back:>12} {blocks:>9} {r['rss_growth_mb']:>7.1f}"
        )
    return "\n".join(lines)


def soak_table(result: dict[str, Any]) -> str:
    soak = result.get("soak")
    if not soak:
        return ""
    keys = ("used_blocks", "cached_blocks", "evicted_blocks", "rss_mb", "fds", "redis_clients",
            "errors_logged")  # fmt: skip
    lines = [
        f"soak of {result['target']}: per minute, idle",
        "minute " + " ".join(f"{k:>14}" for k in keys) + "  outcomes",
    ]
    for row in soak["minutes"]:
        vals = " ".join(
            f"{row[k]:>14.1f}" if isinstance(row[k], float) else f"{row[k]:>14}" for k in keys
        )
        lines.append(f"{row['minute']:>6} {vals}  {row['outcomes']}")
    slopes = ", ".join(f"{k} {v:+.3f}/min" for k, v in soak["slopes_per_min"].items())
    lines.append(f"slopes: {slopes}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    targets, faults = _check(args)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for kind in targets:
        result = asyncio.run(run_target(kind, faults, args))
        print(soak_table(result) + "\n" + table(result), flush=True)
        results.append(result)
    (args.out / "chaos.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results))
    return 0
