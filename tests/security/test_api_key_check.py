"""API keys are checked in constant time (services/gateway/auth.py): the presented token's
SHA-256 digest is compared with every configured key's digest through `hmac.compare_digest`,
so neither the token's length, nor how much of a key it got right, nor which key it matched
changes what is compared. Checked three ways:

- over HTTP, on a gateway started from the real `kvserve serve` argument parser on a real
  socket: a wrong key of a real key's length, of other lengths, a prefix of a key, a key with a
  byte more, another scheme, no header and undecodable bytes are all 401 in OpenAI's error
  shape; the real keys are 200;
- at run time: every check makes exactly one `compare_digest` call per configured key, on
  32-byte digests, whatever the token;
- in the source: `ApiKeys` calls `compare_digest`, and never compares non-constant values
  with ==, !=, in or not in, nor looks anything up by the token (a dict or set lookup is not
  constant time either)."""

from __future__ import annotations

import ast
import asyncio
import hmac
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kvserve.services.cli import build_parser
from kvserve.services.gateway import auth
from kvserve.services.gateway.auth import ApiKeys, key_salt
from kvserve.services.gateway.errors import APIError
from kvserve.services.gateway.main import check_gateway_arguments, start_gateway
from kvserve.services.gateway.schema import ModelInfo
from kvserve.shared.bus.memory import InProcessBus
from kvserve.shared.model.tokenizer import KVTokenizer

KEYS = ("sk-team-alpha-0123456789", "sk-b")
SAME_LENGTH = "sk-team-alpha-0123456780"  # one character off, the first key's length
WRONG = [
    SAME_LENGTH,
    "sk-team-alpha-012345678",  # a prefix of the first key
    KEYS[0] + "9",  # one character more
    "sk-c",  # the second key's length
    "x",
    "sk-team-alpha-0123456789-and-much-longer-than-any-configured-key" * 4,
    KEYS[1].upper(),
]
ERROR = {
    "message": "Invalid or missing API key: send `Authorization: Bearer <key>`.",
    "type": "authentication_error",
    "param": None,
    "code": "invalid_api_key",
}


@pytest.fixture
async def server(tokenizer: KVTokenizer) -> AsyncIterator[str]:
    """`kvserve serve`'s gateway with two keys on a free loopback port (no engine: /v1/models
    needs none); its base URL."""
    argv = ["serve", "--port", "0", "--api-key", KEYS[0], "--api-key", KEYS[1]]
    args = build_parser(argv).parse_args(argv)
    check_gateway_arguments(args)
    info = ModelInfo("m", tokenizer, 8192, tokenizer.vocab_size)
    _, runner, port = await start_gateway(args, InProcessBus(), info)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def _get(url: str, headers: dict[str, str]) -> tuple[int, dict[str, str], Any]:
    async with aiohttp.ClientSession() as s, s.get(url + "/v1/models", headers=headers) as r:
        return r.status, dict(r.headers), await r.json()


async def test_wrong_keys_of_any_length_are_refused_with_401(server: str) -> None:
    for key in KEYS:
        status, _, body = await _get(server, {"Authorization": f"Bearer {key}"})
        assert status == 200 and [m["id"] for m in body["data"]] == ["m"]
    headers: list[dict[str, str]] = [{"Authorization": f"Bearer {k}"} for k in WRONG]
    headers += [{}, {"Authorization": "Bearer"}, {"Authorization": "Bearer "}]
    headers += [{"Authorization": f"Basic {KEYS[0]}"}, {"Authorization": KEYS[0]}]
    for h in headers:
        status, response_headers, body = await _get(server, h)
        assert (status, body) == (401, {"error": ERROR}), h
        assert response_headers["WWW-Authenticate"] == "Bearer"


async def test_undecodable_bytes_in_the_header_are_a_401(server: str) -> None:
    """Bytes that are not UTF-8 (sent on a raw socket, as a client could) are a wrong key, not
    a server error."""
    host, port = server.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-\xff\xfe\x80\r\n"
        b"Connection: close\r\n\r\n"
    )
    await writer.drain()
    response = await reader.read()
    writer.close()
    await writer.wait_closed()
    assert response.split(b"\r\n", 1)[0] == b"HTTP/1.1 401 Unauthorized"
    assert b'"code": "invalid_api_key"' in response


def test_every_key_is_compared_on_equal_length_digests(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: Any, b: Any) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    keys = ApiKeys(KEYS)
    for token in [*KEYS, *WRONG]:
        calls.clear()
        try:
            salt = keys.authenticate(f"Bearer {token}")
        except APIError as e:
            assert e.status == 401 and token in WRONG
        else:
            assert token in KEYS and salt == key_salt(token)
        assert len(calls) == len(KEYS), token  # every key, whether or not one matched
        assert all(len(a) == len(b) == 32 for a, b in calls), token


def _api_keys_class() -> ast.ClassDef:
    tree = ast.parse(Path(auth.__file__).read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ApiKeys")


def test_the_source_compares_keys_only_through_compare_digest() -> None:
    cls = _api_keys_class()
    calls = [ast.unparse(n.func) for n in ast.walk(cls) if isinstance(n, ast.Call)]
    assert any(c in ("hmac.compare_digest", "secrets.compare_digest") for c in calls)
    value_ops = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)
    methods = [n for n in cls.body if isinstance(n, ast.FunctionDef)]
    code = [node for m in methods for stmt in m.body for node in ast.walk(stmt)]  # no signatures
    for node in code:
        if isinstance(node, ast.Compare) and any(isinstance(op, value_ops) for op in node.ops):
            operands = [node.left, *node.comparators]
            variable = [o for o in operands if not isinstance(o, ast.Constant)]
            # A value compared with a literal (the scheme with "bearer") is not a secret.
            assert len(variable) <= 1, f"line {node.lineno}: {ast.unparse(node)}"
        if isinstance(node, ast.Subscript):
            assert isinstance(node.slice, ast.Constant), f"line {node.lineno}: lookup by value"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            assert node.func.attr not in ("get", "index", "count", "startswith", "find"), (
                f"line {node.lineno}: {ast.unparse(node)}"
            )
