"""The OpenAPI 3.1 description of the gateway, built from the same route table the app
registers, so every route is described (a test checks the two agree).

The document says what the server does: the request schemas (request_schemas.py) accept exactly
what the server's validation accepts, the response schemas (response_schemas.py) name what the
handlers write, and the error statuses of each route answer with OpenAI's error body. What
depends on how the server runs comes in `ApiFacts`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kvserve.services.gateway.request_schemas import ApiFacts, Schema
from kvserve.services.gateway.response_schemas import SSE_EVENT

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

_OBJ: Schema = {"type": "object"}


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
