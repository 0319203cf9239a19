"""`kvserve stack`'s command lines for its processes in both topologies (the gateway gets the
request timeout and the routing policy, the workers the store and its format and share the
cores) and the one-line errors for bad values."""

from __future__ import annotations

import os
import sys

import pytest
from kvserve.services import stack
from kvserve.services.cli import build_parser
from kvserve.services.gateway.router import POLICIES

from tests.services.bench.cli_output import one_line_error

REDIS = "redis://127.0.0.1:6379/3"


def _commands(*flags: str) -> list[list[str]]:
    argv = ["stack", "--redis", REDIS, "--model", "m.gguf", *flags]
    return stack.commands(build_parser(argv).parse_args(argv))


def _args(command: list[str], subcommand: str) -> list[str]:
    """The command line after `python -P -m kvserve.services.cli SUBCOMMAND`."""
    assert command[:4] == [sys.executable, "-P", "-m", "kvserve.services.cli"]
    assert command[4] == subcommand
    return command[5:]


def test_the_gateway_gets_the_request_timeout() -> None:
    argv = ["stack", "--redis", "redis://127.0.0.1:6379/3", "--request-timeout", "1234"]
    args = build_parser(argv).parse_args(argv)
    gateway, *workers = stack.commands(args)
    assert gateway[gateway.index("gateway") + 1 :][:2] == ["--bus", "redis://127.0.0.1:6379/3"]
    assert gateway[gateway.index("--request-timeout") + 1] == "1234.0"
    assert len(workers) == 3 and all("--request-timeout" not in w for w in workers)
    default = stack.commands(build_parser(argv[:3]).parse_args(argv[:3]))[0]
    assert default[default.index("--request-timeout") + 1] == "600.0"


def test_workers_share_the_cores() -> None:
    argv = ["stack", "--redis", "redis://127.0.0.1:6379/3", "--prefill", "2", "--decode", "1"]
    _, *workers = stack.commands(build_parser(argv).parse_args(argv))
    cores = os.cpu_count() or 1
    assert [w[w.index("--threads") + 1] for w in workers] == [str(max(1, cores // 3))] * 3
    argv += ["--threads-per-worker", "3"]
    _, *workers = stack.commands(build_parser(argv).parse_args(argv))
    assert [w[w.index("--threads") + 1] for w in workers] == ["3"] * 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["stack", "--redis", "redis://h:1/0", "--request-timeout", "0"], "--request-timeout"),
        (["stack", "--redis", "redis://h:1/0", "--grace", "-1"], "--grace"),
        (["stack", "--redis", "redis://h:1/0", "--threads-per-worker", "0"],
         "--threads-per-worker"),
        (["stack", "--redis", "redis://h:1/0", "--workers", "2", "--prefill", "2"],
         "--prefill/--decode"),
        (["stack", "--redis", "redis://h:1/0", "--workers", "1", "--decode", "1"],
         "--prefill/--decode"),
        (["stack", "--redis", "redis://h:1/0", "--workers", "-1"], "--workers"),
        (["stack", "--redis", "redis://h:1/0", "--prefill", "0"], "--prefill"),
        (["stack", "--redis", "redis://h:1/0", "--worker-store", "local"], "--worker-store"),
        (["stack", "--redis", "redis://h:1/0", "--store-redis", "memory://"], "--store-redis"),
        (["stack", "--redis", "redis://h:1/0", "--workers", "2", "--worker-store", "local",
          "--store-redis", "redis://h:2/0"], "--store-redis"),
        (["serve", "--threads", "0"], "--threads"),
        (["serve", "--weights", "file", "--dtype", "bfloat16"], "weights 'file'"),
        (["prefill", "--bus", "redis://h:1/0", "--store", "redis://h:1/0", "--threads", "0"],
         "--threads"),
    ],
)  # fmt: skip
def test_bad_values_one_line_error(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert message in one_line_error(argv, capsys)


def test_aggregated_workers_on_the_shared_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stack.os, "cpu_count", lambda: 8)
    gateway, *workers = _commands("--workers", "2")
    assert _args(gateway, "gateway") == [
        "--bus", REDIS, "--host", "127.0.0.1", "--port", "8000", "--model", "m.gguf",
        "--request-timeout", "600.0", "--routing", "cache-aware",
    ]  # fmt: skip
    assert [_args(w, "worker") for w in workers] == [
        ["--bus", REDIS, "--store", REDIS, "--store-format", "auto", "--model", "m.gguf",
         "--metrics-port", str(9100 + i), "--threads", "4", "--name", f"worker-{i}"]
        for i in range(2)
    ]  # fmt: skip


@pytest.mark.parametrize(
    "topology", [[], ["--workers", "2"], ["--workers", "2", "--simulate", "gpu"]]
)
def test_the_store_on_a_redis_of_its_own(topology: list[str]) -> None:
    """--store-redis: every worker's --store (the simulated fleet's too), the bus stays on --redis
    and the gateway, which needs no store, gets the bus alone."""
    store = "redis://127.0.0.1:6380/0"
    gateway, *workers = _commands(*topology, "--store-redis", store)
    assert gateway[gateway.index("--bus") + 1] == REDIS and store not in gateway
    assert workers and all(w[w.index("--bus") + 1] == REDIS for w in workers)
    assert all(w[w.index("--store") + 1] == store for w in workers)
    argv = ["stack", "--redis", REDIS, *topology, "--store-redis", store]
    assert stack.banner(build_parser(argv).parse_args(argv)).endswith(
        f"bus {REDIS}, store {store}; Ctrl-C stops"
    )


def test_aggregated_workers_on_local_stores() -> None:
    _, *workers = _commands("--workers", "2", "--worker-store", "local", "--metrics-port", "0")
    assert len(workers) == 2
    for i, w in enumerate(workers):
        args = _args(w, "worker")
        assert args[args.index("--bus") + 1] == REDIS
        assert args[args.index("--store") + 1] == "memory://"
        assert args[args.index("--metrics-port") + 1] == "0"
        assert args[-2:] == ["--name", f"worker-{i}"]


def test_disaggregated_by_default() -> None:
    _, *workers = _commands()
    assert [w[4] for w in workers] == ["prefill", "prefill", "decode"]
    names = ["worker-prefill-0", "worker-prefill-1", "worker-decode-0"]
    assert [w[-2:] for w in workers] == [["--name", n] for n in names]  # kept on a restart
    args = build_parser(["stack", "--redis", REDIS]).parse_args(["stack", "--redis", REDIS])
    assert stack.process_names(args) == ["gateway", *names]
    assert [w[w.index("--metrics-port") + 1] for w in workers] == ["9100", "9101", "9102"]
    assert all(w[w.index("--store") + 1] == REDIS for w in workers)
    _, *workers = _commands("--prefill", "1", "--decode", "2")
    assert [w[4] for w in workers] == ["prefill", "decode", "decode"]


@pytest.mark.parametrize("topology", [[], ["--workers", "3"]])
def test_the_gateway_gets_the_routing(topology: list[str]) -> None:
    gateway = _commands(*topology)[0]
    assert gateway[gateway.index("--routing") + 1] == "cache-aware"
    for routing in POLICIES:
        gateway, *workers = _commands(*topology, "--routing", routing)
        assert gateway[gateway.index("--routing") + 1] == routing
        assert all("--routing" not in w for w in workers)


@pytest.mark.parametrize("topology", [[], ["--workers", "3"]])
def test_every_worker_gets_the_store_format(topology: list[str]) -> None:
    gateway, *workers = _commands(*topology, "--store-format", "int8")
    assert len(workers) == 3 and "--store-format" not in gateway
    assert [w[w.index("--store-format") + 1] for w in workers] == ["int8"] * 3


@pytest.mark.parametrize("topology", [[], ["--workers", "3"]])
@pytest.mark.parametrize(("flag", "value"), [("--kv-dtype", "int8"), ("--kv-populate", "eager")])
def test_every_worker_gets_the_kv_cache_options(topology: list[str], flag: str, value: str) -> None:
    gateway, *workers = _commands(*topology, flag, value)
    assert flag not in gateway
    assert [w[w.index(flag) + 1] for w in workers] == [value] * 3
    assert all(flag not in w for w in _commands(*topology))  # the workers' default


def test_aggregated_workers_share_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stack.os, "cpu_count", lambda: 8)
    for count, threads in (("1", "8"), ("3", "2"), ("16", "1")):
        _, *workers = _commands("--workers", count)
        assert [w[w.index("--threads") + 1] for w in workers] == [threads] * int(count)
    _, *workers = _commands("--workers", "3", "--threads-per-worker", "5")
    assert [w[w.index("--threads") + 1] for w in workers] == ["5"] * 3


def test_the_banner_names_the_topology() -> None:
    argv = ["stack", "--redis", REDIS, "--workers", "2", "--worker-store", "local"]
    line = stack.banner(build_parser(argv).parse_args(argv))
    assert line.startswith("kvserve stack (aggregated): gateway on http://127.0.0.1:8000/v1")
    assert "(cache-aware routing), 2 worker(s) on a local store" in line
    argv = ["stack", "--redis", REDIS, "--routing", "least-load"]
    line = stack.banner(build_parser(argv).parse_args(argv))
    assert line.startswith("kvserve stack (disaggregated): gateway on")
    assert "(least-load routing), 2 prefill, 1 decode worker(s)" in line


def test_threads_reach_the_engine_config() -> None:
    from kvserve.services.engine_options import engine_config

    for argv in (["serve", "--threads", "2"], ["decode", "--bus", "redis://h:1/0",
                 "--store", "redis://h:1/0", "--threads", "2"]):  # fmt: skip
        assert engine_config(build_parser(argv).parse_args(argv)).num_threads == 2
    argv = ["serve"]
    assert engine_config(build_parser(argv).parse_args(argv)).num_threads is None
    assert engine_config(build_parser(argv).parse_args(argv)).weights == "auto"
    argv = ["serve", "--weights", "fp32"]
    assert engine_config(build_parser(argv).parse_args(argv)).weights == "fp32"


def test_the_gateway_gets_the_pd_threshold_when_one_is_set() -> None:
    assert "--pd-threshold" not in _commands()[0]
    gateway, *workers = _commands("--pd-threshold", "256")
    assert gateway[gateway.index("--pd-threshold") + 1] == "256"
    assert all("--pd-threshold" not in w for w in workers)


def test_simulated_workers_are_one_sim_fleet_named_as_real_ones() -> None:
    _, fleet = _commands("--workers", "3", "--simulate", "gpu", "--time-scale", "4")
    args = _args(fleet, "sim-fleet")
    assert args[args.index("--profile") + 1] == "gpu"
    assert args[args.index("--workers") + 1] == "3"
    assert args[args.index("--time-scale") + 1] == "4.0"
    assert args[args.index("--name-prefix") + 1] == "worker"
    argv = ["stack", "--redis", REDIS, "--workers", "3", "--simulate", "gpu"]
    assert stack.process_names(build_parser(argv).parse_args(argv)) == ["gateway", "sim-fleet"]
    _, fleet = _commands("--prefill", "2", "--decode", "1", "--simulate", "gpu")
    args = _args(fleet, "sim-fleet")
    assert args[args.index("--prefill") + 1] == "2" and args[args.index("--decode") + 1] == "1"


def test_take_over_and_fault_flags_reach_the_workers() -> None:
    gateway, *workers = _commands(
        "--workers", "1", "--claim-idle", "3", "--quarantine-after", "3",
        "--enable-fault-injection",
    )  # fmt: skip
    assert "--enable-fault-injection" in gateway
    args = _args(workers[0], "worker")
    assert args[args.index("--claim-idle") + 1] == "3.0"
    assert args[args.index("--quarantine-after") + 1] == "3"
    assert "--enable-fault-injection" in args


def test_engine_failure_and_host_tier_flags_reach_the_engine_config() -> None:
    from kvserve.services.engine_options import engine_config

    argv = ["worker", "--bus", "redis://h:1/0", "--store", "redis://h:1/0", "--host-tier-mb",
            "64", "--quarantine-after", "3", "--enable-fault-injection"]  # fmt: skip
    config = engine_config(build_parser(argv).parse_args(argv))
    assert config.store.host_tier_bytes == 64 << 20
    assert (config.faults.quarantine_after, config.faults.injection) == (3, True)
    argv = ["serve"]
    config = engine_config(build_parser(argv).parse_args(argv))
    assert config.store.host_tier_bytes == 512 << 20
    assert (config.faults.quarantine_after, config.faults.injection) == (2, False)


@pytest.mark.parametrize("topology", [[], ["--workers", "3"]])
def test_every_worker_gets_no_async_scheduling(topology: list[str]) -> None:
    gateway, *workers = _commands(*topology, "--no-async-scheduling")
    assert "--no-async-scheduling" not in gateway
    assert all("--no-async-scheduling" in w for w in workers)
    for w in workers:
        assert not build_parser(w[4:]).parse_args(w[4:]).async_scheduling
    assert all("async-scheduling" not in " ".join(w) for w in _commands(*topology))  # default on
