"""Plain synchronous HTTP calls (urllib) for what an OpenAI client does not cover: a server's
readiness, its cache stats, admin endpoints. No third-party client, no torch.

`Http.request` answers every HTTP status as a `Reply` (4xx and 5xx included); a server that is
not listening raises OSError (urllib's URLError is one).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


class Reply:
    """One HTTP answer: status, headers, body (as `requests` names them)."""

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status_code = status
        self.headers = headers
        self.content = body

    @property
    def text(self) -> str:
        return self.content.decode()

    def json(self) -> Any:
        return json.loads(self.content)


class Http:
    """Calls to one server root, each with the same headers and timeout."""

    def __init__(
        self, base_url: str, headers: dict[str, str] | None = None, timeout: float = 60.0
    ) -> None:
        self.base_url = base_url
        self.headers = headers or {}
        self.timeout = timeout

    def request(self, method: str, path: str, json_body: Any = None, **kw: Any) -> Reply:
        """`json_body` sent as JSON, or `content=` bytes as they are (neither: no body);
        `headers=` added to the client's."""
        content: bytes | None = kw.get("content")
        data = content if json_body is None else json.dumps(json_body).encode()
        hdrs = {**self.headers, **kw.get("headers", {})}
        if json_body is not None:
            hdrs.setdefault("Content-Type", "application/json")
        req = urllib.request.Request(self.base_url + path, data, hdrs, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return Reply(r.status, dict(r.headers), r.read())
        except urllib.error.HTTPError as e:
            return Reply(e.code, dict(e.headers), e.read())

    def get(self, path: str, **kw: Any) -> Reply:
        return self.request("GET", path, **kw)

    def post(self, path: str, json: Any = None, **kw: Any) -> Reply:
        return self.request("POST", path, json_body=json, **kw)


def gateway_stats(base_url: str) -> dict[str, Any]:
    """A kvserve gateway's GET /v1/cache/stats; {} when it does not answer with a JSON object."""
    try:
        reply = Http(base_url, timeout=10).get("/v1/cache/stats")
        stats = reply.json() if reply.status_code == 200 else {}
    except (OSError, ValueError):
        return {}
    return stats if isinstance(stats, dict) else {}
