"""The trace pieces every worker records the same way."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping

from kvserve.shared.protocol import GenerateRequest
from kvserve.shared.telemetry import (
    GEN_AI_CACHED_TOKENS,
    GEN_AI_INPUT_TOKENS,
    GEN_AI_OPERATION,
    GEN_AI_REQUEST_MODEL,
    KVSERVE_CACHED_TOKENS,
    KVSERVE_CACHED_TOKENS_TIER,
    KVSERVE_REQUEST_ID,
    KVSERVE_STORE_LOOKUP,
    context_from_traceparent,
)
from opentelemetry.trace import Span, Tracer
from opentelemetry.util.types import AttributeValue


@contextlib.contextmanager
def request_span(
    tracer: Tracer, name: str, req: GenerateRequest, model_name: str | None
) -> Iterator[Span]:
    """The current span while a request is on this worker: a child of the sender's span (the
    message's traceparent) with the GenAI request attributes, whose first child is the
    `kvserve.queue` span from the request's submission to its receipt here."""
    received = time.time()
    attributes: dict[str, AttributeValue] = {
        KVSERVE_REQUEST_ID: req.request_id,
        GEN_AI_OPERATION: "generate",
        GEN_AI_INPUT_TOKENS: len(req.prompt_token_ids),
    }
    if model_name:
        attributes[GEN_AI_REQUEST_MODEL] = model_name
    context = context_from_traceparent(req.traceparent)
    with tracer.start_as_current_span(name, context=context, attributes=attributes) as span:
        queue_span = tracer.start_span("kvserve.queue", start_time=int(req.submitted_at * 1e9))
        queue_span.end(end_time=int(received * 1e9))
        yield span


def set_cached_tokens(span: Span, tokens: int) -> None:
    """The prompt tokens found cached, under the GenAI name and kvserve's own."""
    span.set_attribute(GEN_AI_CACHED_TOKENS, tokens)
    span.set_attribute(KVSERVE_CACHED_TOKENS, tokens)


def set_cache_sources(span: Span, by_tier: Mapping[str, int], store_lookup: str | None) -> None:
    """Where the cached prompt tokens came from (`kvserve.cached_tokens.{device,host,store}`)
    and how the request's store lookup ended (`kvserve.store.lookup`, when there was one)."""
    for tier, n in by_tier.items():
        span.set_attribute(KVSERVE_CACHED_TOKENS_TIER + tier, n)
    if store_lookup is not None:
        span.set_attribute(KVSERVE_STORE_LOOKUP, store_lookup)
