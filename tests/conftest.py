"""Shared fixtures: the default model is loaded once per test session (`weights`, `tokenizer`,
`make_engine`); chat prompts; a module's system-prompt chats and their outputs without prefix
caching (`prompts`, `cold`); throwaway Redis servers (`redis_server`, `redis_cluster`: the
harness's RedisServer and RedisCluster, kvserve.services.bench.lib)."""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from kvserve.services.bench.lib.redis_cluster import RedisCluster
from kvserve.services.bench.lib.redis_server import RedisServer, redis_binaries_present
from kvserve.shared.config import CacheConfig, EngineConfig, SchedulerConfig, default_model_path
from kvserve.shared.model.loader import LoadedWeights, load_weights
from kvserve.shared.model.tokenizer import KVTokenizer


def _repository_root_last() -> None:
    """The repository root at the end of sys.path only (for the `tests.` helpers): before the
    installed packages, its top-level folders (kernels/, shared/, services/: the sources, which
    are imported as kvserve.*) would shadow packages of the same name; transformers imports one
    called `kernels`. `python -m pytest` puts the working directory first."""
    root = Path(__file__).resolve().parents[1]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != root] + [str(root)]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Every test module is imported, and with them torch, transformers, schemathesis...: their
    ~300k objects leave the cyclic collector's view (gc.freeze; refcounting still frees them),
    so that `make_engine`'s collection, and each automatic one, scans only what the tests made:
    ~0.1-0.2 s a full collection otherwise, and the default run builds ~150 engines in
    tests/shared/engine alone."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config: pytest.Config) -> None:
    """Everything back in the collector's view for the interpreter's last collection (frozen
    cycles left for exit made nanobind report Triton's objects as leaked)."""
    gc.unfreeze()


_repository_root_last()
torch.set_num_threads(2)
if not torch.cuda.is_available():  # Triton kernels run under the interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The default model, or the GGUF file or HF directory that KVSERVE_TEST_MODEL names (a run
    on a machine without the default model's weights: ops/gpu_check.sh)."""
    path = Path(os.environ.get("KVSERVE_TEST_MODEL") or default_model_path())
    if not path.exists():
        pytest.fail(f"model missing at {path}; run `kvserve fetch-model` (ops/setup.sh)")
    return path


@pytest.fixture(scope="session")
def weights(model_path: Path) -> LoadedWeights:
    return load_weights(model_path, torch.float32)


@pytest.fixture(scope="session")
def tokenizer(model_path: Path) -> KVTokenizer:
    return KVTokenizer.from_path(model_path)


@pytest.fixture(scope="session")
def make_engine(model_path, weights, tokenizer):  # type: ignore[no-untyped-def]
    """Build an Engine on the shared weights: make_engine(num_blocks=..., ...)."""
    from kvserve.shared.engine.engine import Engine

    def make(
        num_blocks: int | None = 512,
        block_size: int = 16,
        max_num_batched_tokens: int = 512,
        max_prefill_chunk: int = 512,
        max_num_seqs: int = 128,
        enable_prefix_caching: bool = True,
        kv_dtype: str = "auto",
        **engine_kwargs: object,
    ) -> Engine:
        # Collect dead engines' leftovers (tests' own cycles) before allocating another KV cache.
        gc.collect()
        cfg = EngineConfig(
            model_path=str(model_path),
            cache=CacheConfig(
                block_size=block_size,
                num_blocks=num_blocks,
                enable_prefix_caching=enable_prefix_caching,
                kv_dtype=kv_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                max_prefill_chunk=max_prefill_chunk,
            ),
        )
        if engine_kwargs:
            cfg = dataclasses.replace(cfg, **engine_kwargs)  # type: ignore[arg-type]
        return Engine(cfg, tokenizer=tokenizer, weights=weights)

    return make


CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a hash function is in two sentences.",
    "List three primary colors.",
    "Translate 'good morning' into Spanish.",
    "What is 17 times 23?",
    "Give me a short tip for writing clean Python code.",
    "Who wrote the novel Pride and Prejudice?",
]


@pytest.fixture(scope="session")
def chat_prompt_ids(tokenizer: KVTokenizer) -> list[list[int]]:
    return [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]


@pytest.fixture(scope="module")
def prompts(request: pytest.FixtureRequest, tokenizer: KVTokenizer) -> list[list[int]]:
    """The test module's SYSTEM prompt followed by each of its QUESTIONS, as chats (a module
    that uses this fixture defines both)."""
    system: str = request.module.SYSTEM
    return [
        tokenizer.encode_chat(
            [{"role": "system", "content": system}, {"role": "user", "content": q}]
        )
        for q in request.module.QUESTIONS
    ]


@pytest.fixture(scope="module")
def cold(
    request: pytest.FixtureRequest, make_engine: Callable[..., Any], prompts: list[list[int]]
) -> list[list[int]]:
    """Each of `prompts` run alone with prefix caching off, under the test module's GREEDY
    SamplingParams: what a warm run must reproduce token for token."""
    engine = make_engine(enable_prefix_caching=False)
    return [engine.generate([p], request.module.GREEDY)[0][0] for p in prompts]


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A started redis-server on a free port that the test may kill and restart; stopped after
    the test."""
    if not redis_binaries_present():
        pytest.skip("redis-server not installed")
    server = RedisServer(workdir=tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """A three-master Redis Cluster, started once per session and stopped at its end; a test
    that kills a node must restart it (`RedisCluster.restart` waits until the cluster is whole
    again) before it ends."""
    if not redis_binaries_present():
        pytest.skip("redis-server / redis-cli not installed")
    cluster = RedisCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
