"""The OpenAPI 3.1 description of the gateway, built from the same route table the app
registers, so every route is described (a test checks the two agree).

The document says what the server does: every request schema accepts exactly what the
validation in `schema.py`, `prefixes.py` and the handlers accepts (types, ranges, required
fields, null where null means "absent"), so a schema fuzzer (tests/services/test_schema_fuzz.py)
finds no valid request that is refused and no invalid one that is served. What depends on how
the server runs (the served model's names, its context window and vocabulary, API keys, whether
clients may send a cache salt) comes in `ApiFacts`. One thing no schema can say: the prompt plus
`max_tokens` must fit in the context window (400 `context_length_exceeded`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kvserve.services.gateway.auth import key_salt
from kvserve.services.gateway.schema import (
    CHAT_ROLES,
    MAX_COMPLETION_LOGPROBS,
    MAX_N,
    MAX_SEED,
    ModelInfo,
)
from kvserve.shared.sampling_params import MAX_TOP
from kvserve.shared.store.hashing import MAX_SALT_LEN

Schema = dict[str, Any]

ERROR_SCHEMA: Schema = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

SALT_CHARS = "A-Za-z0-9._:-"


@dataclass(frozen=True)
class ApiFacts:
    """What the document says that depends on how the server runs."""

    model_names: tuple[str, ...]  # the served name first, then the aliases it also accepts
    max_model_len: int
    vocab_size: int
    api_keys: bool = False  # the /v1 routes need `Authorization: Bearer KEY`
    # The longest `cache_salt` a client may send (the key's salt takes part of the limit);
    # None: a client's salt is refused (API keys without --allow-client-cache-salt).
    max_client_salt: int | None = MAX_SALT_LEN

    @classmethod
    def of(cls, model: ModelInfo, api_keys: bool, allow_client_salt: bool) -> ApiFacts:
        key_salt_len = len(key_salt("")) + 1  # a client's salt follows "{key salt}."
        if not api_keys:
            salt: int | None = MAX_SALT_LEN
        elif allow_client_salt:
            salt = MAX_SALT_LEN - key_salt_len
        else:
            salt = None
        names = (model.name, *sorted(model.aliases))
        return cls(names, model.max_model_len, model.vocab_size, api_keys, salt)


# ---- building blocks ---------------------------------------------------------------------------


def _nullable(schema: Schema) -> Schema:
    """`schema` or null: the server reads a null field as an absent one."""
    return {"anyOf": [schema, {"type": "null"}]}


_BOOL = _nullable({"type": "boolean"})


def model_schema(f: ApiFacts) -> Schema:
    return {"enum": [*f.model_names], "description": "the served model (404 for another)"}


def _token(f: ApiFacts) -> Schema:
    return {"type": "integer", "minimum": 0, "maximum": f.vocab_size - 1}


def _max_tokens(f: ApiFacts) -> Schema:
    return _nullable(
        {
            "type": "integer",
            "minimum": 1,
            "maximum": f.max_model_len - 1,
            "description": "the prompt plus max_tokens must fit in the context window",
        }
    )


def _cache_salt(f: ApiFacts) -> Schema:
    if f.max_client_salt is None:
        return {
            "type": "null",
            "description": "set by the server from the API key; a client's own is refused "
            "unless the server runs with --allow-client-cache-salt",
        }
    return _nullable(
        {
            "type": "string",
            "minLength": 1,
            "maxLength": f.max_client_salt,
            "pattern": f"^[{SALT_CHARS}]+$",
            "description": "narrows the prefix-cache partition (see docs/api.md)",
        }
    )


_STOP_STRING = {"type": "string", "minLength": 1}

TEXT_PART: Schema = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}

CHAT_MESSAGE: Schema = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": [*CHAT_ROLES]},
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": TEXT_PART},
                {"type": "null"},
            ]
        },
    },
}

# A warm-up prefix's messages go through the chat template as they are: string content only.
PREFIX_MESSAGE: Schema = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {"role": {"enum": [*CHAT_ROLES]}, "content": {"type": "string"}},
}


def _requires_when_set(name: str, other: str, value: Any) -> Schema:
    """A `dependentSchemas` entry: a non-null `name` needs `other` == `value`."""
    return {
        name: {
            "anyOf": [
                {"properties": {name: {"type": "null"}}},
                {"required": [other], "properties": {other: {"const": value}}},
            ]
        }
    }


def _sampling(f: ApiFacts) -> Schema:
    return {
        "model": _nullable(model_schema(f)),
        "max_tokens": _max_tokens(f),
        "temperature": _nullable({"type": "number", "minimum": 0}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _nullable(
            {"type": "integer", "minimum": -1, "description": "vLLM extension; 0 or -1: off"}
        ),
        "n": _nullable({"type": "integer", "minimum": 1, "maximum": MAX_N}),
        "seed": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_SEED}),
        "stop": _nullable(
            {"anyOf": [_STOP_STRING, {"type": "array", "items": _STOP_STRING}]},
        ),
        "stop_token_ids": _nullable({"type": "array", "items": _token(f)}),
        "ignore_eos": _BOOL,
        "skip_special_tokens": _BOOL,
        "stream": _BOOL,
        "stream_options": _nullable(
            {
                "type": "object",
                "description": "only with stream: true",
                "properties": {"include_usage": {"type": "boolean"}},
            }
        ),
        "cache_salt": _cache_salt(f),
        "return_tokens_as_token_ids": {
            **_BOOL,
            "description": "vLLM extension: logprobs name tokens 'token_id:{id}'",
        },
    }


# ---- request bodies ----------------------------------------------------------------------------


def completion_request(f: ApiFacts) -> Schema:
    token_ids = {"type": "array", "minItems": 1, "items": _token(f)}
    return {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            "prompt": {
                "oneOf": [
                    {"type": "string", "minLength": 1},
                    {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
                    token_ids,
                    {"type": "array", "minItems": 1, "items": token_ids},
                ]
            },
            "logprobs": _nullable(
                {"type": "integer", "minimum": 0, "maximum": MAX_COMPLETION_LOGPROBS}
            ),
            **_sampling(f),
        },
        "dependentSchemas": _requires_when_set("stream_options", "stream", True),
    }


def chat_request(f: ApiFacts) -> Schema:
    return {
        "type": "object",
        "required": ["messages"],
        "properties": {
            "messages": {"type": "array", "minItems": 1, "items": CHAT_MESSAGE},
            "max_completion_tokens": _max_tokens(f),
            "logprobs": _BOOL,
            "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP}),
            "add_generation_prompt": _BOOL,
            "response_format": _nullable(
                {
                    "type": "object",
                    "required": ["type"],
                    "properties": {"type": {"const": "text"}},
                }
            ),
            **_sampling(f),
        },
        "dependentSchemas": {
            **_requires_when_set("stream_options", "stream", True),
            **_requires_when_set("top_logprobs", "logprobs", True),
        },
    }


def tokenize_request(f: ApiFacts) -> Schema:
    return {
        "type": "object",
        "description": "exactly one of prompt, messages",
        "properties": {
            "model": _nullable(model_schema(f)),
            "prompt": {"type": "string"},
            "messages": {"type": "array", "minItems": 1, "items": CHAT_MESSAGE},
            "add_generation_prompt": _BOOL,
            "return_token_strs": _BOOL,
        },
        "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}],
    }


def detokenize_request(f: ApiFacts) -> Schema:
    return {
        "type": "object",
        "required": ["tokens"],
        "properties": {
            "model": _nullable(model_schema(f)),
            "tokens": {"type": "array", "items": _token(f)},
        },
    }


def warmup_request(f: ApiFacts) -> Schema:
    prefix = {
        "type": "object",
        "description": "exactly one of system, text, messages; optional cache_salt",
        "properties": {
            "system": {"type": "string", "minLength": 1},
            "text": {"type": "string", "minLength": 1},
            "messages": {"type": "array", "minItems": 1, "items": PREFIX_MESSAGE},
            "cache_salt": _cache_salt(f),
        },
        "oneOf": [{"required": [k]} for k in ("system", "text", "messages")],
    }
    return {
        "type": "object",
        "required": ["prefixes"],
        "properties": {"prefixes": {"type": "array", "minItems": 1, "items": prefix}},
    }


# ---- responses ---------------------------------------------------------------------------------

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
            {"in_flight": _INT, "max_in_flight": _INT, "draining": {"type": "boolean"}}
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
_OBJ: Schema = {"type": "object"}

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


# ---- the document ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RouteDoc:
    method: str
    path: str
    summary: str
    request: Schema | None = None
    response: Schema = field(default_factory=lambda: _OBJ)
    content_type: str = "application/json"
    status: int = 200  # the success status
    stream: bool = False  # may answer with text/event-stream
    auth: bool = False  # needs the bearer key when keys are configured
    errors: tuple[int, ...] = ()  # statuses answered with an OpenAI error body
    path_params: dict[str, Schema] = field(default_factory=dict)  # default: any string
    other: dict[int, Schema] = field(default_factory=dict)  # statuses with a body of their own


def build_openapi(routes: list[RouteDoc], title: str, version: str, facts: ApiFacts) -> Schema:
    paths: dict[str, dict[str, Any]] = {}
    for r in routes:
        op: dict[str, Any] = {
            "summary": r.summary,
            "operationId": _operation_id(r),
            "responses": {
                str(r.status): {"description": _REASONS.get(r.status, "OK"), "content": _content(r)}
            },
        }
        params = _path_parameters(r)
        if params:
            op["parameters"] = params
        if r.request is not None:
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": r.request}},
            }
        errors = [s for s in r.errors if s != 401 or (r.auth and facts.api_keys)]
        for status in errors:
            op["responses"][str(status)] = {
                "description": _REASONS.get(status, "error"),
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
            }
        for status, schema in r.other.items():
            op["responses"][str(status)] = {
                "description": _REASONS.get(status, "error"),
                "content": {"application/json": {"schema": schema}},
            }
        if r.auth and facts.api_keys:
            op["security"] = [{"bearer": []}]
        paths.setdefault(r.path, {})[r.method.lower()] = op
    components: dict[str, Any] = {"schemas": {"Error": ERROR_SCHEMA}}
    if facts.api_keys:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": components,
    }


def _path_parameters(r: RouteDoc) -> list[Schema]:
    return [
        {
            "name": name,
            "in": "path",
            "required": True,
            "schema": r.path_params.get(name, {"type": "string", "minLength": 1}),
        }
        for name in re.findall(r"{(\w+)}", r.path)
    ]


def _content(r: RouteDoc) -> Schema:
    content = {r.content_type: {"schema": r.response}}
    if r.stream:
        content["text/event-stream"] = {"schema": SSE_EVENT}
    return content


def _operation_id(r: RouteDoc) -> str:
    name = r.path.strip("/").replace("/", "_").replace(".", "_").replace("{", "").replace("}", "")
    return f"{r.method.lower()}_{name or 'root'}"


_REASONS = {
    200: "OK",
    202: "Accepted",
    400: "Invalid request",
    401: "Missing or invalid API key",
    404: "Unknown model or resource",
    413: "Request body too large",
    429: "Too many requests",
    500: "Internal error",
    503: "Overloaded, draining or not ready (see Retry-After)",
    504: "Request deadline passed",
}
