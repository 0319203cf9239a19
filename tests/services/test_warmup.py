"""`kvserve warmup FILE --store URL`: computes, stores and pins shared prefixes; a second run
skips them; afterwards a request starting with such a prefix reports those tokens as cached,
with output identical to a cold run. Bad files are one-line errors."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import redis
from kvserve.services import cli
from kvserve.services.warmup import prefix_ids
from kvserve.shared.config import CacheConfig, EngineConfig, StoreConfig
from kvserve.shared.engine.engine import Engine
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.store.base import block_key
from kvserve.shared.store.hashing import block_hashes

from tests.shared.engine.helpers import run_one

SYSTEM = "You are the support assistant of a bicycle shop. Be brief, precise and friendly. " * 4
FEW_SHOT = "Q: 2+2?\nA: 4\nQ: 3+5?\nA: 8\nQ: 7+1?\nA: 8\nQ: 9+9?\nA: 18\n" * 3
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def serve_engine(model_path: Path, store: StoreConfig, caching: bool = True) -> Engine:
    cache = CacheConfig(num_blocks=512, enable_prefix_caching=caching)
    return Engine(EngineConfig(model_path=str(model_path), cache=cache, store=store))


def last_json(capsys) -> dict:  # type: ignore[no-untyped-def, type-arg]
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.redis
@pytest.mark.slow  # ~18 s; test_serve_admin covers warm-up jobs over HTTP (2-core AVX2 machine)
def test_warmup_then_cached(model_path, tokenizer, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    ns = f"t-{uuid.uuid4().hex}"
    url = f"redis://127.0.0.1:6379/15?namespace={ns}&ttl=3600"
    jobs = tmp_path / "prefixes.jsonl"
    jobs.write_text(json.dumps({"system": SYSTEM}) + "\n\n" + json.dumps({"text": FEW_SHOT}) + "\n")
    assert cli.main(["warmup", str(jobs), "--store", url]) == 0
    first = last_json(capsys)
    assert first["prefixes"] == 2 and first["computed"] == 2 and first["skipped"] == 0
    assert cli.main(["warmup", str(jobs), "--store", url]) == 0  # resumable: all stored
    second = last_json(capsys)
    assert (
        second["computed"] == 0 and second["skipped"] == 2 and second["blocks"] == first["blocks"]
    )

    # Pinned: no TTL on the warm-up blocks. The engines below are built as `kvserve serve`
    # builds its own (the default weights, whose numerics the blocks' root names).
    eng = serve_engine(model_path, StoreConfig(url))
    sys_ids = prefix_ids(tokenizer, {"system": SYSTEM})
    hashes = block_hashes(eng.root_hash(), sys_ids[: len(sys_ids) // 16 * 16], 16)
    r = redis.Redis.from_url("redis://127.0.0.1:6379/15")
    assert all(r.ttl(block_key(h, ns)) == -1 for h in hashes)
    r.close()

    # A request with that system prompt finds its blocks in the store.
    prompt = tokenizer.encode_chat(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Do you sell tyres?"}]
    )
    assert prompt[: len(sys_ids)] == sys_ids
    try:
        tokens, cached = run_one(eng, "r", prompt, GREEDY)
        assert cached >= len(hashes) * 16
        assert eng.prefix_cache_stats["hits_tokens_store"] >= len(hashes) * 16
        with serve_engine(model_path, StoreConfig(), caching=False) as cold_engine:
            cold = cold_engine.generate([prompt], GREEDY)[0][0]
        assert tokens == cold
    finally:
        eng.close()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json\n", "not JSON"),
        ('{"system": "a", "text": "b"}\n', "exactly one of"),
        ('{"messages": "hi"}\n', "non-empty"),
        ("\n", "no prefixes"),
    ],
)
def test_bad_warmup_file_is_one_line(tmp_path: Path, capsys, content: str, message: str) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "p.jsonl"
    f.write_text(content)
    assert cli.main(["warmup", str(f), "--store", "memory://"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
