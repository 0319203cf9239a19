"""The trace pieces every worker records the same way."""

from __future__ import annotations

from kvserve.shared.telemetry import GEN_AI_CACHED_TOKENS, KVSERVE_CACHED_TOKENS
from opentelemetry.trace import Span, Tracer


def record_queue_span(tracer: Tracer, submitted_at: float, received_at: float) -> None:
    """A `kvserve.queue` span from the request's submission to its receipt (Unix seconds), a
    child of the current span."""
    queue_span = tracer.start_span("kvserve.queue", start_time=int(submitted_at * 1e9))
    queue_span.end(end_time=int(received_at * 1e9))


def set_cached_tokens(span: Span, tokens: int) -> None:
    """The prompt tokens found cached, under the GenAI name and kvserve's own."""
    span.set_attribute(GEN_AI_CACHED_TOKENS, tokens)
    span.set_attribute(KVSERVE_CACHED_TOKENS, tokens)
