"""`kvserve bench BENCHMARK [options]`: the benchmarks, one module each under
kvserve.services.bench (the multi-server ones under kvserve.services.bench.sweeps).

A benchmark module has `add_arguments(parser)` and `run(args) -> int`; it is imported only when
chosen (`kvserve bench serve` is an HTTP client and must not pay for torch), so its options are
parsed here, after the choice: `kvserve bench NAME --help` shows them.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Benchmark:
    module: str  # under kvserve.services.bench (the sweeps under .sweeps)
    help: str


# Adding a benchmark is one line here plus its module.
BENCHMARKS: dict[str, Benchmark] = {
    "engine": Benchmark("engine", "engine output tok/s vs HF transformers, and the roofline"),
    "prefix": Benchmark("prefix", "prefix caching: TTFT cold vs warm, shared-prefix throughput"),
    "kvquant": Benchmark("kvquant", "int8/fp8 KV cache: perplexity, KLD, greedy agreement, bytes"),
    "store": Benchmark("store", "prefix store: bytes/token and quality per format, TTFT, MB/s"),
    "serve": Benchmark("serve", "serving benchmark: an HTTP client (TTFT, TPOT, goodput, traces)"),
    "profile": Benchmark("profile", "where an engine step's time goes under a serve workload"),
    "startup": Benchmark("startup", "start-up time of generate and serve, part by part"),
    "calibrate": Benchmark(
        "calibrate", "fit a cost profile for simulated workers from this machine's engine"
    ),
    "compare": Benchmark(
        "sweeps.compare", "bench serve against kvserve, llama-server and HF, side by side"
    ),
    "scale": Benchmark(
        "sweeps.scale", "2 workers on 2 cores: shared KV store and cache-aware routing"
    ),
    "chaos": Benchmark(
        "sweeps.chaos", "faults under load: what a server and a fleet survive, per fault"
    ),
    "fleet": Benchmark(
        "sweeps.fleet", "routing arms on N real or simulated workers, a QPS sweep; --validate"
    ),
}


class BenchmarkModule(Protocol):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def _listing() -> str:
    width = max(len(name) for name in BENCHMARKS)
    return "\n".join(f"  {name:<{width}}  {b.help}" for name, b in BENCHMARKS.items())


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks: " + ", ".join(BENCHMARKS),
        description=__doc__,
        epilog="benchmarks:\n" + _listing(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("benchmark", choices=BENCHMARKS, metavar="BENCHMARK")
    # Everything after the name, --help included, belongs to the chosen benchmark's parser.
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(handler=run)


def load(name: str) -> BenchmarkModule:
    module: BenchmarkModule = importlib.import_module(
        f"kvserve.services.bench.{BENCHMARKS[name].module}"
    )
    return module


def run(args: argparse.Namespace) -> int:
    module = load(args.benchmark)
    parser = argparse.ArgumentParser(
        prog=f"kvserve bench {args.benchmark}",
        description=getattr(module, "__doc__", None),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.add_arguments(parser)
    return module.run(parser.parse_args(args.bench_args))
