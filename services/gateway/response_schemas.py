"""The response bodies' JSON schemas, as the OpenAPI document (openapi.py) describes them:
each names the fields the handlers always write as required."""

from __future__ import annotations

from kvserve.services.gateway.request_schemas import Schema

_INT = {"type": "integer"}
_STR = {"type": "string"}


def _object(required: Schema, optional: Schema | None = None) -> Schema:
    """An object with the properties in `required` (each required) and those in `optional`."""
    return {
        "type": "object",
        "required": [*required],
        "properties": {**required, **(optional or {})},
    }


_USAGE = _object(
    {
        "prompt_tokens": _INT,
        "completion_tokens": _INT,
        "total_tokens": _INT,
        "prompt_tokens_details": _object(
            {"cached_tokens": _INT},
            {
                "cached_tokens_by_tier": {
                    "type": "object",
                    "description": "kvserve extension: cached_tokens by the tier they came "
                    "from (device cache, host-RAM tier, prefix store); they sum to "
                    "cached_tokens where the worker reports tiers (see docs/api.md)",
                    "properties": {"device": _INT, "host": _INT, "store": _INT},
                },
            },
        ),
    }
)

_FINISH = {"type": ["string", "null"]}
_LOGPROBS = {"type": ["object", "null"]}


def _completion_response(kind: str, choice: Schema) -> Schema:
    return _object(
        {
            "id": _STR,
            "object": {"const": kind},
            "created": _INT,
            "model": _STR,
            "choices": {"type": "array", "items": choice},
            "usage": _USAGE,
        }
    )


COMPLETION_RESPONSE = _completion_response(
    "text_completion",
    _object({"index": _INT, "text": _STR, "logprobs": _LOGPROBS, "finish_reason": _FINISH}),
)

CHAT_RESPONSE = _completion_response(
    "chat.completion",
    _object(
        {
            "index": _INT,
            "message": _object({"role": {"const": "assistant"}, "content": _STR}),
            "logprobs": _LOGPROBS,
            "finish_reason": _FINISH,
        }
    ),
)

MODEL_CARD = _object(
    {
        "id": _STR,
        "object": {"const": "model"},
        "created": _INT,
        "owned_by": _STR,
        "root": _STR,
        "parent": {"type": "null"},
        "max_model_len": _INT,
    }
)

MODEL_LIST = _object({"object": {"const": "list"}, "data": {"type": "array", "items": MODEL_CARD}})

CACHE_STATS = _object(
    {
        "object": {"const": "cache.stats"},
        "gateway": _object(
            {
                "in_flight": _INT,
                "max_in_flight": _INT,
                "draining": {"type": "boolean"},
                "bus_dropped": {"type": "object"},
            }
        ),
        "totals": {"type": "object"},
        "workers": {"type": "object"},
        "router": {"type": ["object", "null"]},
    }
)

_WARMUP = {
    "id": _STR,
    "object": {"const": "cache.warmup"},
    "status": {"enum": ["running", "completed", "failed"]},
    "total": _INT,
}
WARMUP_STARTED = _object(_WARMUP)
WARMUP_JOB = _object(
    {**_WARMUP, "done": _INT, "blocks": _INT, "computed": _INT, "skipped": _INT, "published": _INT},
    {"error": _STR},
)

CACHE_FLUSH = _object(
    {
        "object": {"const": "cache.flush"},
        "flushed": {"const": True},
        "workers": {"type": "array", "items": _STR},
        "device_blocks": _INT,
        "host_blocks": _INT,
    }
)

TOKENIZE_RESPONSE = _object(
    {"count": _INT, "max_model_len": _INT, "tokens": {"type": "array", "items": _INT}},
    {"token_strs": {"type": "array", "items": {"type": ["string", "null"]}}},
)

DETOKENIZE_RESPONSE = _object({"prompt": _STR})
HEALTH_RESPONSE = _object({"status": {"const": "ok"}})
READY_RESPONSE = _object({"status": {"const": "ready"}})
NOT_READY_RESPONSE = _object({"status": {"enum": ["starting", "draining", "bus_unavailable"]}})
VERSION_RESPONSE = _object({"version": _STR, "model": _STR})

# One server-sent event (OpenAPI before 3.2: a stream's `schema` describes each event).
SSE_EVENT = _object(
    {
        "data": {
            "type": "string",
            "description": "a chunk (JSON), an error (JSON, OpenAI's shape; the stream ends "
            "after it) or `[DONE]`, the last event",
        }
    },
    {"event": _STR, "id": _STR},
)
