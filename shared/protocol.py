"""The messages on the bus: a generate request, an admin job, a token event, a cancel, and the
fleet's own: a worker's description (WorkerInfo) and its KV events (KVEvent).

Each message is a small frozen dataclass; `encode` turns it into a msgpack map (never pickle)
tagged with its kind and the protocol version, `decode` turns bytes back into the dataclass and
raises ProtocolError for anything malformed (wrong version, unknown kind, missing or mistyped
field, a value out of its range), so a bad message is rejected at the boundary rather than
deep in a worker. `decode` raises nothing else, whatever the bytes: a ProtocolError's `reason`
says why ("not_msgpack", "version" or "invalid"), as bus readers count what they drop
(shared/bus/drops.py).

A generate request's SamplingParams travel as a map of their own (`encode_sampling` /
`decode_sampling`): every field of SAMPLING_FIELDS, by name, plus the map's version
`SAMPLING_VERSION`; decoding checks the version, the field set and each field's type, then
builds the SamplingParams (whose own checks apply), so a worker holds typed, valid parameters.

A worker's KV events carry `seq` = 0, 1, 2, ... per incarnation (a restarted worker has a new
incarnation and starts at 0 again); a reader that sees a gap has missed events and must forget
what it knew of that worker's blocks (services/gateway/router.py).

Invariants:
- A request's token events carry `seq` = 0, 1, 2, ... in emission order; a consumer keeps the
  first event of each seq and drops the rest. A worker that takes a request over reads the
  events emitted so far and goes on from the next seq and the client's last token (exact-token
  resumption); one that finds none runs it from seq 0 (the same seed: the same tokens).
- An event with `error` set is terminal for the whole request, whatever its seq (a worker that
  fails a request it never ran does not know how many events came before). Otherwise the
  request is finished when every completion index 0..n-1 has had an event with
  `finish_reason` set.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, ClassVar

import msgpack
from kvserve.shared.sampling_params import InvalidRequestError, SamplingParams

PROTOCOL_VERSION = 1
SAMPLING_VERSION = 2  # 2: min_tokens


class ProtocolError(ValueError):
    """Bytes that are not a valid message of this protocol version. `reason`: "not_msgpack"
    (not msgpack at all, or cut short), "version" (another protocol or sampling-map version,
    or none) or "invalid" (anything else: not a map, an unknown kind, a missing, unknown or
    mistyped field, a value out of its range)."""

    REASONS: ClassVar[tuple[str, ...]] = ("not_msgpack", "version", "invalid")

    def __init__(self, message: str, reason: str = "invalid") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class ErrorInfo:
    """An error in OpenAI's shape: `type` as OpenAI names it, `param` the offending field."""

    message: str
    type: str = "server_error"
    param: str | None = None
    code: str | None = None


@dataclass(frozen=True)
class GenerateRequest:
    """A tokenized, validated request; `deadline` is a Unix time after which the request is
    no longer worth running."""

    KIND: ClassVar[str] = "generate"
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    cache_salt: str | None = None
    traceparent: str | None = None
    deadline: float | None = None
    submitted_at: float = field(default_factory=time.time)
    # Set by a prefill worker on the request it forwards to decode: the prompt tokens it found
    # cached (the decode worker loads the rest from the store; clients see this number), and
    # the tiers they came from ({"device", "host", "store"}: tokens).
    num_cached_tokens: int | None = None
    cached_tokens_by_source: dict[str, int] | None = None

    @property
    def n(self) -> int:
        return self.sampling.n


@dataclass(frozen=True)
class AdminRequest:
    """A cache admin job for a worker, on the same request stream as generate requests (so a
    prefill worker runs it in the disaggregated topology). `op` is "warmup" (`prefixes`: maps
    {"token_ids": [...], "cache_salt": str | None}) or "flush". The worker answers with token
    events whose `info` carries the job's counters; the last one has finish_reason "stop"."""

    KIND: ClassVar[str] = "admin"
    OPS: ClassVar[tuple[str, ...]] = ("warmup", "flush")
    request_id: str
    op: str
    prefixes: list[dict[str, Any]] = field(default_factory=list)
    traceparent: str | None = None
    submitted_at: float = field(default_factory=time.time)

    @property
    def n(self) -> int:
        return 1


@dataclass(frozen=True)
class TokenEvent:
    """What one completion (`index`) of a request produced since its previous event."""

    KIND: ClassVar[str] = "token"
    request_id: str
    seq: int
    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: ErrorInfo | None = None
    info: dict[str, Any] | None = None  # an admin job's counters
    # per token (with logprobs), the most likely alternatives: [[token id, logprob], ...]
    # (pairs, not a map: msgpack maps here have string keys)
    top_logprobs: list[list[list[float]]] = field(default_factory=list)
    # num_cached_tokens by the tier they came from ({"device", "host", "store"}: tokens) and how
    # the request's store lookup ended (tiers.LOOKUP_OUTCOMES; None: the store was not asked).
    # An older worker sends neither: empty and None.
    cached_tokens_by_source: dict[str, int] = field(default_factory=dict)
    store_lookup: str | None = None
    # Which delivery of the request emitted it (1: the first; each take-over by another worker
    # one more). A reader drops an event whose epoch is below one it has seen: a holder that
    # was taken over (paused, not dead) cannot mix its tokens into the new holder's. 0: a
    # worker that does not say.
    epoch: int = 0

    @property
    def is_fence(self) -> bool:
        """A take-over's first event: its epoch, no content (seq FENCE_SEQ)."""
        return self.seq == FENCE_SEQ


FENCE_SEQ = -1


def error_event(request_id: str, seq: int, error: ErrorInfo, epoch: int = 0) -> TokenEvent:
    """The terminal event of a request that failed."""
    return TokenEvent(request_id=request_id, seq=seq, error=error, epoch=epoch)


def fence_event(request_id: str, epoch: int) -> TokenEvent:
    """Written by a worker taking a request over, before it reads what was emitted: from here
    on, events of earlier epochs are stale."""
    return TokenEvent(request_id=request_id, seq=FENCE_SEQ, epoch=epoch)


@dataclass(frozen=True)
class Cancel:
    """Stop a request wherever it is (client gone, deadline passed, shutdown)."""

    KIND: ClassVar[str] = "cancel"
    request_id: str
    reason: str = "client"


@dataclass(frozen=True)
class WorkerInfo:
    """What a router needs to know of an engine worker: its `role` ("worker": prefill and decode
    in one engine, "prefill", "decode"), its `incarnation` (new at every start), the identity of
    its blocks (the parts of the chain's root hash besides the cache salt: `model_fp`,
    `tokenizer_fp`, `kv_format`, `block_size`) and `store_id`, which names the persistent store
    it shares with other workers ("" when its store is its own: memory or a local disk)."""

    KIND: ClassVar[str] = "worker_info"
    ROLES: ClassVar[tuple[str, ...]] = ("worker", "prefill", "decode")
    name: str
    role: str
    incarnation: str
    block_size: int
    model_fp: str
    tokenizer_fp: str
    kv_format: str
    store_id: str = ""
    started_at: float = field(default_factory=time.time)


@dataclass(frozen=True)
class KVEvent:
    """`op`: blocks that entered (`stored`) or left (`removed`) one of a worker's tiers ("device",
    "host"), or every block of its device and host tiers dropped at once (`cleared`, a flush).
    `parent_hash` is the chain hash before the first of `block_hashes` when they are one run."""

    KIND: ClassVar[str] = "kv"
    OPS: ClassVar[tuple[str, ...]] = ("stored", "removed", "cleared")
    worker: str
    incarnation: str
    seq: int
    op: str
    tier: str = ""
    block_hashes: list[bytes] = field(default_factory=list)
    parent_hash: bytes | None = None


Message = GenerateRequest | AdminRequest | TokenEvent | Cancel | WorkerInfo | KVEvent
Work = GenerateRequest | AdminRequest  # what goes on a request stream
_KINDS: dict[str, type[Message]] = {
    c.KIND: c for c in (GenerateRequest, AdminRequest, TokenEvent, Cancel, WorkerInfo, KVEvent)
}

# Expected Python types of each field (after msgpack decoding), checked on decode.
_INT = (int,)
_NUM = (int, float)
_STR = (str,)
_OPT_STR = (str, type(None))
_FIELD_TYPES: dict[str, dict[str, tuple[type, ...]]] = {
    "generate": {
        "request_id": _STR,
        "prompt_token_ids": (list,),
        "sampling": (dict,),
        "cache_salt": _OPT_STR,
        "traceparent": _OPT_STR,
        "deadline": (int, float, type(None)),
        "submitted_at": _NUM,
        "num_cached_tokens": (int, type(None)),
        "cached_tokens_by_source": (dict, type(None)),
    },
    "token": {
        "request_id": _STR,
        "seq": _INT,
        "index": _INT,
        "token_ids": (list,),
        "text": _STR,
        "logprobs": (list,),
        "finish_reason": _OPT_STR,
        "num_prompt_tokens": _INT,
        "num_cached_tokens": _INT,
        "error": (dict, type(None)),
        "info": (dict, type(None)),
        "top_logprobs": (list,),
        "cached_tokens_by_source": (dict,),
        "store_lookup": _OPT_STR,
        "epoch": _INT,
    },
    "admin": {
        "request_id": _STR,
        "op": _STR,
        "prefixes": (list,),
        "traceparent": _OPT_STR,
        "submitted_at": _NUM,
    },
    "cancel": {"request_id": _STR, "reason": _STR},
    "worker_info": {
        "name": _STR,
        "role": _STR,
        "incarnation": _STR,
        "block_size": _INT,
        "model_fp": _STR,
        "tokenizer_fp": _STR,
        "kv_format": _STR,
        "store_id": _STR,
        "started_at": _NUM,
    },
    "kv": {
        "worker": _STR,
        "incarnation": _STR,
        "seq": _INT,
        "op": _STR,
        "tier": _STR,
        "block_hashes": (list,),
        "parent_hash": (bytes, type(None)),
    },
}


# The SamplingParams fields on the bus and their types after msgpack decoding (bool is accepted
# only where listed). One entry per field of SamplingParams (checked below at import): a new
# field is added here, with SAMPLING_VERSION raised when old readers must refuse it.
SAMPLING_FIELDS: dict[str, tuple[type, ...]] = {
    "max_tokens": _INT,
    "temperature": _NUM,
    "top_p": _NUM,
    "top_k": _INT,
    "seed": (int, type(None)),
    "n": _INT,
    "stop": (list,),
    "stop_token_ids": (list,),
    "ignore_eos": (bool,),
    "min_tokens": _INT,
    "logprobs": (bool,),
    "top_logprobs": _INT,
    "beam_width": _INT,
    "length_penalty": _NUM,
    "early_stopping": (bool,),
    "skip_special_tokens": (bool,),
    "fault": (str, type(None)),
}
_FLOAT_FIELDS = ("temperature", "top_p", "length_penalty")
assert set(SAMPLING_FIELDS) == {f.name for f in fields(SamplingParams)}, "SAMPLING_FIELDS"


def encode_sampling(params: SamplingParams) -> dict[str, Any]:
    """SamplingParams as a msgpack-able map: every field by name, tuples as lists, and "v"."""
    body: dict[str, Any] = {"v": SAMPLING_VERSION}
    for name in SAMPLING_FIELDS:
        value = getattr(params, name)
        body[name] = list(value) if isinstance(value, tuple) else value
    return body


def decode_sampling(body: Any) -> SamplingParams:
    """The SamplingParams `encode_sampling` wrote; ProtocolError for a map of another version,
    with missing, unknown or mistyped fields, or with values SamplingParams refuses."""
    if not isinstance(body, dict):
        raise ProtocolError("sampling must be a map")
    body = dict(body)
    if body.pop("v", None) != SAMPLING_VERSION:
        raise ProtocolError(
            f"unsupported sampling version (expected {SAMPLING_VERSION})", "version"
        )
    _check_sampling_fields(body)
    kw: dict[str, Any] = {k: float(v) if k in _FLOAT_FIELDS else v for k, v in body.items()}
    kw["stop"] = tuple(body["stop"])
    kw["stop_token_ids"] = tuple(body["stop_token_ids"])
    try:
        return SamplingParams(**kw)
    except InvalidRequestError as e:
        raise ProtocolError(f"sampling field {e.param!r}: {e}") from e


def _check_sampling_fields(body: dict[str, Any]) -> None:
    missing = set(SAMPLING_FIELDS) - set(body)
    unknown = set(body) - set(SAMPLING_FIELDS)
    if missing or unknown:
        raise ProtocolError(
            f"sampling fields: missing {sorted(missing)}, unknown {sorted(unknown, key=repr)}"
        )
    for name, value in body.items():
        _check_type(f"sampling field {name!r}", value, SAMPLING_FIELDS[name])
    if not all(isinstance(s, str) for s in body["stop"]):
        raise ProtocolError("sampling field 'stop' must hold strings")
    if not _all_ints(body["stop_token_ids"]):
        raise ProtocolError("sampling field 'stop_token_ids' must hold ints")


def _check_type(what: str, value: Any, types: tuple[type, ...]) -> None:
    is_bool = isinstance(value, bool) and bool not in types
    if not isinstance(value, types) or is_bool:
        raise ProtocolError(f"{what} has type {type(value).__name__}")


def _all_ints(values: list[Any]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in values)


def encode(msg: Message) -> bytes:
    body = _fields_of(msg)
    if isinstance(msg, GenerateRequest):
        body["sampling"] = encode_sampling(msg.sampling)
    body["kind"] = msg.KIND
    body["v"] = PROTOCOL_VERSION
    return bytes(msgpack.packb(body, use_bin_type=True, default=_nested))


def _fields_of(obj: Any) -> dict[str, Any]:
    """A dataclass's fields by name, as they are (dataclasses.asdict, which deep-copies every
    value, took most of a token event's encoding)."""
    cls: type = type(obj)
    return {name: getattr(obj, name) for name in _field_names(cls)}


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def _nested(value: Any) -> Any:
    """msgpack's hook for what it cannot pack itself: a dataclass inside a message (ErrorInfo)
    as the map asdict makes of it."""
    if is_dataclass(value) and not isinstance(value, type):
        return _fields_of(value)
    raise TypeError(f"cannot encode {type(value).__name__} in a message")


def decode(data: bytes) -> Message:
    """The message `encode` wrote; ProtocolError (and nothing else) for any other bytes."""
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated exception types
        raise ProtocolError(f"not a msgpack message: {e}", "not_msgpack") from e
    if not isinstance(body, dict):
        raise ProtocolError("a message is a msgpack map")
    if body.pop("v", None) != PROTOCOL_VERSION:
        raise ProtocolError(
            f"unsupported protocol version (expected {PROTOCOL_VERSION})", "version"
        )
    try:
        return _message(body)
    except ProtocolError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        # The checks above are meant to leave nothing for the constructors to trip on; a
        # message that still gets this far is refused like any other malformed one.
        raise ProtocolError(f"bad message: {e}") from e


def _message(body: dict[Any, Any]) -> Message:
    """The message of a map of this protocol version (its "v" taken out)."""
    kind = body.pop("kind", None)
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r}")
    _check_fields(str(kind), body)
    if cls is TokenEvent and body.get("error") is not None:
        body["error"] = _error_info(body["error"])
    if cls is GenerateRequest and "sampling" in body:
        body["sampling"] = decode_sampling(body["sampling"])
    try:
        return cls(**body)
    except TypeError as e:
        raise ProtocolError(f"bad {kind} message: {e}") from e


def _check_fields(kind: str, body: dict[str, Any]) -> None:
    types = _FIELD_TYPES[kind]
    unknown = set(body) - set(types)
    if unknown:
        raise ProtocolError(f"{kind} message has unknown fields {sorted(unknown, key=repr)}")
    for name, value in body.items():
        _check_type(f"{kind} message field {name!r}", value, types[name])
    for name in ("prompt_token_ids", "token_ids"):
        if name in body and not _all_ints(body[name]):
            raise ProtocolError(f"{kind} message field {name!r} must hold ints")
    if kind in ("token", "generate"):
        _check_by_source(kind, body.get("cached_tokens_by_source") or {})
    if kind == "admin":
        _check_admin(body)
    elif kind == "token":
        _check_token(body)
    elif kind == "worker_info":
        _check_worker_info(body)
    elif kind == "kv":
        _check_kv(body)


def _check_by_source(kind: str, by_source: dict[Any, Any]) -> None:
    if not all(isinstance(k, str) for k in by_source) or not _all_ints(list(by_source.values())):
        raise ProtocolError(f"{kind} message cached_tokens_by_source must map str to int")


def _check_token(body: dict[str, Any]) -> None:
    """What a gateway reads inside a token event: an index that can be a completion's, numbers
    for logprobs, [token id, logprob] pairs for the alternatives, string keys for `info`."""
    if body.get("index", 0) < 0:
        raise ProtocolError("token event index must be >= 0")
    if not all(_is_number(v) for v in body.get("logprobs", [])):
        raise ProtocolError("token event logprobs must hold numbers")
    for top in body.get("top_logprobs", []):
        if not isinstance(top, list) or not all(map(_is_pair, top)):
            raise ProtocolError("token event top_logprobs must hold [token id, logprob] pairs")
    if not all(isinstance(k, str) for k in body.get("info") or {}):
        raise ProtocolError("token event info must have string keys")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_pair(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) == 2
        and _all_ints(value[:1])
        and _is_number(value[1])
    )


def _check_worker_info(body: dict[str, Any]) -> None:
    if body.get("role") not in WorkerInfo.ROLES:
        raise ProtocolError(f"worker_info role must be one of {WorkerInfo.ROLES}")
    if body.get("block_size", 1) < 1:  # a router divides by it
        raise ProtocolError("worker_info block_size must be >= 1")


def _check_kv(body: dict[str, Any]) -> None:
    if body.get("op") not in KVEvent.OPS:
        raise ProtocolError(f"kv event op must be one of {KVEvent.OPS}")
    if not all(isinstance(h, bytes) for h in body.get("block_hashes", [])):
        raise ProtocolError("kv event block_hashes must hold bytes")


def _check_admin(body: dict[str, Any]) -> None:
    if body.get("op") not in AdminRequest.OPS:
        raise ProtocolError(f"admin message op must be one of {AdminRequest.OPS}")
    for p in body.get("prefixes", []):
        ok = (
            isinstance(p, dict)
            and set(p) <= {"token_ids", "cache_salt"}
            and isinstance(p.get("token_ids"), list)
            and _all_ints(p["token_ids"])
            and isinstance(p.get("cache_salt"), str | None)
        )
        if not ok:
            raise ProtocolError("admin message prefixes must be {token_ids, cache_salt} maps")


def _error_info(raw: dict[str, Any]) -> ErrorInfo:
    names = {f.name for f in fields(ErrorInfo)}
    if (
        not isinstance(raw.get("message"), str)
        or set(raw) - names
        or not all(isinstance(raw.get(k), str | None) for k in ("type", "param", "code"))
    ):
        raise ProtocolError("bad error in token event")
    return ErrorInfo(**raw)
