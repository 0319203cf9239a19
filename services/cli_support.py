"""What the `kvserve` subcommands share, apart from the command itself (services/cli.py): the
user-error type, the shutdown signal, the life of a long-running service process, and the checks
of flags several subcommands take. Imported by the subcommand modules and by services/cli.py,
never the other way round."""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Callable, Coroutine, Iterable
from typing import Any


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


def run_service(
    args: argparse.Namespace,
    service: str,
    main: Callable[[argparse.Namespace], Coroutine[Any, Any, None]],
) -> int:
    """Run a service process (`kvserve-{service}` in traces) until `main(args)` returns:
    JSON logs at --log-level, tracing set up before and flushed after. Exit status 0."""
    from kvserve.shared.telemetry import configure_logging, configure_tracing, shutdown_tracing

    configure_logging(args.log_level)
    configure_tracing(f"kvserve-{service}")
    try:
        asyncio.run(main(args))
    finally:
        shutdown_tracing()
    return 0


def check_port(flag: str, port: int) -> None:
    if not 0 <= port <= 65535:
        raise CliError(f"{flag} must be in [0, 65535], got {port}")


def check_at_least_one(args: argparse.Namespace, names: Iterable[str]) -> None:
    """Each named option (attribute name) is >= 1; an unset optional one (None) passes."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1")


def check_positive(args: argparse.Namespace, names: Iterable[str]) -> None:
    """Each named option (attribute name, seconds) is > 0."""
    for name in names:
        if getattr(args, name) <= 0:
            raise CliError(f"--{name.replace('_', '-')} must be > 0")


def check_bus_url(url: str) -> None:
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise CliError(f"--bus must be a redis:// URL, got {url!r}")
