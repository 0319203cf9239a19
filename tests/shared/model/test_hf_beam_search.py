"""Beam search against HF `generate(num_beams=4, do_sample=False)` on the default model."""

from __future__ import annotations

import pytest
from kvserve.shared.sampling_params import SamplingParams

from tests.shared.model.fidelity import hf_generate

BEAMS = 4
MAX_NEW = 24


def hf_beam(model, prompt: list[int], length_penalty: float) -> list[int]:  # type: ignore[no-untyped-def]
    gen = hf_generate(
        model,
        prompt,
        num_beams=BEAMS,
        do_sample=False,
        max_new_tokens=MAX_NEW,
        length_penalty=length_penalty,
        early_stopping=False,
        eos_token_id=2,
    )
    while gen and gen[-1] == 0:  # HF pads a shorter best beam with pad_token_id
        gen.pop()
    return list(gen)


@pytest.mark.slow  # ~45 s (HF generate with 4 beams); run by `bash ops/test.sh -m slow`
@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_beam_search_matches_hf(  # type: ignore[no-untyped-def]
    make_engine, hf_gguf_model, chat_prompt_ids, length_penalty: float
) -> None:
    engine = make_engine()
    prompts = chat_prompt_ids[:4]
    params = SamplingParams(max_tokens=MAX_NEW, beam_width=BEAMS, length_penalty=length_penalty)
    ours = engine.generate(prompts, params)
    for prompt, completions in zip(prompts, ours, strict=True):
        assert completions[0] == hf_beam(hf_gguf_model, prompt, length_penalty)
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
    engine.kv.pool.check()


def test_beams_share_blocks_copy_on_write(make_engine, chat_prompt_ids) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine()
    engine.add_request("beam", chat_prompt_ids[0], SamplingParams(max_tokens=8, beam_width=BEAMS))
    saw_shared = saw_copy = False
    while engine.has_unfinished_requests():
        engine.step()
        req = engine._requests.get("beam")
        if req is not None and req.beam is not None and len(req.beam.seqs) == BEAMS:
            tables = [s.block_table for s in req.beam.seqs]
            full = len(chat_prompt_ids[0]) // engine.block_size
            # The prompt's full blocks are one set of blocks, held by every beam.
            assert all(t[:full] == tables[0][:full] for t in tables)
            saw_shared = all(engine.kv.pool.ref_counts[b] >= BEAMS for b in tables[0][:full])
            saw_copy = saw_copy or len({t[-1] for t in tables}) > 1
    assert saw_shared and saw_copy
