"""Dropping an engine frees its KV cache at once: no reference cycle keeps it for the garbage
collector (benchmarks build engines of GBs one after another)."""

from __future__ import annotations

import gc
import weakref

from kvserve.shared.sampling_params import SamplingParams


def test_a_dropped_engine_frees_its_cache_without_the_collector(make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(num_blocks=64, enable_prefix_caching=True)
    engine.generate([[5, 6, 7, 8, 9] * 8], SamplingParams(max_tokens=4))
    cache = weakref.ref(engine.runner.cache)
    gc.disable()
    try:
        del engine
        assert cache() is None
    finally:
        gc.enable()
