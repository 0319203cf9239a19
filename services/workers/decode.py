"""DecodeWorker: the decode side of the disaggregated topology (DESIGN.md section 2).

It reads the decode stream, fetches the request's tail from the store, and runs the full
request with it (`kv_tail`): the engine loads the full blocks from the store and computes only
the last prompt token; without the tail (a redelivery: the tail is deleted on read) or without
the blocks (evicted, or the store was down) it recomputes what the store lacks. Token events go
out exactly as from an EngineWorker; the cached-token count the client sees is the one the
prefill worker found (with the tiers it found them in).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator

from kvserve.services.workers.engine_worker import EngineWorker
from kvserve.shared.engine.outputs import Emitted, RequestOutput
from kvserve.shared.protocol import GenerateRequest
from kvserve.shared.store.block_data import KVTail
from kvserve.shared.telemetry import KVSERVE_REQUEST_ID, get_tracer

tracer = get_tracer("kvserve.disagg")


class DecodeWorker(EngineWorker):
    """Decode side: an EngineWorker with the prefilled tail fetched from the store."""

    role = "decode"

    def _generate(
        self, req: GenerateRequest, resume: dict[int, Emitted] | None
    ) -> AsyncGenerator[RequestOutput, None]:
        return self._with_tail(req, resume)

    async def _with_tail(
        self, req: GenerateRequest, resume: dict[int, Emitted] | None
    ) -> AsyncGenerator[RequestOutput, None]:
        prompt = list(req.prompt_token_ids)
        # A request taken over from a dead decode worker: its tail was read (and deleted) there.
        tail = await self._fetch_tail(req) if resume is None else None
        stream = self.engine.generate(
            req.request_id,
            prompt,
            req.sampling,
            cache_salt=req.cache_salt,
            kv_tail=tail,
            resume=resume,
        )
        reported = req.num_cached_tokens  # what prefill found cached: what the client sees
        async with contextlib.aclosing(stream):
            async for out in stream:
                if reported is not None:
                    by_tier = req.cached_tokens_by_source or {}  # none from an older prefill
                    cached = min(reported, len(prompt))
                    out = dataclasses.replace(
                        out, num_cached_tokens=cached, cached_tokens_by_source=by_tier
                    )
                yield out

    async def _fetch_tail(self, req: GenerateRequest) -> KVTail | None:
        """The `kvserve.store_fetch` span: the prompt's partial last block before its last
        token, as the prefill worker stored it; None when there is none to fetch or the
        store does not have it."""
        head = len(req.prompt_token_ids) - 1
        full = head // self.engine.block_size * self.engine.block_size
        if self.engine.store_url is None or full >= head:
            return None
        with tracer.start_as_current_span("kvserve.store_fetch") as fetch:
            fetch.set_attribute(KVSERVE_REQUEST_ID, req.request_id)
            fetch.set_attribute("kvserve.tail_tokens", head - full)
            tail_ids = list(req.prompt_token_ids[full:head])
            future = self.engine.fetch_tail(req.request_id, tail_ids)
            tail = await asyncio.wrap_future(future) if future is not None else None
            fetch.set_attribute("kvserve.tail_found", tail is not None)
        return tail
