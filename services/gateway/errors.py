"""API errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

`type` follows OpenAI's names (invalid_request_error, authentication_error, not_found_error,
rate_limit_error, server_error, timeout); `code` is a short machine-readable string or null;
`param` names the offending request field or is null.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from kvserve.shared.protocol import ErrorInfo


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unsupported(param: str, message: str) -> APIError:
    return APIError(400, message, "invalid_request_error", param, "unsupported_parameter")


# Worker-reported error types -> HTTP status when the error arrives before any output.
_STATUS_BY_TYPE = {
    "invalid_request_error": 400,
    "timeout": 504,
    "cancelled": 503,
    "server_error": 500,
}


def from_worker(info: ErrorInfo) -> APIError:
    return APIError(
        _STATUS_BY_TYPE.get(info.type, 500), info.message, info.type, info.param, info.code
    )


def sse_error(err: APIError) -> bytes:
    """A stream that fails mid-way: this event, then `data: [DONE]`."""
    return b"data: " + json.dumps(err.body()).encode() + b"\n\n"
