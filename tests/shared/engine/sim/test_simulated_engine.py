"""A simulated Engine (EngineConfig.simulate): the real scheduler, KV-cache manager and output
processing around a forward pass that takes the profile's time and emits deterministic words.

Steps are timed on a fake clock: each step advances it by exactly the profile's seconds for the
batch the real scheduler formed."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest
from kvserve.shared.config import EngineConfig, SimConfig, StoreConfig
from kvserve.shared.engine.engine import Engine
from kvserve.shared.engine.outputs import Emitted
from kvserve.shared.engine.sim.profile import CostProfile, StepShape, StoreCost
from kvserve.shared.engine.sim.runner import SimulatedRunner
from kvserve.shared.engine.sim.store import ModelledTransfers
from kvserve.shared.model.tokenizer import KVTokenizer
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.store.codec import Miss, decode_block
from kvserve.shared.store.memory import MemoryStore

from tests.shared.engine.sim.profiles import write_profile


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def profile_file(tmp_path: Path) -> Path:
    return write_profile(tmp_path / "profile.json")


def simulated(
    path: Path, model_path: Path, tokenizer: KVTokenizer, **sim: object
) -> tuple[Engine, FakeClock]:
    config = EngineConfig(model_path=str(model_path), simulate=SimConfig(str(path), **sim))  # type: ignore[arg-type]
    engine = Engine(config, tokenizer=tokenizer)
    fake = FakeClock()
    assert isinstance(engine.runner, SimulatedRunner)
    engine.runner.clock, engine.runner.sleep = fake.clock, fake.sleep
    return engine, fake


def test_each_step_takes_the_profiles_time_for_its_batch(
    profile_file: Path, model_path: Path, tokenizer: KVTokenizer
) -> None:
    engine, fake = simulated(profile_file, model_path, tokenizer)
    prof = CostProfile.load(str(profile_file))
    engine.generate([list(range(100, 140))], SamplingParams(max_tokens=4))
    # one 40-token prompt chunk that samples, then three decodes at contexts 41, 42, 43
    expected = [prof.step_seconds(StepShape.of_rows([(40, 0, True)]))] + [
        prof.step_seconds(StepShape.of_rows([(1, c, True)])) for c in (40, 41, 42)
    ]
    assert fake.sleeps == pytest.approx(expected)
    assert engine.runner.modelled_s == pytest.approx(sum(expected))


def test_a_time_scale_stretches_every_step(
    profile_file: Path, model_path: Path, tokenizer: KVTokenizer
) -> None:
    plain, fake1 = simulated(profile_file, model_path, tokenizer)
    slow, fake8 = simulated(profile_file, model_path, tokenizer, time_scale=8.0)
    for engine in (plain, slow):
        engine.generate([list(range(100, 150))], SamplingParams(max_tokens=3))
    assert fake8.sleeps == pytest.approx([8 * s for s in fake1.sleeps])


def test_the_settings_come_from_the_profile(
    profile_file: Path, model_path: Path, tokenizer: KVTokenizer
) -> None:
    engine, _ = simulated(profile_file, model_path, tokenizer)
    prof = CostProfile.load(str(profile_file))
    assert engine.kv.num_blocks == prof.engine.num_blocks
    assert engine.block_size == prof.engine.block_size
    assert engine.config.scheduler.max_num_seqs == prof.engine.max_num_seqs
    assert engine.max_model_len == prof.model.max_model_len
    cache = engine.kv.cache
    assert (len(cache.k), *cache.k[0].shape[2:]) == (2, 2, 8)  # the true payload: it is small
    assert engine.simulated is not None and engine.simulated.true_payload


def test_tokens_are_words_that_depend_on_the_last_token_and_position(
    profile_file: Path, model_path: Path, tokenizer: KVTokenizer
) -> None:
    engine, _ = simulated(profile_file, model_path, tokenizer)
    prompt = list(range(200, 237))
    (full,) = engine.generate([prompt], SamplingParams(max_tokens=12))[0]
    assert len(full) == 12 and not set(full) & set(tokenizer.eos_token_ids)
    text = tokenizer.decode(full)
    assert text.startswith(" ") and all(w.isalpha() and w.islower() for w in text.split())
    # again (the prompt now cached), and taken over after 5 tokens: the same tokens
    assert engine.generate([prompt], SamplingParams(max_tokens=12))[0][0] == full
    (rest,) = engine.generate([prompt + full[:5]], SamplingParams(max_tokens=7))[0]
    assert full[:5] + rest == full


def test_a_resumed_request_continues_the_same_words(
    profile_file: Path, model_path: Path, tokenizer: KVTokenizer
) -> None:
    engine, _ = simulated(profile_file, model_path, tokenizer)
    prompt = list(range(300, 333))
    (full,) = engine.generate([prompt], SamplingParams(max_tokens=9))[0]
    engine.add_request("r", prompt, SamplingParams(max_tokens=9), resume={0: Emitted(full[:4])})
    got: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            got += out.completions[0].token_ids
    assert full[:4] + got == full


def test_prefix_caching_and_preemption_run_for_real(
    tmp_path: Path, model_path: Path, tokenizer: KVTokenizer
) -> None:
    path = write_profile(tmp_path / "p.json", engine={"num_blocks": 12, "max_num_seqs": 8})
    engine, _ = simulated(path, model_path, tokenizer)
    shared = list(range(400, 464))  # 4 full blocks
    engine.generate([[*shared, 1]], SamplingParams(max_tokens=2))
    outs = []
    engine.add_request("hit", [*shared, 2], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].num_cached_tokens == 64
    # three 40-token sequences growing to 70 tokens need 15 blocks of 12: some are preempted
    prompts = [list(range(500 + 50 * i, 540 + 50 * i)) for i in range(3)]
    done = engine.generate(prompts, SamplingParams(max_tokens=30))
    assert [len(d[0]) for d in done] == [30, 30, 30]
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv.stats()["num_used_blocks"] == 0


def test_a_small_payload_writes_real_frames_with_modelled_transfers(
    profile_file: Path, model_path: Path, tokenizer: KVTokenizer
) -> None:
    config = EngineConfig(
        model_path=str(model_path),
        simulate=SimConfig(str(profile_file), payload="small"),
        store=StoreConfig(url="memory://"),
    )
    engine = Engine(config, tokenizer=tokenizer)
    assert engine.simulated is not None and not engine.simulated.true_payload
    assert (len(engine.kv.cache.k), *engine.kv.cache.k[0].shape[2:]) == (1, 1, 8)
    connector = engine.kv.connector
    assert connector is not None and isinstance(connector.store, ModelledTransfers)
    prompt = list(range(600, 649))  # 3 full blocks
    engine.generate([prompt], SamplingParams(max_tokens=1))
    assert engine.kv.flush()
    inner = connector.store.inner
    assert isinstance(inner, MemoryStore)
    hashes = engine.kv.prefix_hashes(prompt, None)
    frames = asyncio.run(inner.get_many(hashes))
    root = engine.root_hash()
    for i, (h, frame) in enumerate(zip(hashes, frames, strict=True)):
        assert frame is not None
        block = decode_block(frame, engine.kv.identity.meta, h, hashes[i - 1] if i else root)
        assert not isinstance(block, Miss)
    engine.close()


def test_modelled_transfers_queue_on_one_link() -> None:
    cost = StoreCost(rtt_s=0.01, load_s_per_block=0.02, write_s_per_block=0.01,
                     frame_bytes_per_token=1.0)  # fmt: skip
    store = ModelledTransfers(MemoryStore(max_bytes=1 << 20), cost)
    hashes = [bytes([i]) * 32 for i in range(5)]

    async def timed() -> tuple[float, float, float]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await store.put_many([(h, b"x") for h in hashes])
        t1 = loop.time()
        ends: list[float] = []

        async def get() -> None:
            got = await store.get_many(hashes)
            assert got == [b"x"] * 5
            ends.append(loop.time())

        await asyncio.gather(get(), get())
        return t1 - t0, min(ends) - t1, max(ends) - t1

    put_s, first_s, second_s = asyncio.run(timed())
    assert put_s >= 0.01 + 5 * 0.01  # a round trip and five blocks' writes
    assert first_s >= 0.01 + 5 * 0.02
    assert second_s >= 0.01 + 10 * 0.02  # queued behind the first call's blocks


def test_host_work_after_the_model_call_is_inside_the_modelled_step(
    profile_file: Path, model_path: Path, tokenizer: KVTokenizer
) -> None:
    """Each step's outputs take 2 ms of (fake) host time: once the runner has learnt that,
    a step, begin to begin, lasts its modelled time, not 2 ms more."""
    engine, fake = simulated(profile_file, model_path, tokenizer)
    prof = CostProfile.load(str(profile_file))
    process = engine.outputs.process

    def slow_process(out, *rest):  # type: ignore[no-untyped-def]
        fake.now += 0.002
        return process(out, *rest)

    engine.outputs.process = slow_process  # type: ignore[method-assign]
    starts: list[float] = []
    begin = engine.runner.begin_step

    def record() -> None:
        starts.append(fake.now)
        begin()

    engine.runner.begin_step = record  # type: ignore[method-assign]
    engine.generate([list(range(100, 140))], SamplingParams(max_tokens=40))
    periods = [b - a for a, b in itertools.pairwise(starts)]
    contexts = range(39, 39 + len(periods))  # periods[i], i >= 1: a decode at 40 + i - 1
    modelled = [prof.step_seconds(StepShape.of_rows([(1, c, True)])) for c in contexts]
    assert periods[1] == pytest.approx(modelled[1] + 0.002 * 0.8)  # learning
    assert periods[-1] == pytest.approx(modelled[-1], abs=2e-5)  # learnt
