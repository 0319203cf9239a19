"""The `kvserve` command. Each subcommand lives in its own module; user errors print one line
and exit 2."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

from kvserve.services.cli_support import CliError
from kvserve.shared.model.gguf_file import GGUFReadError

# subcommand -> module under kvserve.services, imported lazily (`kvserve capacity` needs no
# torch). The module's `register(subparsers)` (or the function after a colon) adds the
# subcommand and sets its handler, `handler(args) -> int`; a CliError
# (services/cli_support.py) from the handler is a user error.
SUBCOMMANDS = {
    "fetch-model": "fetch_model",
    "generate": "generate",
    "capacity": "capacity",
    "bench": "bench.main",
    "serve": "serve",
    "warmup": "warmup",
    "gateway": "gateway.main",
    "prefill": "worker_commands:register_prefill",
    "decode": "worker_commands:register_decode",
    "worker": "worker_commands:register_worker",
    "stack": "stack",
    "sim-fleet": "sim_fleet",
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Only import the module of the chosen subcommand (fast start, no torch where none needed).
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, module in SUBCOMMANDS.items():
        if chosen in SUBCOMMANDS and name != chosen:
            sub.add_parser(name)
            continue
        path, _, function = module.partition(":")
        mod = importlib.import_module(f"kvserve.services.{path}")
        getattr(mod, function or "register")(sub)
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
    raise SystemExit(main())
