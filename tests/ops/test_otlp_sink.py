"""The OTLP/HTTP trace sink (kvserve.services.bench.lib.otlp_sink), run as compose runs it
(`python -m ...` in a process of its own): spans sent by the real OpenTelemetry SDK and OTLP/HTTP
exporter, in protobuf plain and gzipped, and by hand in OTLP JSON, are recorded with their ids,
parentage, service name and attributes; a body that does not decode is 400 and records nothing;
DELETE /spans clears; the store keeps the newest spans and counts the ones it drops."""

from __future__ import annotations

import gzip
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from kvserve.services.bench.lib.http import Http
from kvserve.services.bench.lib.otlp_sink import Spans
from kvserve.services.bench.lib.process import ServerProcess, free_port
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

PROTOBUF = {"Content-Type": "application/x-protobuf"}


def request(*spans: Span) -> bytes:
    scope = ScopeSpans(spans=spans)
    return ExportTraceServiceRequest(
        resource_spans=[ResourceSpans(scope_spans=[scope])]
    ).SerializeToString()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    port = free_port()
    # -P: the repository root (the working directory) stays off sys.path.
    cmd = [sys.executable, "-P", "-m", "kvserve.services.bench.lib.otlp_sink", "--port", str(port)]
    with ServerProcess("otlp-sink", cmd) as proc:
        yield proc


@pytest.fixture
def sink(server: ServerProcess) -> Http:
    http = Http(server.url, timeout=10)
    assert http.request("DELETE", "/spans").status_code == 200
    return http


def recorded(sink: Http, query: str = "") -> list[dict[str, Any]]:
    reply = sink.get("/spans" + query)
    assert reply.status_code == 200
    spans = reply.json()["spans"]
    assert isinstance(spans, list)
    return spans


@pytest.mark.parametrize("compression", [Compression.NoCompression, Compression.Gzip])
def test_spans_from_the_sdk_exporter_are_recorded(
    server: ServerProcess, sink: Http, compression: Compression
) -> None:
    exporter = OTLPSpanExporter(endpoint=f"{server.url}/v1/traces", compression=compression)
    provider = TracerProvider(resource=Resource.create({"service.name": "sink-test"}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    tracer = provider.get_tracer("test_otlp_sink")
    with (
        tracer.start_as_current_span("parent", attributes={"kv.blocks": 3}) as parent,
        tracer.start_as_current_span("child") as child,
    ):
        child.set_attributes({"kv.hit": True, "kv.model": "tiny", "kv.ratio": 0.5})
        child.set_attribute("kv.layers", [1, 2])
    try:
        assert provider.force_flush(10_000)
    finally:
        provider.shutdown()

    by_name = {s["name"]: s for s in recorded(sink)}
    assert set(by_name) == {"parent", "child"}
    p, c = by_name["parent"], by_name["child"]
    trace_id = f"{parent.get_span_context().trace_id:032x}"
    assert p["trace_id"] == c["trace_id"] == trace_id
    assert p["span_id"] == f"{parent.get_span_context().span_id:016x}"
    assert c["span_id"] == f"{child.get_span_context().span_id:016x}"
    assert p["parent_span_id"] == ""
    assert c["parent_span_id"] == p["span_id"]
    assert p["service_name"] == c["service_name"] == "sink-test"
    assert p["attributes"] == {"kv.blocks": 3}
    assert c["attributes"] == {
        "kv.hit": True,
        "kv.model": "tiny",
        "kv.ratio": 0.5,
        "kv.layers": [1, 2],
    }
    for span, sent in ((p, parent), (c, child)):
        assert isinstance(sent, ReadableSpan)
        assert span["start_time_unix_nano"] == sent.start_time
        assert span["end_time_unix_nano"] == sent.end_time
    assert recorded(sink, f"?trace_id={trace_id.upper()}") == recorded(sink)
    assert recorded(sink, "?trace_id=" + "0" * 32) == []
    assert sink.get("/health").json() == {"status": "ok", "spans": 2, "dropped": 0}


def test_otlp_json_is_recorded(sink: Http) -> None:
    span = {
        "traceId": "5b8efff798038103d269b633813fc60c",
        "spanId": "eee19b7ec3c1b174",
        "parentSpanId": "eee19b7ec3c1b173",
        "name": "from-json",
        "startTimeUnixNano": "1544712660000000000",
        "endTimeUnixNano": "1544712661000000000",
        "kind": 2,
        "attributes": [{"key": "http.status", "value": {"intValue": "200"}}],
    }
    resource = {"attributes": [{"key": "service.name", "value": {"stringValue": "json-svc"}}]}
    body = {"resourceSpans": [{"resource": resource, "scopeSpans": [{"spans": [span]}]}]}
    reply = sink.post("/v1/traces", json=body)
    assert (reply.status_code, reply.json()) == (200, {})
    assert recorded(sink) == [
        {
            "trace_id": "5b8efff798038103d269b633813fc60c",
            "span_id": "eee19b7ec3c1b174",
            "parent_span_id": "eee19b7ec3c1b173",
            "name": "from-json",
            "service_name": "json-svc",
            "start_time_unix_nano": 1544712660000000000,
            "end_time_unix_nano": 1544712661000000000,
            "attributes": {"http.status": 200},
        }
    ]


@pytest.mark.parametrize(
    ("headers", "body"),
    [
        (PROTOBUF, b"\xff\xff\xff\xff garbage"),
        ({**PROTOBUF, "Content-Encoding": "gzip"}, gzip.compress(b"\xff\xff\xff\xff garbage")),
        ({**PROTOBUF, "Content-Encoding": "gzip"}, b"not gzip at all"),
        # A valid span beside one whose trace id is 3 bytes: neither is recorded.
        (PROTOBUF, request(Span(trace_id=b"\1" * 16, span_id=b"\2" * 8), Span(trace_id=b"\3" * 3))),
        ({"Content-Type": "application/json"}, b'{"resourceSpans": [{"scopeSpans": 7}]}'),
        ({"Content-Type": "application/json"}, b"{not json"),
    ],
    ids=["garbage", "gzipped-garbage", "broken-gzip", "bad-trace-id", "json-shape", "not-json"],
)
def test_a_bad_body_is_400_and_records_nothing(
    sink: Http, headers: dict[str, str], body: bytes
) -> None:
    reply = sink.request("POST", "/v1/traces", content=body, headers=headers)
    assert reply.status_code == 400
    assert reply.text.strip() and len(reply.text.strip().splitlines()) == 1
    assert recorded(sink) == []
    assert sink.get("/health").status_code == 200


def test_an_unknown_content_type_is_415(sink: Http) -> None:
    reply = sink.request("POST", "/v1/traces", content=b"x", headers={"Content-Type": "text/plain"})
    assert reply.status_code == 415
    assert recorded(sink) == []


def test_delete_clears(sink: Http) -> None:
    body = {
        "resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "01" * 16, "spanId": "02" * 8}]}]}]
    }
    assert sink.post("/v1/traces", json=body).status_code == 200
    assert len(recorded(sink)) == 1
    assert sink.request("DELETE", "/spans").status_code == 200
    assert recorded(sink) == []
    assert sink.get("/health").json() == {"status": "ok", "spans": 0, "dropped": 0}


def test_the_store_keeps_the_newest_spans_and_counts_drops() -> None:
    spans = Spans(max_spans=3)
    spans.add({"name": str(i)} for i in range(5))
    assert [s["name"] for s in spans.kept] == ["2", "3", "4"]
    assert spans.dropped == 2
    spans.clear()
    assert (list(spans.kept), spans.dropped) == ([], 0)
