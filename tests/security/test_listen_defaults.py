"""Every kvserve process that listens binds the loopback address unless told otherwise: the
HTTP API of `kvserve serve` and `kvserve gateway` (`--host`), `kvserve stack`'s gateway and
workers, the Prometheus endpoint of `kvserve worker` / `prefill` / `decode`
(`--metrics-host`), and the benchmark's servers (the HF shim, llama-server). Containers pass
0.0.0.0 explicitly (compose.yaml, ops/Dockerfile; tests/ops/test_compose.py checks them).

The defaults are read from the real argument parsers, parsed with no host flag; every option
of the `kvserve` command tree that names a host must default to loopback, and every option
that names a port must have its host option beside it. The gateway and a worker's metrics
endpoint are then started on their defaults and the addresses they bound are read back."""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvserve.services import stack
from kvserve.services.bench.lib import hf_shim
from kvserve.services.bench.lib.llama_cpp import llama_server_cmd
from kvserve.services.bench.lib.process import free_port
from kvserve.services.bench.main import BENCHMARKS
from kvserve.services.bench.main import load as load_benchmark
from kvserve.services.cli import SUBCOMMANDS, build_parser
from kvserve.services.gateway.main import check_gateway_arguments, start_gateway
from kvserve.services.gateway.schema import ModelInfo
from kvserve.services.workers.metrics import serve_worker_metrics
from kvserve.shared.bus.memory import InProcessBus
from kvserve.shared.model.tokenizer import KVTokenizer

LOOPBACK = "127.0.0.1"
BUS = "redis://127.0.0.1:6379/0"
# The minimal command line of each listening subcommand: its required flags, no host.
LISTENING = {
    "serve": ["serve"],
    "gateway": ["gateway", "--bus", BUS],
    "stack": ["stack", "--redis", BUS],
    "worker": ["worker", "--bus", BUS, "--store", BUS],
    "prefill": ["prefill", "--bus", BUS, "--store", BUS],
    "decode": ["decode", "--bus", BUS, "--store", BUS],
}
# Port options without a host option of their own: (command, dest) -> why that is safe.
PORT_WITHOUT_HOST = {
    ("stack", "metrics_port"): "passed on to the workers, which bind their --metrics-host default",
}


def parse(argv: list[str]) -> argparse.Namespace:
    return build_parser(argv).parse_args(argv)


def _parsers() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every parser of the `kvserve` command tree, the benchmarks' included, by name."""
    root = build_parser([])
    subs = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in subs.choices.items():
        yield name, parser
    for name in BENCHMARKS:
        parser = argparse.ArgumentParser(prog=f"kvserve bench {name}")
        load_benchmark(name).add_arguments(parser)
        yield f"bench {name}", parser


def _is_host(dest: str) -> bool:
    return dest == "host" or dest.endswith("_host")


def _is_port(dest: str) -> bool:
    return dest == "port" or dest.endswith("_port")


def test_every_host_option_defaults_to_loopback() -> None:
    """Walks the whole command tree, so a listening command added later is covered too."""
    hosts, ports = {}, set()
    for command, parser in _parsers():
        dests = {a.dest for a in parser._actions}
        for action in parser._actions:
            if _is_host(action.dest):
                hosts[(command, action.dest)] = action.default
            if _is_port(action.dest):
                ports.add((command, action.dest))
                host = action.dest.removesuffix("port") + "host"
                if (command, action.dest) not in PORT_WITHOUT_HOST:
                    assert host in dests, f"`kvserve {command}`: --{action.dest} has no host option"
    assert set(SUBCOMMANDS) >= set(LISTENING)
    assert hosts == {
        ("serve", "host"): LOOPBACK,
        ("gateway", "host"): LOOPBACK,
        ("stack", "host"): LOOPBACK,
        ("worker", "metrics_host"): LOOPBACK,
        ("prefill", "metrics_host"): LOOPBACK,
        ("decode", "metrics_host"): LOOPBACK,
    }
    assert set(PORT_WITHOUT_HOST) <= ports


@pytest.mark.parametrize("command", sorted(LISTENING))
def test_listening_commands_default_to_loopback(command: str) -> None:
    args = parse(LISTENING[command])
    host = args.metrics_host if command in ("worker", "prefill", "decode") else args.host
    assert host == LOOPBACK


@pytest.mark.parametrize("topology", [[], ["--workers", "2"]])
def test_stack_starts_every_process_on_loopback(topology: list[str]) -> None:
    """`kvserve stack`'s child command lines, parsed as the children parse them."""
    gateway, *workers = stack.commands(parse([*LISTENING["stack"], *topology]))
    prefix = [sys.executable, "-P", "-m", "kvserve.services.cli"]
    n = len(prefix)
    assert gateway[:n] == prefix and parse(gateway[n:]).host == LOOPBACK
    assert workers
    for worker in workers:
        assert worker[:n] == prefix and parse(worker[n:]).metrics_host == LOOPBACK


def test_benchmark_servers_bind_loopback() -> None:
    assert hf_shim.build_parser().parse_args([]).host == LOOPBACK
    cmd = llama_server_cmd(Path("llama-server"), Path("m.gguf"), port=8001)
    assert cmd[cmd.index("--host") + 1] == LOOPBACK


async def test_the_gateway_binds_loopback_by_default(tokenizer: KVTokenizer) -> None:
    args = parse(["gateway", "--bus", BUS, "--port", "0"])
    check_gateway_arguments(args)
    info = ModelInfo("m", tokenizer, 8192, tokenizer.vocab_size)
    _, runner, port = await start_gateway(args, InProcessBus(), info)
    try:
        assert port > 0
        assert [a[0] for a in runner.addresses] == [LOOPBACK]
    finally:
        await runner.cleanup()


def _listening(port: int) -> set[str]:
    """The local addresses of the TCP sockets listening on `port` (Linux /proc/net/tcp)."""
    out = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(addr)
                # The kernel prints each 32-bit word in host (little-endian) order.
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                out.add(socket.inet_ntop(family, raw))
    return out


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net/tcp")
def test_worker_metrics_bind_loopback_by_default() -> None:
    """The endpoint a worker starts from its parsed defaults (a daemon thread that lives until
    the test process exits)."""
    args = parse([*LISTENING["worker"], "--metrics-port", str(free_port())])
    url = serve_worker_metrics(args.metrics_host, args.metrics_port, "m", "w", dict)
    assert url == f"http://{LOOPBACK}:{args.metrics_port}/metrics"
    assert _listening(args.metrics_port) == {LOOPBACK}
