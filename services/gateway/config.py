"""GatewayConfig: the gateway's settings, frozen, given once to `Gateway` (app.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatewayConfig:
    max_in_flight: int = 256
    max_body_bytes: int = 1 << 20
    request_timeout_s: float = 600.0
    # A stream's write waits this long for a client that stopped reading, then the request is
    # aborted (services/gateway/sse_writer.py; 0: as long as the client takes).
    stream_stall_timeout_s: float = 30.0
    api_keys: tuple[str, ...] = ()
    allow_client_cache_salt: bool = False
    # Accept `kvserve_fault` (a request that asks for a fault: tests and chaos runs only).
    fault_injection: bool = False
    retry_after_s: int = 1
    rate_limit: float = 0.0  # requests per second per API key on POST /v1 (0: no limit)
    max_warmup_jobs: int = 100  # finished warm-up jobs remembered for their status endpoint
    # The router (services/gateway/router.py): a policy, or None (no routing: `kvserve serve`)
    routing: str | None = None
    overlap_weight: float = 1.0
    router_store_cost: float | None = 0.2  # None: each worker's reported store_load_cost
    router_max_blocks: int = 100_000
    # Disaggregated topology: a request whose predicted uncached part is shorter than this many
    # tokens goes to a decode worker, which computes it, instead of a prefill worker (0: never).
    pd_threshold: int = 0
