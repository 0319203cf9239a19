"""SimulatedRunner: the ModelRunner's stand-in in a simulated engine. The model's forward pass is
the one part of an engine a simulation replaces: the step waits for the time the cost profile
gives for its batch (times `time_scale`, the simulation's slow-down), then yields logits that
make the sampler pick a deterministic word.

A profile's time is the whole engine step's (schedule, model call, sampling and outputs: what
`kvserve worker --step-log` records and BLIS's step time covers), so the wait ends that long
after the step began, less the time the step's work after the model call has been taking (a
running average): the simulated engine's own host work is inside the modelled time, not added
to it, unless it takes longer.

Everything else is the production code around it: the Batch comes from the real scheduler, the
block copies of copy-on-write are made in the real KV cache, and the logits go to the real
OutputProcessor (sampling, stops, forks, outputs), whose sampled tokens extend the sequences.

Tokens: the logits cover `WordVocabulary.ids` (a few hundred tokens that decode to a plain
word), one column far above the rest; which one is a function of the sequence's last token and
position only, so a request taken over by another worker, which continues from the client's
last token, goes on with exactly the tokens the first worker would have emitted. EOS is never
among them: a simulated request runs to its max_tokens (or a stop string).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import torch
from kvserve.shared.engine.kv.cache import KVCache
from kvserve.shared.engine.model_runner import StepOutput
from kvserve.shared.engine.scheduler import Batch, ScheduledSeq
from kvserve.shared.engine.sim.profile import CostProfile, StepShape
from kvserve.shared.model.tokenizer import KVTokenizer

WORDS = 256  # columns of a simulated step's logits
_WORD = re.compile(r"^ [a-z]{2,12}$")
# The chosen column's logit; the others are 0, so even a sampled row takes it (p > 0.999).
PEAK = 40.0


class WordVocabulary:
    """The first WORDS token ids (in id order) whose text is one lower-case word after a
    space: the tokens a simulated engine emits."""

    def __init__(self, tokenizer: KVTokenizer, size: int = WORDS) -> None:
        ids: list[int] = []
        special = set(tokenizer.eos_token_ids)
        for i in range(tokenizer.vocab_size):
            if i not in special and _WORD.match(tokenizer.decode([i])):
                ids.append(i)
                if len(ids) == size:
                    break
        if not ids:
            raise ValueError("the tokenizer has no plain-word token to simulate output with")
        self.ids = tuple(ids)

    def __len__(self) -> int:
        return len(self.ids)

    def column(self, last_token: int, position: int) -> int:
        """The column the token at `position` (after `last_token`) is drawn from: a mix of
        both (Knuth's multiplicative hash), the same in every process."""
        mixed = (last_token * 2654435761 + position * 40503) & 0xFFFFFFFF
        return (mixed >> 7) % len(self.ids)


_vocabularies: dict[str, WordVocabulary] = {}


def word_vocabulary(tokenizer: KVTokenizer) -> WordVocabulary:
    """The tokenizer's WordVocabulary, built once per process (many simulated engines share
    one tokenizer)."""
    vocab = _vocabularies.get(tokenizer.fingerprint)
    if vocab is None:
        vocab = _vocabularies[tokenizer.fingerprint] = WordVocabulary(tokenizer)
    return vocab


class SimulatedRunner:
    """Runs a Batch as the ModelRunner does, in the modelled time (see the module docstring).
    `sleep` and `clock` are injectable so tests can advance a clock instead of waiting."""

    def __init__(
        self,
        profile: CostProfile,
        cache: KVCache,
        vocab: WordVocabulary,
        time_scale: float = 1.0,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.profile = profile
        self.cache = cache
        self.vocab = vocab
        self.time_scale = time_scale
        self.sleep = sleep
        self.clock = clock
        self.modelled_s = 0.0  # the modelled seconds of every step run (unscaled)
        self.late_s = 0.0  # wall seconds the steps ran past their modelled end (host work)
        self._started: float | None = None  # when the engine's current step began
        self._returned = 0.0  # when run() returned
        self._after_s = 0.0  # running average: a step's work after run() returned

    def begin_step(self) -> None:
        self._started = self.clock()

    def end_step(self) -> None:
        after = self.clock() - self._returned
        self._after_s += 0.2 * (after - self._after_s)

    def run(self, batch: Batch, launched: Callable[[], None] | None = None) -> StepOutput:
        t0 = self.clock() if self._started is None else self._started
        self._started = None
        for src, dst in batch.block_copies:
            self.cache.copy_block(src, dst)
        rows = [(s.num_new_tokens, s.seq.num_computed_tokens, s.samples) for s in batch.scheduled]
        seconds = self.profile.step_seconds(StepShape.of_rows(rows))
        self.modelled_s += seconds
        sampling = self._sampling_order(batch)
        logits = self._logits(sampling)
        if launched is not None:
            launched()
        self._wait_until(t0 + seconds * self.time_scale - self._after_s)
        self._returned = self.clock()
        return StepOutput([s.seq for s in sampling], logits, columns=self.vocab.ids)

    @staticmethod
    def _sampling_order(batch: Batch) -> list[ScheduledSeq]:
        """The sampling rows in the ModelRunner's order: prompt chunks first, then decodes."""
        chunks = [s for s in batch.scheduled if s.num_new_tokens > 1 and s.samples]
        decodes = [s for s in batch.scheduled if s.num_new_tokens == 1 and s.samples]
        return chunks + decodes

    def _logits(self, sampling: list[ScheduledSeq]) -> torch.Tensor:
        """[len(sampling), WORDS]: each row's deterministic column at PEAK, the rest 0."""
        logits = torch.zeros((len(sampling), len(self.vocab)), dtype=torch.float32)
        for i, s in enumerate(sampling):
            seq = s.seq
            logits[i, self.vocab.column(seq.token_ids[-1], seq.num_tokens)] = PEAK
        return logits

    def _wait_until(self, deadline: float) -> None:
        left = deadline - self.clock()
        if left > 0:
            self.sleep(left)
        else:
            self.late_s -= left
