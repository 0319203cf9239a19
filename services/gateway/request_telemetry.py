"""What a generation request leaves behind: its server span's GenAI attributes (the request's
when it starts, the usage when it ends), the Prometheus counters of a successful one, and one
log line, whatever way it ended. Reads the request; changes nothing but the span and metrics."""

from __future__ import annotations

import time
from typing import Any

from kvserve.services.gateway.generation import BusGeneration
from kvserve.services.gateway.responses import ResponseBuilder
from kvserve.services.gateway.schema import GenerationPlan
from kvserve.shared.telemetry import (
    GEN_AI_CACHED_TOKENS,
    GEN_AI_CHOICE_COUNT,
    GEN_AI_FINISH_REASONS,
    GEN_AI_INPUT_TOKENS,
    GEN_AI_MAX_TOKENS,
    GEN_AI_OPERATION,
    GEN_AI_OUTPUT_TOKENS,
    GEN_AI_REQUEST_MODEL,
    GEN_AI_RESPONSE_ID,
    GEN_AI_RESPONSE_MODEL,
    GEN_AI_SEED,
    GEN_AI_SYSTEM,
    GEN_AI_TEMPERATURE,
    GEN_AI_TOP_P,
    KVSERVE_CACHED_TOKENS,
    KVSERVE_CACHED_TOKENS_TIER,
    KVSERVE_REQUEST_ID,
    KVSERVE_STORE_LOOKUP,
    Metrics,
    get_logger,
)
from opentelemetry.trace import Span
from opentelemetry.util.types import AttributeValue

log = get_logger("kvserve.gateway")


def request_attributes(op: str, plan: GenerationPlan, rid: str) -> dict[str, AttributeValue]:
    """The server span's GenAI request attributes."""
    p = plan.params
    attrs: dict[str, AttributeValue] = {
        GEN_AI_OPERATION: op,
        GEN_AI_SYSTEM: "kvserve",
        GEN_AI_REQUEST_MODEL: plan.model,
        GEN_AI_MAX_TOKENS: p.max_tokens,
        GEN_AI_TEMPERATURE: p.temperature,
        GEN_AI_TOP_P: p.top_p,
        GEN_AI_CHOICE_COUNT: p.n,
        KVSERVE_REQUEST_ID: rid,
    }
    if p.seed is not None:
        attrs[GEN_AI_SEED] = p.seed
    return attrs


def record_finish(
    span: Span, metrics: Metrics, call: BusGeneration, builder: ResponseBuilder, status: str
) -> None:
    """The usage on the span, the counters when `status` is "ok", and the log line."""
    usage = builder.usage()
    _usage_attributes(span, builder, usage)
    elapsed = time.monotonic() - call.t0
    if status == "ok":
        _count_success(metrics, call.model_name, builder, usage, elapsed)
    log.info(
        "request finished",
        status=status,
        kind=builder.plan.kind,
        stream=builder.plan.stream,
        prompt_tokens=usage["prompt_tokens"],
        completion_tokens=usage["completion_tokens"],
        cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
        ttft_s=None if call.first_token_at is None else round(call.first_token_at, 4),
        e2e_s=round(elapsed, 4),
    )


def _usage_attributes(span: Span, builder: ResponseBuilder, usage: dict[str, Any]) -> None:
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    span.set_attribute(GEN_AI_RESPONSE_ID, builder.id)
    span.set_attribute(GEN_AI_RESPONSE_MODEL, builder.model)
    span.set_attribute(GEN_AI_INPUT_TOKENS, usage["prompt_tokens"])
    span.set_attribute(GEN_AI_OUTPUT_TOKENS, usage["completion_tokens"])
    span.set_attribute(GEN_AI_CACHED_TOKENS, cached)
    span.set_attribute(KVSERVE_CACHED_TOKENS, cached)
    for tier, n in usage["prompt_tokens_details"]["cached_tokens_by_tier"].items():
        span.set_attribute(KVSERVE_CACHED_TOKENS_TIER + tier, n)
    if builder.store_lookup is not None:
        span.set_attribute(KVSERVE_STORE_LOOKUP, builder.store_lookup)
    span.set_attribute(GEN_AI_FINISH_REASONS, builder.finish_reasons)


def _count_success(
    m: Metrics, name: str, builder: ResponseBuilder, usage: dict[str, Any], elapsed: float
) -> None:
    m.e2e.labels(name).observe(elapsed)
    m.prompt_tokens.labels(name).inc(usage["prompt_tokens"])
    m.generation_tokens.labels(name).inc(usage["completion_tokens"])
    m.cached_prompt_tokens.labels(name).inc(usage["prompt_tokens_details"]["cached_tokens"])
    m.prompt_tokens_hist.labels(name).observe(usage["prompt_tokens"])
    m.generation_tokens_hist.labels(name).observe(usage["completion_tokens"])
    for reason in builder.finish_reasons:
        m.request_success.labels(name, reason).inc()
