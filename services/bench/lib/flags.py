"""The command-line options several benchmarks take, declared once: the model, the seed, sizes
(integer options with their defaults), plots, and the options of the multi-server sweeps.

Each helper adds the options to the parser in the order given, so a benchmark's `--help` lists
them where it declares them."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvserve.services.cli_support import CliError
from kvserve.shared.config import default_model_path


def add_model(p: argparse.ArgumentParser, resolved: bool = True, help: str | None = None) -> None:
    """`--model`: the default model's path when `resolved`, else None meaning the default
    model (shown as PATH, resolved when the benchmark runs)."""
    if resolved:
        p.add_argument("--model", default=str(default_model_path()), help=help)
    else:
        p.add_argument(
            "--model", default=None, metavar="PATH", help=help or "default: the default model"
        )


def add_gguf(p: argparse.ArgumentParser) -> None:
    """`--gguf`: the model file every server of a sweep loads."""
    p.add_argument("--gguf", type=Path, default=None, help="model file (default: the default GGUF)")


def add_seed(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0)


def add_sizes(
    p: argparse.ArgumentParser | argparse._ArgumentGroup,
    sizes: dict[str, int],
    helps: dict[str, str] | None = None,
) -> None:
    """One integer option per entry: `--NAME` defaulting to its value (help from `helps`)."""
    for name, default in sizes.items():
        p.add_argument(f"--{name}", type=int, default=default, help=(helps or {}).get(name))


def check_sizes(args: argparse.Namespace, names: list[str], minimum: int = 1) -> None:
    """CliError (one line) naming the first of the options `names` below `minimum`."""
    for name in names:
        value = getattr(args, name.replace("-", "_"))
        if value is not None and value < minimum:
            raise CliError(f"--{name} must be >= {minimum}, got {value}")


def add_plot(p: argparse.ArgumentParser, help: str = "write a PNG of the arms here") -> None:
    p.add_argument("--plot", default=None, metavar="PATH", help=help)


def add_report(p: argparse.ArgumentParser, saved: str) -> None:
    """`--report`: print (and plot) what a run left in --out instead of running."""
    p.add_argument("--report", action="store_true", help=f"run nothing: print (and plot) {saved}")


def comma_list(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    """The comma list's items, each one of `allowed`; CliError (one line) otherwise."""
    chosen = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in chosen if x not in allowed]
    if unknown or not chosen:
        raise CliError(f"{flag}: unknown {', '.join(unknown)}; choose from {', '.join(allowed)}")
    return chosen
