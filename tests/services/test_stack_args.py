"""`kvserve stack`'s command lines for its processes: the gateway gets the request timeout."""

from __future__ import annotations

from kvserve.services import stack
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
