"""`kvserve stack`'s command lines for its processes (the gateway gets the request timeout, the
workers share the cores) and the one-line errors for bad values."""

from __future__ import annotations

import os

import pytest
from kvserve.services import cli, stack
from kvserve.services.cli import build_parser


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
        (["serve", "--threads", "0"], "--threads"),
        (["prefill", "--bus", "redis://h:1/0", "--store", "redis://h:1/0", "--threads", "0"],
         "--threads"),
    ],
)  # fmt: skip
def test_bad_values_one_line_error(capsys, argv: list[str], message: str) -> None:  # type: ignore[no-untyped-def]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_threads_reach_the_engine_config() -> None:
    from kvserve.services.engine_options import engine_config

    for argv in (["serve", "--threads", "2"], ["decode", "--bus", "redis://h:1/0",
                 "--store", "redis://h:1/0", "--threads", "2"]):  # fmt: skip
        assert engine_config(build_parser(argv).parse_args(argv)).num_threads == 2
    argv = ["serve"]
    assert engine_config(build_parser(argv).parse_args(argv)).num_threads is None
