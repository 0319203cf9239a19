"""Engines given one LoadedWeights share the model's packed weights (startup.load_model): each
gets a replica with state of its own, and answers as an engine with weights of its own."""

from __future__ import annotations

import dataclasses

from kvserve.shared.engine.engine import Engine
from kvserve.shared.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def test_engines_on_one_load_share_the_packing_and_keep_their_own_state(
    make_engine, chat_prompt_ids
):  # type: ignore[no-untyped-def]
    a, b = make_engine(num_blocks=64), make_engine(num_blocks=64)
    own = Engine(
        dataclasses.replace(a.config, weights="fp32"),  # read from the file, packed anew
        tokenizer=a.tokenizer,
    )
    try:
        ma, mb = a.runner.model, b.runner.model
        assert ma is not mb
        assert ma.layers is mb.layers  # one packing
        assert ma.layers[0].mlp.down.panels is mb.layers[0].mlp.down.panels
        assert own.runner.model.layers[0].mlp.down is not ma.layers[0].mlp.down
        assert ma.rope is not mb.rope

        prompts = chat_prompt_ids[:2]
        want = own.generate(prompts, GREEDY)
        mb.decode_in_cpp = False  # B's steps from Python, A's in the C++ step
        assert ma.decode_in_cpp
        # Alternating engines: each step binds its own model to its own cache.
        for engine in (a, b, a):
            got = engine.generate(prompts, GREEDY)
            assert got == want
        mb.decode_in_cpp = True
        assert b.generate(prompts, GREEDY) == want
        assert ma._bound is not None and mb._bound is not None
        assert ma._bound[0] is not mb._bound[0]  # each bound to its own engine's cache
    finally:
        for e in (a, b, own):
            e.close()
