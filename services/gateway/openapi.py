"""The OpenAPI 3.1 description of the gateway, built from the same route table the app
registers, so every route is described (a test checks the two agree)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ERROR_SCHEMA = {
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

_USAGE = {
    "type": "object",
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {
            "type": "object",
            "properties": {
                "cached_tokens": {"type": "integer"},
                "cached_tokens_by_tier": {
                    "type": "object",
                    "description": "kvserve extension: cached_tokens by the tier they came "
                    "from (device cache, host-RAM tier, prefix store); they sum to cached_tokens "
                    "where the worker reports tiers (see docs/api.md)",
                    "properties": {
                        "device": {"type": "integer"},
                        "host": {"type": "integer"},
                        "store": {"type": "integer"},
                    },
                },
            },
        },
    },
}

_SAMPLING = {
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "default": 1.0},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "description": "vLLM extension; 0 or -1: off"},
    "n": {"type": "integer", "minimum": 1, "maximum": 16},
    "seed": {"type": "integer", "minimum": 0},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "stop_token_ids": {"type": "array", "items": {"type": "integer"}},
    "ignore_eos": {"type": "boolean"},
    "stream": {"type": "boolean"},
    "stream_options": {
        "type": "object",
        "properties": {"include_usage": {"type": "boolean"}},
    },
    "cache_salt": {
        "type": "string",
        "description": "narrows the prefix-cache partition (see docs/api.md)",
    },
    "return_tokens_as_token_ids": {
        "type": "boolean",
        "description": "vLLM extension: logprobs name tokens 'token_id:{id}'",
    },
}

COMPLETION_REQUEST = {
    "type": "object",
    "required": ["prompt"],
    "properties": {
        "model": {"type": "string"},
        "prompt": {
            "oneOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}},
                {"type": "array", "items": {"type": "integer"}},
                {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
            ]
        },
        "logprobs": {"type": "integer", "enum": [0]},
        **_SAMPLING,
    },
}

CHAT_REQUEST = {
    "type": "object",
    "required": ["messages"],
    "properties": {
        "model": {"type": "string"},
        "messages": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["role"],
                "properties": {
                    "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
                    "content": {"oneOf": [{"type": "string"}, {"type": "array"}]},
                },
            },
        },
        "max_completion_tokens": {"type": "integer", "minimum": 1},
        "logprobs": {"type": "boolean"},
        "top_logprobs": {"type": "integer", "enum": [0]},
        **_SAMPLING,
    },
}

COMPLETION_RESPONSE = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "object": {"enum": ["text_completion", "chat.completion"]},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {"type": "array", "items": {"type": "object"}},
        "usage": _USAGE,
    },
}

_OBJ = {"type": "object"}


@dataclass(frozen=True)
class RouteDoc:
    method: str
    path: str
    summary: str
    request: dict[str, Any] | None = None
    response: dict[str, Any] = field(default_factory=lambda: _OBJ)
    content_type: str = "application/json"
    stream: bool = False  # may answer with text/event-stream
    auth: bool = False  # needs the bearer key when keys are configured
    errors: tuple[int, ...] = ()


def build_openapi(routes: list[RouteDoc], title: str, version: str) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for r in routes:
        op: dict[str, Any] = {
            "summary": r.summary,
            "operationId": _operation_id(r),
            "responses": {"200": {"description": "OK", "content": _content(r)}},
        }
        if r.request is not None:
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": r.request}},
            }
        for status in r.errors:
            op["responses"][str(status)] = {
                "description": _REASONS.get(status, "error"),
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
            }
        if r.auth:
            op["security"] = [{"bearer": []}, {}]
        paths.setdefault(r.path, {})[r.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {
            "schemas": {"Error": ERROR_SCHEMA},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def _content(r: RouteDoc) -> dict[str, Any]:
    content = {r.content_type: {"schema": r.response}}
    if r.stream:
        content["text/event-stream"] = {
            "schema": {"type": "string", "description": "`data: {chunk}` events, `data: [DONE]`"}
        }
    return content


def _operation_id(r: RouteDoc) -> str:
    name = r.path.strip("/").replace("/", "_").replace(".", "_").replace("{", "").replace("}", "")
    return f"{r.method.lower()}_{name or 'root'}"


_REASONS = {
    400: "Invalid request",
    401: "Missing or invalid API key",
    404: "Unknown model or route",
    413: "Request body too large",
    429: "Too many requests",
    500: "Internal error",
    503: "Overloaded, draining or not ready (see Retry-After)",
    504: "Request deadline passed",
}
