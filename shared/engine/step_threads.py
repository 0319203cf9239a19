"""How many threads a CPU step computes on.

A step of a few tokens reads every weight once and does little arithmetic per byte: split over
all cores it pays a synchronisation per kernel call (~150 a step) and, in a server, takes the
core that the event loop and the network need, so that a compute thread is preempted in the
middle of its share and the others wait for it. Whether one thread or all of them is faster
depends on the machine and on what else runs on it, so small steps measure both: per size
class (1, 2, 3-4, 5-8 tokens), each thread count is tried `WARMUP` times, then the faster one
(by a moving average of step time) runs, and every `EXPLORE`-th step of the class runs the other
to keep its figure current. Larger steps always use every thread. A step's results do not depend
on its thread count (each output is computed by one thread), only its time does. Whatever the
count, the step's LM head runs on every thread (ModelRunner.head_threads).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

SMALL_STEP_TOKENS = 8  # steps of at most this many tokens choose their thread count
WARMUP = 3  # steps each thread count runs first, per size class
EXPLORE = 32  # every EXPLORE-th step of a class runs the slower thread count
ALPHA = 0.5  # weight of the latest step in the moving average
T = TypeVar("T")


class StepThreads:
    def __init__(self, max_threads: int, enabled: bool = True) -> None:
        """`max_threads`: the engine's thread count; not `enabled` (a GPU's steps): every
        step keeps it."""
        self.max_threads = max_threads
        self.options = (1, max_threads) if enabled and max_threads > 1 else (max_threads,)
        # size class -> thread count -> (steps timed, moving average of seconds)
        self._stats: dict[int, dict[int, tuple[int, float]]] = {}
        self._steps: dict[int, int] = {}

    @staticmethod
    def size_class(num_tokens: int) -> int | None:
        """0 (1 token), 1 (2), 2 (3-4), 3 (5-8); None for a step that uses every thread."""
        return (num_tokens - 1).bit_length() if 0 < num_tokens <= SMALL_STEP_TOKENS else None

    def choose(self, num_tokens: int) -> int:
        """The thread count for a step of `num_tokens` tokens."""
        cls = self.size_class(num_tokens)
        if cls is None or len(self.options) == 1:
            return self.max_threads
        stats = self._stats.setdefault(cls, {})
        if (n := self._unwarmed(stats)) is not None:
            return n
        step = self._steps.get(cls, 0) + 1
        self._steps[cls] = step
        fast, slow = sorted(self.options, key=lambda n: stats[n][1])
        return slow if step % EXPLORE == 0 else fast

    def record(self, num_tokens: int, threads: int, seconds: float) -> None:
        cls = self.size_class(num_tokens)
        if cls is None or len(self.options) == 1:
            return
        stats = self._stats.setdefault(cls, {})
        count, mean = stats.get(threads, (0, seconds))
        stats[threads] = (count + 1, mean + ALPHA * (seconds - mean))

    def run(self, num_tokens: int, step: Callable[[], T]) -> tuple[T, float]:
        """step() on the thread count chosen for its size, timed for the next choice: its
        result and seconds."""
        n = self.choose(num_tokens)
        t0 = time.perf_counter()
        with threads(n):
            result = step()
        seconds = time.perf_counter() - t0
        self.record(num_tokens, n, seconds)
        return result, seconds

    def preferred(self) -> dict[int, int]:
        """Per size class measured so far, the thread count it prefers now."""
        return {
            cls: min(stats, key=lambda n: stats[n][1])
            for cls, stats in sorted(self._stats.items())
            if self._unwarmed(stats) is None
        }

    def _unwarmed(self, stats: dict[int, tuple[int, float]]) -> int | None:
        """The first thread count of a size class timed fewer than WARMUP times, or None."""
        return next((n for n in self.options if stats.get(n, (0, 0.0))[0] < WARMUP), None)


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to n for the block. The calling thread's parallel regions
    follow it; torch also keeps it as the default of threads that start computing meanwhile
    (the engine's helper threads start with it, before any step)."""
    before = torch.get_num_threads()
    if n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
