"""Per-request sampling settings, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_TOP = 20  # top_logprobs bound (OpenAI's)
# A temperature below this is greedy (vLLM's _SAMPLING_EPS): dividing the logits by a tinier one
# overflows float32 (inf - inf: NaN probabilities), and greedy is what it tends to anyway.
GREEDY_BELOW = 1e-5
# Any top_p at or below this keeps the most likely token alone (it has probability >= 1/vocab),
# so a smaller one is raised to it: one that rounds to 0 in float32 would keep no token at all.
MIN_TOP_P = 1e-9
# What a request may ask to suffer (SamplingParams.fault; honoured only by an engine started with
# fault injection): "raise" in its own output processing, "raise-step" in the step's forward (no
# single request to blame), "kill" its process (SIGKILL) when it is scheduled.
FAULTS = ("raise", "raise-step", "kill")


class InvalidRequestError(ValueError):
    """A request the engine refuses; `param` names the offending field (OpenAI's `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (below GREEDY_BELOW) means greedy. `n` samples share the prompt;
    `beam_width` > 1 switches to beam search (deterministic, HF semantics; excludes n > 1 and
    sampling). A top_p below MIN_TOP_P is stored as MIN_TOP_P (the same tokens survive)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # No EOS, stop token or stop string ends the output before this many tokens (vLLM's).
    min_tokens: int = 0
    logprobs: bool = False
    top_logprobs: int = 0  # with logprobs: this many most likely alternatives per token
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool = False
    skip_special_tokens: bool = True
    fault: str | None = None  # one of FAULTS: tests and `kvserve bench chaos` only

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(
                "max_tokens", f"max_tokens must be >= 1, got {self.max_tokens}"
            )
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(
                "temperature", f"temperature must be >= 0, got {self.temperature}"
            )
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise InvalidRequestError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_p < MIN_TOP_P:
            object.__setattr__(self, "top_p", MIN_TOP_P)
        if self.top_k < 0:
            raise InvalidRequestError("top_k", f"top_k must be >= 0, got {self.top_k}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                "min_tokens",
                f"min_tokens must be in [0, max_tokens ({self.max_tokens})], got {self.min_tokens}",
            )
        if not isinstance(self.n, int) or self.n < 1:
            raise InvalidRequestError("n", f"n must be >= 1, got {self.n}")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP:
            raise InvalidRequestError(
                "top_logprobs", f"top_logprobs must be in [0, {MAX_TOP}], got {self.top_logprobs}"
            )
        if self.beam_width < 1:
            raise InvalidRequestError(
                "beam_width", f"beam_width must be >= 1, got {self.beam_width}"
            )
        if self.beam_width > 1 and self.min_tokens:
            raise InvalidRequestError("min_tokens", "min_tokens is not supported with beam search")
        if self.beam_width > 1 and (self.n > 1 or not self.greedy):
            raise InvalidRequestError(
                "beam_width", "beam search is deterministic: use it with n=1 and temperature=0"
            )
        if not math.isfinite(self.length_penalty):
            raise InvalidRequestError("length_penalty", "length_penalty must be finite")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop", "stop strings must be non-empty")
        if self.fault is not None and self.fault not in FAULTS:
            raise InvalidRequestError("fault", f"fault must be one of {FAULTS}, got {self.fault!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
