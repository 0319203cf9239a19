"""The runner computes the last layer only for the rows that sample; their logits match the
full forward pass, and every token's K/V still reaches the cache."""

from __future__ import annotations

import itertools

import pytest
import torch
from kvserve.shared.engine.model_runner import ALIGN, pack
from kvserve.shared.engine.scheduler import Batch, ScheduledSeq
from kvserve.shared.engine.sequence import Sequence
from kvserve.shared.model.attention import AttentionMetadata

from tests.shared.engine.helpers import prompt_sequence


def _seq(engine, i: int, tokens: list[int], computed: int) -> Sequence:  # type: ignore[no-untyped-def]
    seq = prompt_sequence(100 + i, tokens, request_id=f"r{i}", arrival=i)
    blocks = engine.kv.pool.allocate(seq.blocks_needed(len(tokens), engine.block_size))
    assert blocks is not None
    seq.block_table = blocks
    seq.num_computed_tokens = computed
    return seq


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_sampling_rows_alone_match_the_full_forward(make_engine, backend: str) -> None:  # type: ignore[no-untyped-def]
    """A step with a final prompt chunk, a non-final one (no row sampled), a one-token prompt
    and two decodes: run()'s logits equal the full forward's at the sampling rows, and the K/V
    written (by the last layer too) equal the full forward's."""
    engine = make_engine(num_blocks=64, attention_backend=backend, enable_prefix_caching=False)
    runner = engine.runner
    g = torch.Generator().manual_seed(0)
    toks = [torch.randint(20, 40000, (n,), generator=g).tolist() for n in (70, 90, 1, 40, 33)]
    # (sequence, new tokens this step): final chunk of 70 after 30 cached, a first chunk of 50
    # of 90, a 1-token prompt, decodes at 40 and 33 tokens.
    plan = [(0, 30, 40), (1, 0, 50), (2, 0, 1), (3, 39, 1), (4, 32, 1)]
    seqs = [_seq(engine, i, toks[i], c) for i, c, _ in plan]
    batch = Batch(scheduled=[ScheduledSeq(seqs[i], n) for i, _, n in plan])
    # The cached parts first (the plan's "computed" tokens), one chunk each.
    for i, c, _ in plan:
        if c:
            seqs[i].num_computed_tokens = 0
            runner.forward(Batch(scheduled=[ScheduledSeq(seqs[i], c)]))
            seqs[i].num_computed_tokens = c
    bs = engine.block_size
    slots = torch.tensor([
        seqs[i].block_table[p // bs] * bs + p % bs for i, c, n in plan for p in range(c, c + n)
    ])  # fmt: skip

    def step_kv() -> list[torch.Tensor]:
        return [k.view(-1, *k.shape[2:])[slots].clone() for k in runner.cache.k + runner.cache.v]

    ordered, hidden = runner.forward(batch)
    full_kv = step_kv()
    want_rows = []
    offset = 0
    for s in ordered:
        offset += s.num_new_tokens
        if s.samples:
            want_rows.append(offset - 1)
    want = runner.model.compute_logits(hidden[want_rows])
    for k in runner.cache.k + runner.cache.v:
        k.view(-1, *k.shape[2:])[slots] = 0.0
    out = runner.run(batch)
    assert [s.seq_id for s in out.sampling_seqs] == [seqs[i].seq_id for i in (0, 2, 3, 4)]
    torch.testing.assert_close(out.logits, want, atol=1e-4, rtol=1e-4)
    for got, full in zip(step_kv(), full_kv, strict=True):  # every layer's K/V, the last too
        assert torch.equal(got, full)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
def test_a_pure_decode_step_runs_its_layers_in_cpp_with_the_python_paths_results(  # type: ignore[no-untyped-def]
    make_engine, monkeypatch: pytest.MonkeyPatch, kv_dtype: str
) -> None:
    """kernels.cpu_decode_step takes pure decode steps (and nothing else) and gives bit-identical
    hidden states and K/V (an int8 or fp8 cache's bytes and scales too) to the Python path, so
    a sequence's tokens do not depend on whether its step had prompt chunks in it."""
    from kvserve.kernels import cpu_decode_step

    engine = make_engine(num_blocks=64, enable_prefix_caching=False, kv_dtype=kv_dtype)
    runner, model = engine.runner, engine.runner.model
    if model.decoder_weights is None or not cpu_decode_step.applies(3, model.config.head_dim):
        pytest.skip("no C++ kernels on this machine")
    real, calls = cpu_decode_step.decode_layers, []

    def counted(*args):  # type: ignore[no-untyped-def]
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(cpu_decode_step, "decode_layers", counted)
    g = torch.Generator().manual_seed(1)
    toks = [torch.randint(20, 40000, (n,), generator=g).tolist() for n in (40, 33, 17, 60)]
    seqs = [_seq(engine, i, t, 0) for i, t in enumerate(toks)]
    for s in seqs[:3]:  # every prompt but its last token cached, by a prompt chunk in Python
        runner.forward(Batch(scheduled=[ScheduledSeq(s, len(s.token_ids) - 1)]))
        s.num_computed_tokens = len(s.token_ids) - 1
    assert calls == []
    bs = engine.block_size
    last = [len(s.token_ids) - 1 for s in seqs[:3]]
    slots = torch.tensor(
        [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs[:3], last, strict=True)]
    )

    def step_kv() -> list[torch.Tensor]:
        c = runner.cache
        scales = [s for s in c.k_scale + c.v_scale if s is not None]
        return [k.view(-1, *k.shape[2:])[slots].clone() for k in c.k + c.v + scales]

    decode = Batch(scheduled=[ScheduledSeq(s, 1) for s in seqs[:3]])
    _, in_cpp = runner.forward(decode)
    cpp_kv = step_kv()
    assert calls == [3]
    model.decode_in_cpp = False
    _, in_python = runner.forward(decode)
    model.decode_in_cpp = True
    assert torch.equal(in_cpp, in_python)
    for a, b in zip(cpp_kv, step_kv(), strict=True):
        assert torch.equal(a, b)
    # A step with a prompt chunk in it stays in Python.
    runner.forward(Batch(scheduled=[ScheduledSeq(seqs[0], 1), ScheduledSeq(seqs[3], 60)]))
    assert calls == [3]


def test_the_cpp_decode_step_times_its_parts_only_when_asked(make_engine) -> None:  # type: ignore[no-untyped-def]
    """cpu_decode_step.timing: off (the default), a step adds nothing; on, the layers' linear
    projections, attention and the rest each take some of the call's time and no more than
    all of it; reading the totals zeroes them."""
    import time

    from kvserve.kernels import cpu_decode_step

    engine = make_engine(num_blocks=64, enable_prefix_caching=False)
    runner, model = engine.runner, engine.runner.model
    if model.decoder_weights is None or not cpu_decode_step.applies(2, model.config.head_dim):
        pytest.skip("no C++ kernels on this machine")
    g = torch.Generator().manual_seed(2)
    seqs = [_seq(engine, i, torch.randint(20, 40000, (n,), generator=g).tolist(), 0)
            for i, n in enumerate((21, 30))]  # fmt: skip
    for s in seqs:
        runner.forward(Batch(scheduled=[ScheduledSeq(s, len(s.token_ids) - 1)]))
        s.num_computed_tokens = len(s.token_ids) - 1
    decode = Batch(scheduled=[ScheduledSeq(s, 1) for s in seqs])
    assert cpu_decode_step.timing(False) is not None  # zeroes whatever came before
    runner.forward(decode)
    assert cpu_decode_step.timing(True) == ((0.0, 0.0, 0.0), 0.0)
    t0 = time.perf_counter()
    runner.forward(decode)
    wall = time.perf_counter() - t0
    timed = cpu_decode_step.timing(False)
    assert timed is not None and min(timed.layers) > 0
    assert timed.lm_head == 0.0  # forward's head is not the C++ call's
    assert sum(timed.layers) <= wall
    assert cpu_decode_step.timing(False) == ((0.0, 0.0, 0.0), 0.0)


# (sequence, tokens cached, new tokens this step): a final chunk after 30 cached, a first chunk
# of 50 of 90 (samples nothing), a 1-token prompt, decodes at 40 and 33 tokens.
MIXED = [(0, 30, 40), (1, 0, 50), (2, 0, 1), (3, 39, 1), (4, 32, 1)]


def _mixed_batch(engine) -> Batch:  # type: ignore[no-untyped-def]
    """MIXED as a Batch, the cached parts of its sequences computed."""
    g = torch.Generator().manual_seed(3)
    toks = [torch.randint(20, 40000, (n,), generator=g).tolist() for n in (70, 90, 1, 40, 33)]
    seqs = [_seq(engine, i, toks[i], c) for i, c, _ in MIXED]
    for i, c, _ in MIXED:
        if c:
            seqs[i].num_computed_tokens = 0
            engine.runner.forward(Batch(scheduled=[ScheduledSeq(seqs[i], c)]))
            seqs[i].num_computed_tokens = c
    return Batch(scheduled=[ScheduledSeq(seqs[i], n) for i, _, n in MIXED])


def test_the_step_metadata_carries_its_sizes_on_the_host(make_engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The Python ints the kernels size their launches by are those of the step's tensors, and
    the sampling rows' metadata is the full step's at the sampling chunks and decodes."""
    engine = make_engine(num_blocks=64, enable_prefix_caching=False)
    runner = engine.runner
    batch = _mixed_batch(engine)
    seen = []
    forward = runner.model.forward

    def spy(ids, positions, meta, cache, backend, out=None, launched=None):  # type: ignore[no-untyped-def]
        seen.append((positions, meta, out))
        return forward(ids, positions, meta, cache, backend, out, launched)

    monkeypatch.setattr(runner.model, "forward", spy)
    runner.run(batch)
    ((positions, meta, out),) = seen
    cu = meta.prefill_cu_query_lens
    assert meta.prefill_max_query_len == int((cu[1:] - cu[:-1]).max()) == 50
    assert meta.max_seq_len == int(positions.max()) + 1 == 70
    assert out is not None
    sub: AttentionMetadata = out.meta
    # The final chunk's last token, then the one-token rows (the 1-token prompt and decodes).
    assert out.rows.tolist() == [39, 90, 91, 92]
    assert sub.prefill_cu_query_lens.tolist() == [0, 1]
    assert sub.prefill_max_query_len == 1 and sub.max_seq_len == 70
    pick = torch.tensor([0])  # the one prefill chunk that samples
    for got, want in (
        (sub.prefill_context_lens, meta.prefill_context_lens[pick]),
        (sub.prefill_block_tables, meta.prefill_block_tables[pick]),
        (sub.decode_context_lens, meta.decode_context_lens),
        (sub.decode_block_tables, meta.decode_block_tables),
    ):
        assert got.dtype == want.dtype == torch.int32 and torch.equal(got, want)


def test_a_steps_integers_pack_into_one_aligned_buffer() -> None:
    """What a GPU step moves in one copy: every list at a 16-byte boundary in its dtype, empty
    ones too."""
    parts = [
        ([3, 1, 4], torch.long),
        ([], torch.long),
        ([1], torch.int32),
        ([5, 9, 2, 6, 5], torch.int32),
        ([], torch.int32),
        ([-3, 2**40], torch.long),
    ]
    host, spans = pack(parts)
    assert host.dtype == torch.uint8
    for (values, dtype), (a, b) in zip(parts, spans, strict=True):
        assert a % ALIGN == 0 and b - a == len(values) * dtype.itemsize
        assert host[a:b].view(dtype).tolist() == values
    taken = sorted(spans)
    assert all(b <= c for (_, b), (c, _) in itertools.pairwise(taken))  # no overlap


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_step_never_waits_for_the_device(make_engine) -> None:  # type: ignore[no-untyped-def]
    """The forward pass and logits of a mixed step and of a pure decode step queue their work
    without one host-device synchronisation (torch's sync debug mode raises on any); the step's
    one wait is the sampler's copy of its results."""
    engine = make_engine(num_blocks=64, enable_prefix_caching=False, device="cuda")
    runner = engine.runner
    batch = _mixed_batch(engine)
    decode = Batch(scheduled=[s for s in batch.scheduled if s.num_new_tokens == 1][1:])
    runner.run(batch)  # compiles the kernels
    runner.run(decode)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = runner.run(batch)
        runner.run(decode)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.logits.is_cuda and out.logits.isfinite().all()


@pytest.mark.parametrize(
    ("kind", "kv_dtype"), [("fp32", "auto"), ("fp32", "int8"), ("file", "auto")]
)
def test_a_run_ahead_step_is_one_cpp_call_with_the_python_paths_bits(  # type: ignore[no-untyped-def]
    make_engine, model_path, kind: str, kv_dtype: str
) -> None:
    """LlamaModel.decode_tokens (a run-ahead step's whole model call in C++: the embedding, an
    fp32 table or the file's rows, the layers, the LM head and the greedy draw) gives forward's
    K/V and compute_logits' logits bit for bit, and the argmax and logprob the sampler draws
    from them; the LM head's thread count changes nothing."""
    import dataclasses

    from kvserve.kernels import cpu_qlinear
    from kvserve.shared.engine.engine import Engine
    from kvserve.shared.engine.sampler import Sampler, SampleRow
    from kvserve.shared.model.loader import load_weights
    from kvserve.shared.sampling_params import SamplingParams

    engine = make_engine(num_blocks=64, enable_prefix_caching=False, kv_dtype=kv_dtype)
    if kind == "file":
        loaded = load_weights(model_path, torch.float32, keep=frozenset(cpu_qlinear.FORMATS))
        config = dataclasses.replace(engine.config, weights="file")
        engine = Engine(config, tokenizer=engine.tokenizer, weights=loaded)
    runner, model = engine.runner, engine.runner.model
    if model.token_weights is None:
        pytest.skip("no C++ kernels on this machine")
    assert (model.embed is None) == (kind == "file")  # the file's Q8_0 / Q4_1 rows, or fp32
    g = torch.Generator().manual_seed(3)
    toks = [torch.randint(20, 40000, (n,), generator=g).tolist() for n in (40, 17, 33)]
    seqs = [_seq(engine, i, t, 0) for i, t in enumerate(toks)]
    for s in seqs:  # every prompt but its last token cached
        runner.forward(Batch(scheduled=[ScheduledSeq(s, len(s.token_ids) - 1)]))
        s.num_computed_tokens = len(s.token_ids) - 2  # a run-ahead row: one past the computed
    decodes = [ScheduledSeq(s, 1) for s in seqs]
    pos, meta = runner._ahead_inputs(decodes)
    tokens = [s.token_ids[-1] for s in seqs]
    c = runner.cache
    bs = engine.block_size
    slots = torch.tensor(
        [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, pos.tolist(), strict=True)]
    )

    def step_kv() -> list[torch.Tensor]:
        scales = [s for s in c.k_scale + c.v_scale if s is not None]
        return [k.view(-1, *k.shape[2:])[slots].clone() for k in c.k + c.v + scales]

    step = model.whole_step(pos, meta, c, runner.backend)
    assert step is not None
    logits, drawn, logprobs = model.decode_tokens(tokens, step, head_threads=1, argmax=True)
    cpp_kv = step_kv()
    on_two = model.decode_tokens(tokens, step, head_threads=2)
    assert on_two[1:] == ([], [])  # no argmax asked, none drawn
    assert torch.equal(on_two[0], logits)
    hidden = model(torch.tensor(tokens), pos, meta, c, runner.backend)
    want = model.compute_logits(hidden)
    assert torch.equal(logits, want)
    for a, b in zip(cpp_kv, step_kv(), strict=True):
        assert torch.equal(a, b)
    greedy = SampleRow(SamplingParams(temperature=0.0), None)
    ids, lps, _ = Sampler().sample(want, [greedy] * len(seqs))
    assert (drawn, logprobs) == (ids, lps)
