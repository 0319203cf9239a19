"""The thread count of a small step: each is timed, the faster one kept and the other tried
now and then; larger steps use every thread; a step's numbers do not depend on the choice."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from kvserve.kernels import cpu_qlinear
from kvserve.shared.engine import step_threads
from kvserve.shared.engine.engine import Engine
from kvserve.shared.engine.step_threads import EXPLORE, WARMUP, StepThreads
from kvserve.shared.model.loader import load_weights
from kvserve.shared.sampling_params import SamplingParams


def drive(chooser: StepThreads, tokens: int, seconds: dict[int, float], steps: int) -> list[int]:
    """`steps` steps of `tokens` tokens, each taking seconds[threads]; the thread counts run."""
    ran = []
    for _ in range(steps):
        n = chooser.choose(tokens)
        chooser.record(tokens, n, seconds[n])
        ran.append(n)
    return ran


def test_each_count_is_timed_then_the_faster_runs_and_the_other_is_retried() -> None:
    chooser = StepThreads(4)
    ran = drive(chooser, 1, {1: 0.005, 4: 0.008}, 2 * WARMUP + 2 * EXPLORE)
    assert ran[: 2 * WARMUP] == [1] * WARMUP + [4] * WARMUP
    after = ran[2 * WARMUP :]
    assert after.count(4) == 2 and all(after[i] == 4 for i in (EXPLORE - 1, 2 * EXPLORE - 1))
    assert chooser.preferred() == {0: 1}


def test_the_choice_follows_the_machine_when_it_changes() -> None:
    chooser = StepThreads(2)
    drive(chooser, 2, {1: 0.004, 2: 0.009}, 2 * WARMUP + 4)
    assert chooser.preferred() == {1: 1}
    # One thread gets slower (say the other core is now idle): the retries of two see it.
    drive(chooser, 2, {1: 0.012, 2: 0.009}, 4 * EXPLORE)
    assert chooser.preferred() == {1: 2}
    assert drive(chooser, 2, {1: 0.012, 2: 0.009}, EXPLORE).count(1) == 1  # the retry


def test_a_preempted_step_does_not_hand_the_next_steps_to_the_slower_count() -> None:
    """A step on every core that was preempted once (three times the usual time) leaves the
    choice as it was: the median of the latest steps decides, not one step."""
    chooser = StepThreads(2)
    drive(chooser, 1, {1: 0.009, 2: 0.0065}, 2 * WARMUP + 3)
    assert chooser.preferred() == {0: 2}
    chooser.record(1, 2, 0.02)  # preempted: slower than one thread's steps
    assert drive(chooser, 1, {1: 0.009, 2: 0.0065}, EXPLORE - 1).count(1) <= 1  # the retry


def test_size_classes_are_apart_and_large_steps_use_every_thread() -> None:
    chooser = StepThreads(2)
    drive(chooser, 1, {1: 0.004, 2: 0.009}, 2 * WARMUP + 1)
    drive(chooser, 6, {1: 0.030, 2: 0.016}, 2 * WARMUP + 1)
    assert chooser.preferred() == {0: 1, 3: 2}  # 1 token; 5-8 tokens
    assert StepThreads.size_class(3) == StepThreads.size_class(4) == 2
    assert drive(chooser, 9, {2: 0.02}, 5) == [2] * 5
    assert drive(chooser, 512, {2: 0.5}, 3) == [2] * 3


def test_one_thread_or_a_gpu_has_no_choice() -> None:
    assert drive(StepThreads(1), 1, {1: 0.01}, 10) == [1] * 10
    gpu = StepThreads(2, enabled=False)
    assert drive(gpu, 1, {2: 0.01}, 10) == [2] * 10
    assert gpu.preferred() == {}


def test_run_sets_the_threads_for_the_step_only() -> None:
    chooser = StepThreads(torch.get_num_threads())
    before = torch.get_num_threads()
    runs = [chooser.run(1, torch.get_num_threads) for _ in range(2 * WARMUP)]
    assert [n for n, _ in runs] == [n for n in chooser.options for _ in range(WARMUP)]
    assert torch.get_num_threads() == before
    with step_threads.threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def run_with_threads(engine: Engine, threads: int, prompts: list[list[int]]) -> list[Any]:
    """Every step of these requests on `threads` threads: per request its tokens and logprobs."""
    engine.step_threads.choose = lambda num_tokens: threads  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"t{threads}-{i}", p, params)
    got: dict[str, tuple[list[int], list[float]]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            toks, lps = got.setdefault(out.request_id.split("-")[1], ([], []))
            for d in out.completions:
                toks.extend(d.token_ids)
                lps.extend(d.logprobs)
    return [got[k] for k in sorted(got)]


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one thread: nothing to compare")
@pytest.mark.parametrize("kind", ["file", "fp32"])
def test_a_steps_numbers_do_not_depend_on_its_thread_count(
    kind: str,
    make_engine: Callable[..., Engine],
    model_path: Path,
    chat_prompt_ids: list[list[int]],
) -> None:
    if kind == "file" and not cpu_qlinear.available():
        pytest.skip("no C++ toolchain")
    engine = make_engine(enable_prefix_caching=False)
    if kind == "file":
        loaded = load_weights(model_path, torch.float32, keep=frozenset(cpu_qlinear.FORMATS))
        config = dataclasses.replace(engine.config, weights="file")
        engine = Engine(config, tokenizer=engine.tokenizer, weights=loaded)
    prompts = chat_prompt_ids[:3]  # decode steps of 3 sequences and of 1 (alone, below)
    assert run_with_threads(engine, 1, prompts) == run_with_threads(engine, 2, prompts)
    assert run_with_threads(engine, 1, prompts[:1]) == run_with_threads(engine, 2, prompts[:1])


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one thread: nothing to compare")
def test_the_lm_head_runs_on_every_thread_whatever_the_step_runs_on(
    make_engine: Callable[..., Engine],
    chat_prompt_ids: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A one-thread step's LM head still streams its weights on every thread, and its
    logits, tokens and logprobs are those of the head on the step's one thread."""
    engine = make_engine(enable_prefix_caching=False)
    model = engine.model_runner.model
    head, seen = model.compute_logits, []

    def counted(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return head(hidden)

    monkeypatch.setattr(model, "compute_logits", counted)
    prompts = chat_prompt_ids[:2]
    on_every_thread = run_with_threads(engine, 1, prompts)
    assert seen and set(seen) == {engine.step_threads.max_threads}
    seen.clear()
    engine.model_runner.head_threads = None  # the head on the step's own thread count
    assert run_with_threads(engine, 1, prompts) == on_every_thread
    assert set(seen) == {1}
