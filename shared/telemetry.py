"""Tracing, logging and metrics set-up, shared by the gateway and the workers. No torch.

- Logs: structlog, one JSON object per line on stderr; `request_id` is bound per request
  (contextvars) and `trace_id`/`span_id` are added from the current OpenTelemetry span.
- Traces: `configure_tracing(service)` installs a TracerProvider once per process: an OTLP/HTTP
  exporter when OTEL_EXPORTER_OTLP_ENDPOINT is set, a JSON-lines file exporter when
  KVSERVE_TRACE_FILE is set (spans written as they end: for tests), a console exporter when
  KVSERVE_TRACE_CONSOLE=1. The W3C `traceparent` crosses the bus inside the messages.
- Metrics: `Metrics` holds one Prometheus registry per process part (gateway, worker) with
  vLLM's metric names under the `kvserve:` prefix; engine numbers that live in a worker reach
  the gateway's /metrics as stats snapshots through `EngineStatsCollector`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

PREFIX = "kvserve:"
_METRIC_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")

# ---- logging ---------------------------------------------------------------------------------


def _add_trace_ids(
    _logger: Any, _name: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event.setdefault("trace_id", format(ctx.trace_id, "032x"))
        event.setdefault("span_id", format(ctx.span_id, "016x"))
    return event


def configure_logging(level: str | None = None, json_logs: bool = True) -> None:
    """structlog to stderr: JSON lines (or a console renderer), level from KVSERVE_LOG_LEVEL."""
    name = (level or os.environ.get("KVSERVE_LOG_LEVEL", "INFO")).upper()
    lvl = logging.getLevelNamesMapping().get(name, logging.INFO)
    renderer: Any = (
        structlog.processors.JSONRenderer() if json_logs else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_trace_ids,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    # Libraries' stdlib logging goes to stderr too, at WARNING and above.
    logging.basicConfig(level=max(lvl, logging.WARNING), stream=sys.stderr)


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)


# ---- tracing ---------------------------------------------------------------------------------

_PROPAGATOR = TraceContextTextMapPropagator()
_tracing_lock = threading.Lock()
_provider: TracerProvider | None = None


class JsonLinesSpanExporter(SpanExporter):
    """Appends each finished span as one JSON object per line (name, ids, parent, times,
    attributes, status): a collector-free exporter for tests and local debugging."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = [json.dumps(span_record(s)) + "\n" for s in spans]
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.writelines(lines)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def span_record(span: ReadableSpan) -> dict[str, Any]:
    ctx = span.get_span_context()
    assert ctx is not None
    return {
        "name": span.name,
        "trace_id": format(ctx.trace_id, "032x"),
        "span_id": format(ctx.span_id, "016x"),
        "parent_span_id": format(span.parent.span_id, "016x") if span.parent else None,
        "service": (span.resource.attributes.get("service.name") if span.resource else None),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": dict(span.attributes or {}),
        "status": span.status.status_code.name,
    }


def configure_tracing(service_name: str, trace_file: str | None = None) -> TracerProvider | None:
    """Install the process's TracerProvider (once; later calls return the first). None when
    no exporter is configured: spans are then no-ops and cost next to nothing.
    OTEL_SERVICE_NAME, when set, overrides `service_name`."""
    global _provider
    service_name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    with _tracing_lock:
        if _provider is not None:
            return _provider
        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        path = trace_file or os.environ.get("KVSERVE_TRACE_FILE")
        console = os.environ.get("KVSERVE_TRACE_CONSOLE") == "1"
        if not (endpoint or path or console):
            return None
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        if endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        if path:
            provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(path)))
        if console:
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        trace.set_tracer_provider(provider)
        _provider = provider
        return provider


def shutdown_tracing() -> None:
    if _provider is not None:
        _provider.shutdown()


def get_tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def current_traceparent() -> str | None:
    """The W3C traceparent of the current span (None when tracing is off)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get("traceparent")


def context_from_traceparent(traceparent: str | None) -> otel_context.Context | None:
    if not traceparent:
        return None
    return _PROPAGATOR.extract({"traceparent": traceparent})


# GenAI semantic-convention attribute names.
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_SYSTEM = "gen_ai.system"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_TOP_P = "gen_ai.request.top_p"
GEN_AI_SEED = "gen_ai.request.seed"
GEN_AI_CHOICE_COUNT = "gen_ai.request.choice.count"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_CACHED_TOKENS = "gen_ai.usage.cache_read.input_tokens"
KVSERVE_CACHED_TOKENS = "kvserve.usage.cached_tokens"
# kvserve.cached_tokens.{device,host,store}: the cached prompt tokens by the tier they came from
KVSERVE_CACHED_TOKENS_TIER = "kvserve.cached_tokens."
KVSERVE_STORE_LOOKUP = "kvserve.store.lookup"  # how the request's store lookup ended
KVSERVE_REQUEST_ID = "kvserve.request_id"


# ---- metrics ---------------------------------------------------------------------------------

# Latency buckets as vLLM's (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class Metrics:
    """The gateway's request metrics (one registry per gateway; vLLM names under `kvserve:`)."""

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        m = ["model_name"]

        def hist(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, m, registry=r, buckets=buckets)

        def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*m, *labels], registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS)
        self.prompt_tokens_hist = hist(
            "request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS
        )
        self.generation_tokens_hist = hist(
            "request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.cached_prompt_tokens = counter(
            "prompt_tokens_cached", "Prompt tokens served from the prefix cache."
        )
        self.request_success = counter(
            "request_success", "Finished requests by finish reason.", ["finished_reason"]
        )
        self.stream_stalls = counter(
            "stream_stalls", "Streams aborted because their client stopped reading."
        )
        self.http_requests = Counter(
            PREFIX + "http_requests", "HTTP requests by route and status.", ["route", "status"],
            registry=r,
        )  # fmt: skip
        self.rejected = Counter(
            PREFIX + "requests_rejected", "Requests refused before reaching a worker.",
            ["reason"], registry=r,
        )  # fmt: skip
        self.in_flight = Gauge(
            PREFIX + "gateway_requests_in_flight",
            "Generation requests admitted by the gateway and not finished.",
            registry=r,
        )
        self.engine = EngineStatsCollector(model_name)
        r.register(self.engine)


# Engine stats keys -> (metric name, kind, help). Counters get `_total` on exposition.
ENGINE_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("num_requests_running", "num_requests_running", "gauge", "Requests being computed."),
    ("num_requests_waiting", "num_requests_waiting", "gauge", "Requests waiting for blocks."),
    ("kv_cache_usage_perc", "kv_cache_usage_perc", "gauge", "KV-cache usage (1 = full)."),
    ("num_blocks", "kv_cache_num_blocks", "gauge", "KV-cache blocks in the engine."),
    ("num_used_blocks", "kv_cache_used_blocks", "gauge", "KV-cache blocks referenced."),
    ("cached_blocks", "prefix_cache_blocks", "gauge", "Blocks in the prefix index."),
    ("prefix_cache_queries", "prefix_cache_queries", "counter", "Prompt tokens looked up."),
    ("prefix_cache_hits", "prefix_cache_hits", "counter", "Prompt tokens found cached."),
    ("evicted_blocks", "prefix_cache_evictions", "counter", "Cached blocks evicted."),
    ("num_preemptions", "num_preemptions", "counter", "Sequences preempted."),
    ("spec_decode_num_drafts", "spec_decode_num_drafts", "counter",
     "Speculative decoding: verification steps of a sequence with draft tokens."),
    ("spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "counter",
     "Speculative decoding: draft tokens proposed and verified."),
    ("spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens", "counter",
     "Speculative decoding: draft tokens accepted."),
    ("num_requests_failed", "requests_failed", "counter",
     "Requests the engine failed alone (an exception in their own processing)."),
    ("num_requests_quarantined", "requests_quarantined", "counter",
     "Requests failed instead of run again: in too many failed steps, or killed workers."),
    ("num_step_failures", "step_failures", "counter", "Engine steps that failed as a whole."),
)  # fmt: skip


class EngineStatsCollector(Collector):
    """Exposes the latest engine stats snapshot of every worker (label `worker`). The owner
    sets `snapshot` (worker name -> stats dict) before each scrape. Optional nested dicts
    `cached_tokens_by_source` ({source: tokens}) and `store` ({name: number}) are exposed as
    `kvserve:cached_tokens_total{source}` and `kvserve:store_<name>` (nested dicts flattened,
    the backend's counters as `kvserve:store_backend_<name>`; the lookups by outcome as the
    counter `kvserve:store_lookups_total{outcome}`); `store_latency` (the store
    connector's LatencyStats snapshot) as the histograms `kvserve:store_get_seconds` /
    `kvserve:store_put_seconds` and the counter `kvserve:store_errors_total{op}`; `bus_dropped`
    ({stream kind: {reason: count}}: the bus entries the worker refused) as the counter
    `kvserve:bus_dropped_messages_total{stream, reason}`, beside the owner's own drops
    (`own_bus_dropped`, set like `snapshot`: a gateway's, with an empty `worker` label). A
    snapshot is a worker's report (untrusted): a value of the wrong shape is left out."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot: Mapping[str, Mapping[str, Any]] = {}
        self.own_bus_dropped: Mapping[str, Mapping[str, int]] = {}

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "worker"]
        for key, name, kind, doc in ENGINE_METRICS:
            fam: GaugeMetricFamily | CounterMetricFamily = (
                GaugeMetricFamily(PREFIX + name, doc, labels=labels)
                if kind == "gauge"
                else CounterMetricFamily(PREFIX + name, doc, labels=labels)
            )
            for worker, stats in self.snapshot.items():
                if isinstance(stats.get(key), int | float):
                    fam.add_metric([self.model_name, worker], float(stats[key]))
            yield fam
        by_source = CounterMetricFamily(
            PREFIX + "cached_tokens",
            "Prompt tokens served from a cache, by tier (device / host / store).",
            labels=[*labels, "source"],
        )
        for worker, stats in self.snapshot.items():
            sources = stats.get("cached_tokens_by_source") or {
                "device": stats.get("prefix_cache_hits", 0)
            }
            for source, value in _numbers(sources):
                by_source.add_metric([self.model_name, worker, source], value)
        yield by_source
        yield self._store_lookups(labels)
        store: dict[str, GaugeMetricFamily] = {}
        for worker, stats in self.snapshot.items():
            numbers = {k: v for k, v in _mapping(stats.get("store")).items() if k != "lookups"}
            for key, value in _flat_numbers(numbers):
                if key not in store:
                    store[key] = GaugeMetricFamily(
                        f"{PREFIX}store_{key}", f"Prefix store: {key}.", labels=labels
                    )
                fam = store[key]
                fam.add_metric([self.model_name, worker], value)
        yield from store.values()
        yield from self._store_latency(labels)
        yield self._bus_dropped(labels)

    def _bus_dropped(self, labels: list[str]) -> Metric:
        """`kvserve:bus_dropped_messages_total{stream, reason}`: bus entries refused unread."""
        fam = CounterMetricFamily(
            PREFIX + "bus_dropped_messages",
            "Bus messages dropped unread (oversized, missing_field, not_msgpack, version, "
            "invalid), by stream kind.",
            labels=[*labels, "stream", "reason"],
        )
        sources: list[tuple[str, Any]] = [("", self.own_bus_dropped)]
        sources += [(w, stats.get("bus_dropped")) for w, stats in self.snapshot.items()]
        for worker, dropped in sources:
            for stream, reasons in _mapping(dropped).items():
                for reason, n in _numbers(reasons):
                    fam.add_metric([self.model_name, worker, str(stream), reason], n)
        return fam

    def _store_lookups(self, labels: list[str]) -> Metric:
        """`kvserve:store_lookups_total{outcome}`: every store lookup by how it ended."""
        fam = CounterMetricFamily(
            PREFIX + "store_lookups",
            "Prefix-store lookups by outcome (hit, absent, recompute, timeout, evicted, "
            "corrupt, wrong_identity, unavailable, breaker_open).",
            labels=[*labels, "outcome"],
        )
        for worker, stats in self.snapshot.items():
            for outcome, n in _numbers(_mapping(stats.get("store")).get("lookups")):
                fam.add_metric([self.model_name, worker, outcome], n)
        return fam

    def _store_latency(self, labels: list[str]) -> Iterator[Metric]:
        hists = {
            op: HistogramMetricFamily(
                f"{PREFIX}store_{op}_seconds",
                f"Prefix store {op} call latency (seconds), as the store connector sees it.",
                labels=labels,
            )
            for op in ("get", "put")
        }
        errors = CounterMetricFamily(
            PREFIX + "store_errors",
            "Prefix store calls that failed or timed out, by operation.",
            labels=[*labels, "op"],
        )
        for worker, stats in self.snapshot.items():
            lat = _mapping(stats.get("store_latency"))
            bounds = lat.get("bounds") or []
            for op, fam in hists.items():
                e = _mapping(lat.get(op))
                counts: Any = e.get("counts")
                if not _all_numbers(bounds, counts) or len(counts) != len(bounds) + 1:
                    continue
                cum, buckets = 0.0, []
                for le, c in zip([*map(str, bounds), "+Inf"], counts, strict=True):
                    cum += c
                    buckets.append((le, cum))
                fam.add_metric([self.model_name, worker], buckets, _number(e.get("sum")))
                errors.add_metric([self.model_name, worker, op], _number(e.get("errors")))
        yield from hists.values()
        yield errors


def _mapping(value: Any) -> Mapping[Any, Any]:
    """`value` when it is a mapping, else an empty one (a report is untrusted)."""
    return value if isinstance(value, Mapping) else {}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _number(value: Any) -> float:
    return float(value) if _is_number(value) else 0.0


def _all_numbers(*lists: Any) -> bool:
    return all(isinstance(v, list) and all(map(_is_number, v)) for v in lists)


def _numbers(d: Any) -> Iterable[tuple[str, float]]:
    for k, v in _mapping(d).items():
        if _is_number(v):
            yield str(k), float(v)


def _flat_numbers(d: Mapping[str, Any], prefix: str = "") -> Iterable[tuple[str, float]]:
    """Numbers of a nested stats dict as metric-name-safe keys: the store connector's counters
    as they are, its backend's under `backend_` (for example `backend_get_errors`)."""
    for k, v in _mapping(d).items():
        key = _METRIC_UNSAFE.sub("_", prefix + ("backend" if k == "store" else str(k)))
        if isinstance(v, Mapping):
            yield from _flat_numbers(v, key + "_")
        elif isinstance(v, int | float) and not isinstance(v, bool):
            yield key, float(v)
