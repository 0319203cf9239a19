"""A stand-in for an OpenTelemetry collector in tests and CI: an OTLP/HTTP trace receiver that
records the spans it is sent, in memory, and exports nothing. (No collector image can be pulled
on the CI machines; this runs from the project's own image.)

    python -m kvserve.services.bench.lib.otlp_sink --host 0.0.0.0 --port 4318 [--max-spans N]

- `POST /v1/traces`: an ExportTraceServiceRequest in protobuf (application/x-protobuf) or in
  OTLP's JSON encoding (application/json: ids in hex); a gzip body is inflated by aiohttp. The
  answer is 200 with an empty ExportTraceServiceResponse in the request's encoding, as a
  collector's. A body that does not decode, or a span whose ids have the wrong size, is 400 with
  a one-line message, and nothing of that request is recorded; another Content-Type is 415.
- `GET /spans[?trace_id=HEX]`: `{"spans": [...]}`, oldest first, each with trace_id, span_id,
  parent_span_id (hex; "" for a root), name, service_name (the resource's `service.name`),
  start_time_unix_nano, end_time_unix_nano and attributes (a flat dict of JSON values).
- `DELETE /spans`: forget every span and the drop count.
- `GET /health`: 200, `{"status": "ok", "spans": N, "dropped": D}`.

Memory is bounded: the newest `--max-spans` spans are kept; older ones are dropped and counted.
Once listening it logs `{"event": "ready", "url": ...}` to stderr (process.LogReady).
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from collections import deque
from collections.abc import Iterable
from typing import Any

from aiohttp import web
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

MAX_SPANS = 100_000
MAX_BODY = 32 * 1024 * 1024
PROTOBUF = ("application/x-protobuf", "application/protobuf")


class BadRequest(ValueError):
    """A body that is not a valid ExportTraceServiceRequest; the message is the 400's text."""


class Spans:
    """The newest `max_spans` spans received, and how many older ones were dropped."""

    def __init__(self, max_spans: int = MAX_SPANS) -> None:
        self.kept: deque[dict[str, Any]] = deque(maxlen=max_spans)
        self.dropped = 0

    def add(self, spans: Iterable[dict[str, Any]]) -> None:
        for span in spans:
            if len(self.kept) == self.kept.maxlen:
                self.dropped += 1  # append pushes the oldest out
            self.kept.append(span)

    def clear(self) -> None:
        self.kept.clear()
        self.dropped = 0


def value(v: AnyValue) -> Any:
    """An attribute value as JSON: str, bool, int, float, or a list of them (the SDK's kinds);
    OTLP's others too: a key-value list as a dict, bytes as hex, no value as None."""
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: value(kv.value) for kv in v.kvlist_value.values}
    if kind == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, kind) if kind else None


def spans_of(req: ExportTraceServiceRequest) -> list[dict[str, Any]]:
    """The request's spans as records; BadRequest (and none of them) if an id is malformed."""
    out = []
    for rs in req.resource_spans:
        resource = {kv.key: value(kv.value) for kv in rs.resource.attributes}
        for span in (span for ss in rs.scope_spans for span in ss.spans):
            if len(span.trace_id) != 16 or len(span.span_id) != 8:
                raise BadRequest(f"span {span.name!r}: a trace id is 16 bytes, a span id 8")
            if len(span.parent_span_id) not in (0, 8):
                raise BadRequest(f"span {span.name!r}: a parent span id is 8 bytes or none")
            out.append(
                {
                    "trace_id": span.trace_id.hex(),
                    "span_id": span.span_id.hex(),
                    "parent_span_id": span.parent_span_id.hex(),
                    "name": span.name,
                    "service_name": str(resource.get("service.name") or ""),
                    "start_time_unix_nano": span.start_time_unix_nano,
                    "end_time_unix_nano": span.end_time_unix_nano,
                    "attributes": {kv.key: value(kv.value) for kv in span.attributes},
                }
            )
    return out


def parse_protobuf(body: bytes) -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    try:
        req.ParseFromString(body)
    except DecodeError as exc:
        raise BadRequest(f"not a protobuf ExportTraceServiceRequest: {exc}") from None
    return req


def parse_json(body: bytes) -> ExportTraceServiceRequest:
    """OTLP JSON: protobuf's JSON mapping, except that ids are hex where it expects base64."""
    try:
        doc = json.loads(body)
        for rs in doc.get("resourceSpans", []):
            for span in (span for ss in rs.get("scopeSpans", []) for span in ss.get("spans", [])):
                for obj in [span, *span.get("links", [])]:
                    for key in ("traceId", "spanId", "parentSpanId"):
                        if obj.get(key):
                            obj[key] = base64.b64encode(bytes.fromhex(obj[key])).decode()
        return json_format.ParseDict(doc, ExportTraceServiceRequest(), ignore_unknown_fields=True)
    except (ValueError, TypeError, AttributeError, json_format.ParseError) as exc:
        raise BadRequest(f"not an OTLP JSON ExportTraceServiceRequest: {exc}") from None


def make_app(spans: Spans) -> web.Application:
    async def export(request: web.Request) -> web.Response:
        ctype = request.content_type
        if ctype != "application/json" and ctype not in PROTOBUF:
            return web.Response(status=415, text=f"unsupported Content-Type {ctype!r}\n")
        try:
            body = await request.read()
            req = parse_json(body) if ctype == "application/json" else parse_protobuf(body)
            received = spans_of(req)
        except (BadRequest, web.RequestPayloadError) as exc:  # the latter: a broken gzip body
            return web.Response(status=400, text=" ".join(str(exc).split()) + "\n")
        spans.add(received)
        if ctype == "application/json":
            return web.json_response({})
        reply = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=reply, content_type="application/x-protobuf")

    async def get_spans(request: web.Request) -> web.Response:
        trace_id = request.query.get("trace_id", "").lower()
        found = [s for s in spans.kept if not trace_id or s["trace_id"] == trace_id]
        return web.json_response({"spans": found})

    async def delete_spans(_: web.Request) -> web.Response:
        spans.clear()
        return web.json_response({"status": "ok"})

    async def health(_: web.Request) -> web.Response:
        return web.json_response(
            {"status": "ok", "spans": len(spans.kept), "dropped": spans.dropped}
        )

    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_post("/v1/traces", export)
    app.router.add_get("/spans", get_spans)
    app.router.add_delete("/spans", delete_spans)
    app.router.add_get("/health", health)
    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvserve.services.bench.lib.otlp_sink")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=4318)
    p.add_argument("--max-spans", type=int, default=MAX_SPANS, help="spans kept in memory")
    args = p.parse_args(argv)
    ready = json.dumps({"event": "ready", "url": f"http://{args.host}:{args.port}"})

    def log_ready(*_: object) -> None:  # run_app calls `print` once every site is listening
        print(ready, file=sys.stderr, flush=True)

    web.run_app(make_app(Spans(args.max_spans)), host=args.host, port=args.port, print=log_ready)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
