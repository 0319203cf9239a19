"""Bus messages: msgpack round trips, and every malformed message rejected at decode; the
SamplingParams of a generate request as their own versioned map."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvserve.shared.protocol import (
    PROTOCOL_VERSION,
    SAMPLING_FIELDS,
    SAMPLING_VERSION,
    AdminRequest,
    Cancel,
    ErrorInfo,
    GenerateRequest,
    KVEvent,
    ProtocolError,
    TokenEvent,
    WorkerInfo,
    decode,
    decode_sampling,
    encode,
    encode_sampling,
)
from kvserve.shared.sampling_params import SamplingParams

MESSAGES = [
    GenerateRequest(
        request_id="cmpl-1",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=4, temperature=0.5, stop=("\n",), seed=None),
        cache_salt="key-abc",
        traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        deadline=1.5e9,
        submitted_at=1.4e9,
    ),
    GenerateRequest("r", [0], SamplingParams()),
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
        cached_tokens_by_source={"device": 0, "host": 0, "store": 16},
        store_lookup="hit",
    ),
    GenerateRequest(
        "r", [0], SamplingParams(), num_cached_tokens=32, cached_tokens_by_source={"device": 32}
    ),
    TokenEvent("r", 0, error=ErrorInfo("bad", "invalid_request_error", "max_tokens", "x")),
    Cancel("cmpl-1", "client"),
    WorkerInfo("worker-0", "worker", "inc1", 16, "m", "t", "float32", "redis://h:6379/0", 1.0),
    KVEvent("worker-0", "inc1", 7, "stored", "device", [b"\x00" * 32, b"\xff" * 32]),
    KVEvent("worker-0", "inc1", 8, "cleared"),
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
        (_token(cached_tokens_by_source={"store": "16"}), "cached_tokens_by_source"),
        (_token(cached_tokens_by_source={"store": True}), "cached_tokens_by_source"),
        (_token(cached_tokens_by_source=[16]), "cached_tokens_by_source"),
        (_token(store_lookup=1), "store_lookup"),
        (_raw(kind="kv", v=PROTOCOL_VERSION, worker="w", incarnation="i", seq=0, op="x"), "op"),
        (
            _raw(
                kind="kv",
                v=PROTOCOL_VERSION,
                worker="w",
                incarnation="i",
                seq=0,
                op="stored",
                block_hashes=["not bytes"],
            ),
            "bytes",
        ),
        (
            _raw(
                kind="worker_info",
                v=PROTOCOL_VERSION,
                name="w",
                role="boss",
                incarnation="i",
                block_size=16,
                model_fp="m",
                tokenizer_fp="t",
                kv_format="f",
            ),
            "role",
        ),
        (
            _raw(
                kind="generate",
                v=PROTOCOL_VERSION,
                request_id="r",
                prompt_token_ids=[1.5],
                sampling=encode_sampling(SamplingParams()),
            ),
            "prompt_token_ids",
        ),
    ],
)
def test_malformed_messages_are_rejected(data: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        decode(data)


def test_token_event_of_an_older_worker_decodes() -> None:
    """An event without the cached tokens by tier and the store lookup (a worker from before
    them) decodes with neither."""
    ev = decode(_token(num_cached_tokens=16))
    assert ev == TokenEvent("r", 0, num_cached_tokens=16)
    assert isinstance(ev, TokenEvent)
    assert (ev.cached_tokens_by_source, ev.store_lookup) == ({}, None)


def test_generate_request_n_from_sampling() -> None:
    assert GenerateRequest("r", [1], SamplingParams(n=3)).n == 3
    assert GenerateRequest("r", [1], SamplingParams()).n == 1


# ---- SamplingParams on the bus ---------------------------------------------------------------

EVERY_FIELD_SET = SamplingParams(
    max_tokens=7, temperature=0.7, top_p=0.9, top_k=40, seed=11, n=3, stop=("a", "bc"),
    stop_token_ids=(2, 5), ignore_eos=True, logprobs=True, top_logprobs=4, beam_width=1,
    length_penalty=0.5, early_stopping=True, skip_special_tokens=False,
)  # fmt: skip


def test_sampling_fields_are_every_field_of_sampling_params() -> None:
    assert set(SAMPLING_FIELDS) == {f.name for f in dataclasses.fields(SamplingParams)}


@pytest.mark.parametrize(
    "params", [SamplingParams(), EVERY_FIELD_SET, SamplingParams(beam_width=3, max_tokens=2)]
)
def test_sampling_params_round_trip_typed(params: SamplingParams) -> None:
    body = encode_sampling(params)
    assert body["v"] == SAMPLING_VERSION and set(body) == {"v", *SAMPLING_FIELDS}
    assert body["stop"] == list(params.stop)  # msgpack-able: lists, not tuples
    back = decode_sampling(msgpack.unpackb(msgpack.packb(body), raw=False))
    assert back == params
    assert isinstance(back.stop, tuple) and isinstance(back.stop_token_ids, tuple)
    assert isinstance(back.temperature, float)
    req = decode(encode(GenerateRequest("r", [1, 2], params)))
    assert isinstance(req, GenerateRequest) and req.sampling == params


def _sampling(**over: Any) -> dict[str, Any]:
    return {**encode_sampling(SamplingParams()), **over}


def _without(name: str) -> dict[str, Any]:
    body = encode_sampling(SamplingParams())
    del body[name]
    return body


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([1, 2], "sampling must be a map"),
        (_without("v"), "unsupported sampling version"),
        (_sampling(v=SAMPLING_VERSION + 1), "unsupported sampling version"),
        (_without("top_k"), r"missing \['top_k'\]"),
        (_sampling(bogus=1), r"unknown \['bogus'\]"),
        (_sampling(max_tokens="ten"), "'max_tokens' has type str"),
        (_sampling(max_tokens=True), "'max_tokens' has type bool"),
        (_sampling(temperature=None), "'temperature' has type NoneType"),
        (_sampling(ignore_eos=1), "'ignore_eos' has type int"),
        (_sampling(stop="x"), "'stop' has type str"),
        (_sampling(stop=["x", 3]), "'stop' must hold strings"),
        (_sampling(stop_token_ids=[1, 2.0]), "'stop_token_ids' must hold ints"),
        (_sampling(max_tokens=0), "sampling field 'max_tokens': max_tokens must be >= 1"),
        (_sampling(top_p=1.5), "sampling field 'top_p'"),
        (_sampling(beam_width=2, n=2), "sampling field 'beam_width'"),
    ],
)
def test_malformed_sampling_is_a_protocol_error(body: Any, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        decode_sampling(body)
    raw = _raw(kind="generate", v=PROTOCOL_VERSION, request_id="r", prompt_token_ids=[1],
               sampling=body)  # fmt: skip
    with pytest.raises(ProtocolError, match="sampling"):
        decode(raw)


def test_admin_and_top_logprobs_messages_round_trip() -> None:
    job = AdminRequest("w1", "warmup", [{"token_ids": [1, 2], "cache_salt": None}])
    assert decode(encode(job)) == job
    ev = TokenEvent("w1", 0, info={"done": 1}, top_logprobs=[[[5, -0.1], [7, -2.5]]])
    assert decode(encode(ev)) == ev
    for bad in (
        AdminRequest("x", "explode"),
        AdminRequest("x", "warmup", [{"token_ids": ["a"]}]),
        AdminRequest("x", "warmup", [{"token_ids": [1], "other": 1}]),
    ):
        try:
            decode(encode(bad))
        except ProtocolError:
            continue
        raise AssertionError(f"accepted {bad}")


# ---- nothing but ProtocolError, whatever the bytes (bus input is untrusted) ------------------


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"\xc1", "not_msgpack"),
        (b"", "not_msgpack"),
        (encode(Cancel("r"))[:-1], "not_msgpack"),
        (encode(Cancel("r")) + b"\x00", "not_msgpack"),  # trailing bytes
        (_raw(kind="cancel", v=99, request_id="r"), "version"),
        (_raw(kind="cancel", request_id="r"), "version"),
        (bytes(msgpack.packb([1, 2])), "invalid"),
        (bytes(msgpack.packb(None)), "invalid"),
        (_raw(kind="cancel", v=PROTOCOL_VERSION, request_id=5), "invalid"),
        (_raw(kind=["cancel"], v=PROTOCOL_VERSION, request_id="r"), "invalid"),
    ],
)
def test_a_refusal_says_why(data: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError) as refused:
        decode(data)
    assert refused.value.reason == reason


def _with_bytes_keys(body: dict[Any, Any]) -> bytes:
    return bytes(msgpack.packb(body, use_bin_type=True))


_INFO_BYTES_KEY = _with_bytes_keys({**msgpack.unpackb(_token()), "info": {b"done": 1}})
_MIXED_UNKNOWN = _with_bytes_keys({**msgpack.unpackb(encode(Cancel("r"))), b"x": 1, "y": 2})
_WORKER_INFO = msgpack.unpackb(encode(WorkerInfo("w", "worker", "i", 16, "m", "t", "f")))
_BLOCK_SIZE_0 = _raw(**{**_WORKER_INFO, "block_size": 0})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_token(index=-1), "index must be >= 0"),
        (_token(logprobs=["-1.5"]), "logprobs must hold numbers"),
        (_token(logprobs=[True]), "logprobs must hold numbers"),
        (_token(top_logprobs=[[[5, "x"]]]), "top_logprobs"),
        (_token(top_logprobs=[[[5]]]), "top_logprobs"),
        (_token(top_logprobs=[[5, -0.1]]), "top_logprobs"),
        (_token(top_logprobs=[{"5": -0.1}]), "top_logprobs"),
        (_INFO_BYTES_KEY, "info must have string keys"),
        (_MIXED_UNKNOWN, "unknown fields"),
        (_BLOCK_SIZE_0, "block_size must be >= 1"),
    ],
)
def test_what_a_reader_would_trip_on_is_rejected(data: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message) as refused:
        decode(data)
    assert refused.value.reason == "invalid"


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_truncation_of_a_message_is_not_msgpack(msg: Any) -> None:
    data = encode(msg)
    for end in range(len(data)):
        with pytest.raises(ProtocolError) as refused:
            decode(data[:end])
        assert refused.value.reason == "not_msgpack", end


_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=6)
    | st.binary(max_size=6)
)
_VALUES = st.recursive(
    _LEAVES,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=4) | st.binary(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)


def _mutate(body: dict[Any, Any], data: st.DataObject) -> None:
    """Set, add or delete one field of the message (or of its sampling map)."""
    target = body
    if "sampling" in body and data.draw(st.booleans()):
        target = body["sampling"]
    name = data.draw(st.sampled_from([*target, "extra", b"extra"]))
    if data.draw(st.integers(0, 4)) == 0:
        target.pop(name, None)
    else:
        target[name] = data.draw(_VALUES)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(MESSAGES), st.data())
def test_a_mutated_message_decodes_or_is_a_protocol_error(msg: Any, data: st.DataObject) -> None:
    """A field set to any msgpack value, added or removed, or a byte of the encoding changed:
    decode returns a message or raises ProtocolError, never anything else."""
    if data.draw(st.booleans()):
        body = msgpack.unpackb(encode(msg), raw=False)
        _mutate(body, data)
        raw = bytes(msgpack.packb(body, use_bin_type=True))
    else:
        raw = bytearray(encode(msg))
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        raw = bytes(raw)
    try:
        decode(raw)
    except ProtocolError as e:
        assert e.reason in ProtocolError.REASONS
