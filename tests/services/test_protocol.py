"""Bus messages: msgpack round trips, and every malformed message rejected at decode."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from kvserve.shared.protocol import (
    PROTOCOL_VERSION,
    Cancel,
    ErrorInfo,
    GenerateRequest,
    ProtocolError,
    TokenEvent,
    decode,
    encode,
)

MESSAGES = [
    GenerateRequest(
        request_id="cmpl-1",
        prompt_token_ids=[1, 2, 3],
        sampling={"max_tokens": 4, "temperature": 0.5, "stop": ["\n"], "seed": None},
        cache_salt="key-abc",
        traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        deadline=1.5e9,
        submitted_at=1.4e9,
    ),
    GenerateRequest("r", [0], {}),
    TokenEvent(
        request_id="cmpl-1",
        seq=3,
        index=1,
        token_ids=[5, 6],
        text=" hé",
        logprobs=[-0.5, -1.25],
        finish_reason="stop",
        num_prompt_tokens=3,
        num_cached_tokens=16,
    ),
    TokenEvent("r", 0, error=ErrorInfo("bad", "invalid_request_error", "max_tokens", "x")),
    Cancel("cmpl-1", "client"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: Any) -> None:
    data = encode(msg)
    assert decode(data) == msg
    body = msgpack.unpackb(data, raw=False)  # plain msgpack: a map, no pickled objects
    assert body["kind"] == msg.KIND and body["v"] == PROTOCOL_VERSION


def _raw(**body: Any) -> bytes:
    return bytes(msgpack.packb(body))


def _token(**over: Any) -> bytes:
    body = {"kind": "token", "v": PROTOCOL_VERSION, "request_id": "r", "seq": 0, **over}
    return bytes(msgpack.packb(body))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\xc1", "not a msgpack message"),
        (bytes(msgpack.packb([1, 2])), "msgpack map"),
        (_raw(kind="cancel", v=99, request_id="r"), "version"),
        (_raw(kind="cancel", request_id="r"), "version"),
        (_raw(kind="pickle", v=PROTOCOL_VERSION), "unknown message kind"),
        (_raw(kind="cancel", v=PROTOCOL_VERSION), "bad cancel message"),
        (_raw(kind="cancel", v=PROTOCOL_VERSION, request_id="r", extra=1), "unknown fields"),
        (_raw(kind="cancel", v=PROTOCOL_VERSION, request_id=5), "request_id"),
        (_token(seq=True), "seq"),
        (_token(seq="1"), "seq"),
        (_token(token_ids=[1, "2"]), "token_ids"),
        (_token(token_ids=[1, True]), "token_ids"),
        (_token(error={"type": "x"}), "bad error"),
        (_token(error={"message": "m", "type": 3}), "bad error"),
        (
            _raw(
                kind="generate",
                v=PROTOCOL_VERSION,
                request_id="r",
                prompt_token_ids=[1.5],
                sampling={},
            ),
            "prompt_token_ids",
        ),
    ],
)
def test_malformed_messages_are_rejected(data: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        decode(data)


def test_generate_request_n_from_sampling() -> None:
    assert GenerateRequest("r", [1], {"n": 3}).n == 3
    assert GenerateRequest("r", [1], {}).n == 1
