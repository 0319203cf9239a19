"""Sampler: logits -> one token per row, with the logprob of that token (and, for rows whose
params ask for `top_logprobs`, the k most likely tokens' logprobs).

Greedy rows take the argmax. Sampled rows apply temperature, then top-k, then top-p, and draw
with the row's own `torch.Generator` when it has one (a seeded request gives the same output
whatever it is batched with); a row that verifies a speculative draft draws by `verify_draft`.
The engine seeds that generator afresh for every token (`position_seed`: the request's seed,
the completion's index, the token's position), so a request taken up again at any position
draws what it would have drawn. Logprobs are of the model's distribution (log-softmax of the
raw logits), as OpenAI reports them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from kvserve.kernels import cpu_ops
from kvserve.shared.sampling_params import SamplingParams


@dataclass(frozen=True)
class SampleRow:
    params: SamplingParams
    generator: torch.Generator | None
    # Columns this row may not draw now: its stop tokens before `min_tokens` outputs.
    suppressed: tuple[int, ...] = ()
    # Speculative decoding: the draft token (column) this row verifies; the row's token is
    # then the draft when it is accepted, else the replacement drawn (`verify_draft`).
    draft: int | None = None


def position_seed(seed: int, index: int, position: int) -> int:
    """The generator seed for output token `position` of completion `index` of a request
    seeded `seed` (63 bits, independent of the other positions')."""
    key = f"{seed}:{index}:{position}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] (already temperature-scaled) with tokens outside top-k / top-p set to -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p (keeps >= 1).
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """A token drawn from probs [V] (not necessarily normalised) by the exponential race, the
    method torch.multinomial uses for one draw: argmax p_i / E_i with E_i = -log U_i ~ Exp(1)
    picks token i with probability p_i / sum(p), never one of probability 0, and a token's win
    depends on the few likeliest alone, so last-bit differences in the logits almost never
    change it. The uniforms come from torch.rand: ~0.2 ms for a 49k vocabulary on a CPU against
    ~1 ms for torch.multinomial, whose exponential_ draws them one by one. The uniforms are drawn
    where the generator lives (a request's seeded generator is a CPU one), so a seed draws the
    same uniforms whatever device the logits are on."""
    where = probs.device if generator is None else generator.device
    u = torch.rand(probs.shape, generator=generator, device=where).to(probs.device)
    return int((probs / -torch.log(u)).argmax())


def verify_draft(probs: torch.Tensor, draft: int, generator: torch.Generator | None) -> int:
    """Rejection sampling of a draft proposed with certainty (a one-hot proposal, as n-gram
    lookup makes): accept `draft` with probability p(draft), and on rejection draw from p with
    the draft's mass removed, renormalised; the token returned is then distributed exactly as
    p [V] (not necessarily normalised), whatever the draft. Accepted: the draft is returned.

    One draw x ~ p decides both (the coupled form of the rule): x == draft has probability
    p(draft), and given x != draft, x is distributed as p / (1 - p(draft)) over the other
    tokens, which is the renormalised remainder. It takes no more random numbers than a
    decode without a draft and returns the very token such a decode draws with the same
    generator state, so a seeded request gives the same tokens with or without speculation."""
    return draw(probs, generator)


TopLogprobs = dict[int, float]  # token id -> logprob, most likely first


class Sampler:
    def __call__(
        self, logits: torch.Tensor, rows: list[SampleRow]
    ) -> tuple[list[int], list[float]]:
        """logits [N, V] float32 -> (token ids [N], logprobs [N])."""
        tokens, chosen, _ = self.sample(logits, rows)
        return tokens, chosen

    def sample(
        self, logits: torch.Tensor, rows: list[SampleRow]
    ) -> tuple[list[int], list[float], list[TopLogprobs | None]]:
        """As `__call__`, plus per row the `params.top_logprobs` most likely tokens and their
        logprobs (None for rows that ask for none)."""
        suppressed = [(i, row.suppressed) for i, row in enumerate(rows) if row.suppressed]
        if suppressed:  # the distribution drawn from (and reported) has them at zero
            logits = logits.clone()
            for i, cols in suppressed:
                logits[i, list(cols)] = float("-inf")
        # log p(token) = logit - logsumexp(logits). On the CPU one fused pass gives the argmax
        # and the logsumexp, reading the logits once and writing no [N, V] log-softmax.
        fused = cpu_ops.argmax_logsumexp(logits)
        top: torch.Tensor | None = None  # the argmax's logit, per row
        if fused is None:
            tokens, lse = torch.argmax(logits, dim=-1), torch.logsumexp(logits, dim=-1)
        else:
            tokens, lse, top = fused  # greedy default, [N]; [N]; [N]
        for i, row in enumerate(rows):
            p = row.params
            if p.greedy:
                continue
            scaled = apply_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
            probs = torch.softmax(scaled, dim=-1)
            if row.draft is None:
                tokens[i] = draw(probs, row.generator)
            else:
                tokens[i] = verify_draft(probs, row.draft, row.generator)
            top = None  # a drawn token is not the argmax
        if top is None:
            top = logits.gather(1, tokens[:, None])[:, 0]
        chosen = top - lse
        asked: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (row, values, ids)
        for i, row in enumerate(rows):
            k = min(row.params.top_logprobs, logits.shape[-1])
            if k > 0:
                values, ids = torch.topk(logits[i] - lse[i], k)
                asked.append((i, values, ids))
        if not logits.is_cpu:
            return to_host(tokens, chosen, asked)
        tops: list[TopLogprobs | None] = [None] * len(rows)
        for i, values, ids in asked:
            tops[i] = dict(zip(ids.tolist(), values.tolist(), strict=True))
        return tokens.tolist(), chosen.tolist(), tops


def to_host(
    tokens: torch.Tensor, chosen: torch.Tensor, asked: list[tuple[int, torch.Tensor, torch.Tensor]]
) -> tuple[list[int], list[float], list[TopLogprobs | None]]:
    """`Sampler.sample`'s results from a device in one copy to the host, the step's one wait
    for the device: tokens [N], their logprobs [N] and, per (row, values, ids) in `asked`, that
    row's top logprobs. As float64, which holds every float32 logprob and token id exactly."""
    parts = [tokens, chosen, *(t for _, values, ids in asked for t in (ids, values))]
    host = torch.cat([t.to(torch.float64) for t in parts]).tolist()
    n = tokens.shape[0]
    tops: list[TopLogprobs | None] = [None] * n
    at = 2 * n
    for i, values, _ in asked:
        k = values.shape[0]
        top_ids = [int(x) for x in host[at : at + k]]
        tops[i] = dict(zip(top_ids, host[at + k : at + 2 * k], strict=True))
        at += 2 * k
    return [int(x) for x in host[:n]], host[n : 2 * n], tops
