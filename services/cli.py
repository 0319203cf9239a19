"""The `kvserve` command. Each subcommand lives in its own module with `register(subparsers)`;
a module's `run(args) -> int` does the work. User errors print one line and exit 2."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import signal
import sys
from collections.abc import Callable

from kvserve.shared.model.gguf_file import GGUFReadError

# subcommand -> module under kvserve.services (imported lazily: `kvserve capacity` needs no torch)
SUBCOMMANDS = {
    "fetch-model": "fetch_model",
    "generate": "generate",
    "capacity": "capacity",
    "bench": "bench.main",
    "serve": "serve",
    "warmup": "warmup",
    "gateway": "gateway.main",
    "prefill": "prefill",
    "decode": "decode",
    "stack": "stack",
}


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


def stop_on_signals() -> asyncio.Event:
    """An event that SIGTERM or SIGINT sets (a service's cue to drain and exit); call it from
    inside the running event loop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Only import the module of the chosen subcommand (fast start, no torch where none needed).
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, module in SUBCOMMANDS.items():
        if chosen in SUBCOMMANDS and name != chosen:
            sub.add_parser(name)
            continue
        mod = importlib.import_module(f"kvserve.services.{module}")
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except CliError as e:
        print(f"kvserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, GGUFReadError) as e:  # no model, or not a model
        print(f"kvserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    # Through the package's module, so CliError raised by subcommands (which import
    # kvserve.services.cli) is the class caught in main(), not a __main__ copy of it.
    from kvserve.services.cli import main as _main

    raise SystemExit(_main())
