"""The engine on an accelerator gives the CPU engine's and Hugging Face's answers, and its own
answers again with speculative drafts.

Marked `gpu` (deselected by default): ops/gpu_check.sh runs these on a CUDA device, and with
`--smoke` on the CPU, where KVSERVE_TEST_DEVICE=cpu runs the engine under test with the Triton
attention backend in Triton's interpreter. The reference is always the CPU engine with its own
backend, and HF transformers (fp32) on the device under test.

Tiny random Llamas (MHA, GQA, MQA) keep every test short; KVSERVE_TEST_MODEL names a full-size
model (GGUF file or HF directory) for `test_model_matches_cpu_and_hf`, skipped without it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from kvserve.shared.config import CacheConfig, EngineConfig, SpeculativeConfig
from kvserve.shared.engine.engine import Engine
from kvserve.shared.engine.sequence import Sequence
from kvserve.shared.model.tokenizer import KVTokenizer
from kvserve.shared.sampling_params import SamplingParams

from tests.shared.model.tiny_llama import save_tiny_llama

transformers = pytest.importorskip("transformers")

DEVICE = os.environ.get("KVSERVE_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not DEVICE, reason="needs a CUDA device or KVSERVE_TEST_DEVICE"),
]
# On the CPU the engine under test takes the Triton backend (interpreted), not its C++ default.
BACKEND = "triton" if DEVICE == "cpu" else "auto"
LOGIT_ATOL = 1e-3
TOKENS = 24
TEXTS = ["The quick brown fox", "Once upon a time there was a", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory, tokenizer: KVTokenizer) -> dict[int, Path]:
    """num_kv_heads -> a tiny random Llama in HF layout (4 query heads: MHA, GQA, MQA)."""
    dirs = {}
    for kvh in (4, 2, 1):
        d = tmp_path_factory.mktemp(f"tiny-kvh{kvh}")
        save_tiny_llama(d, tokenizer, kvh)
        dirs[kvh] = d
    return dirs


def engine(path: Path, speculative: SpeculativeConfig | None = None, **cache: Any) -> Engine:
    """The engine under test: on DEVICE, with BACKEND."""
    cfg = EngineConfig(
        model_path=str(path),
        device=DEVICE,
        attention_backend=BACKEND,
        cache=CacheConfig(num_blocks=256, **cache),
        speculative=speculative,
    )
    return Engine(cfg)


def reference(path: Path, **cache: Any) -> Engine:
    """The CPU engine with its default backend."""
    cfg = EngineConfig(model_path=str(path), cache=CacheConfig(num_blocks=256, **cache))
    return Engine(cfg)


def greedy(e: Engine, prompts: list[list[int]], n: int = TOKENS) -> list[list[int]]:
    return [c[0] for c in e.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))]


def hf_greedy(path: Path, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """HF's greedy tokens and last-position logits (fp32, on DEVICE), one prompt at a time."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    hf = hf.to(DEVICE).eval()
    tokens, logits = [], []
    for p in prompts:
        ids = torch.tensor([p], device=DEVICE)
        options = {"max_new_tokens": TOKENS, "do_sample": False, "eos_token_id": None}
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, **options)
            logits.append(hf(ids).logits[0, -1].float().cpu())
        tokens.append(out[0, len(p) :].tolist())
    return tokens, logits


def check_against_cpu_and_hf(path: Path, prompts: list[list[int]]) -> None:
    ours = engine(path)
    got = greedy(ours, prompts)
    assert got == greedy(reference(path), prompts)
    hf_tokens, hf_logits = hf_greedy(path, prompts)
    assert got == hf_tokens
    for p, want in zip(prompts, hf_logits, strict=True):
        assert (ours.score(p)[-1].float().cpu() - want).abs().max().item() < LOGIT_ATOL


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_tiny_models_match_cpu_and_hf(
    tiny_dirs: dict[int, Path], tokenizer: KVTokenizer, num_kv_heads: int
) -> None:
    check_against_cpu_and_hf(tiny_dirs[num_kv_heads], [tokenizer.encode(t) for t in TEXTS])


@pytest.mark.skipif(not os.environ.get("KVSERVE_TEST_MODEL"), reason="KVSERVE_TEST_MODEL unset")
def test_model_matches_cpu_and_hf(model_path: Path, tokenizer: KVTokenizer) -> None:
    if model_path.suffix == ".gguf":
        pytest.skip("HF's reference loads an HF directory here")
    check_against_cpu_and_hf(model_path, [tokenizer.encode(t) for t in TEXTS])


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_caches_agree_with_the_cpu(
    tiny_dirs: dict[int, Path], tokenizer: KVTokenizer, kv_dtype: str
) -> None:
    """The same quantized cache on both sides: the next-token distributions, teacher-forced
    along the CPU's greedy output, agree (the kernels sum in another order, so not bit for bit)."""
    prompts = [tokenizer.encode(t) for t in TEXTS]
    cpu, ours = reference(tiny_dirs[2], kv_dtype=kv_dtype), engine(tiny_dirs[2], kv_dtype=kv_dtype)
    for prompt, completion in zip(prompts, greedy(cpu, prompts), strict=True):
        seq = prompt + completion
        want = cpu.score(seq)[len(prompt) - 1 :].float().log_softmax(-1)
        got = ours.score(seq)[len(prompt) - 1 :].float().cpu().log_softmax(-1)
        kl = (want.exp() * (want - got)).sum(-1)
        assert kl.max().item() < 1e-3
        assert (want.argmax(-1) == got.argmax(-1)).float().mean().item() >= 0.9


def test_seeded_sampling_draws_what_the_cpu_draws(
    tiny_dirs: dict[int, Path], tokenizer: KVTokenizer
) -> None:
    """A seed draws the same uniforms on every device (they come from the request's CPU
    generator), so a sampled request's tokens are the CPU's."""
    prompts = [tokenizer.encode(t) for t in TEXTS]
    params = SamplingParams(max_tokens=TOKENS, temperature=0.8, top_p=0.95, seed=7)
    runs = [
        [c[0] for c in e.generate(prompts, params)]
        for e in (reference(tiny_dirs[2]), engine(tiny_dirs[2]))
    ]
    assert runs[0] == runs[1]


def test_prefix_cache_hit_gives_the_cold_answer(
    tiny_dirs: dict[int, Path], tokenizer: KVTokenizer
) -> None:
    """Two prompts that share a 5-block prefix: the second reads it from the device cache and
    answers as an engine without prefix caching does."""
    shared = tokenizer.encode("You are a terse assistant. " * 12)
    prompts = [shared + tokenizer.encode(t) for t in TEXTS]
    warm = engine(tiny_dirs[2])
    first = greedy(warm, prompts[:1])
    second = greedy(warm, prompts[1:])
    assert warm.prefix_cache_stats["hits_tokens"] >= 5 * 16 * len(second)
    cold = engine(tiny_dirs[2], enable_prefix_caching=False)
    assert first + second == greedy(cold, prompts)


def test_speculative_decoding_gives_the_same_greedy_tokens(
    tiny_dirs: dict[int, Path], tokenizer: KVTokenizer
) -> None:
    """Drafts verified on the device (drafted decodes as decode rows of the paged decode
    kernel, batched with plain decodes): the tokens of the same engine without drafts. A
    random model's answers repeat nothing for n-gram lookup to find, so the drafts here are
    the plain run's continuation, every third one wrong (accepted and rejected rows both)."""
    prompts = [tokenizer.encode(t) for t in TEXTS]
    plain = greedy(engine(tiny_dirs[2]), prompts)
    answers = {tuple(p): a for p, a in zip(prompts, plain, strict=True)}

    class Continuation:
        def propose(self, seq: Sequence, limit: int) -> list[int]:
            answer, at = (
                answers[tuple(seq.token_ids[: seq.num_prompt_tokens])],
                seq.num_output_tokens,
            )
            drafts = answer[at : at + min(3, limit, len(answer) - at - 1)]
            return [t + 1 if (at + i) % 3 == 2 else t for i, t in enumerate(drafts)]

    drafting = engine(tiny_dirs[2], SpeculativeConfig(num_speculative_tokens=3))
    drafting.scheduler.drafter = Continuation()
    assert greedy(drafting, prompts) == plain
    stats = drafting.spec_decode_stats
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
