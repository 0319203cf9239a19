"""How many threads a CPU step computes on.

A step of a few tokens reads every weight once and does little arithmetic per byte: split over
all cores it pays a synchronisation per kernel call (~150 a step) and, in a server, takes the
core that the event loop and the network need, so that a compute thread is preempted in the
middle of its share and the others wait for it. Whether one thread or all of them is faster
depends on the machine and on what else runs on it, so small steps measure both: per size
class (1, 2, 3-4, 5-8 tokens), each thread count is tried `WARMUP` times, then the faster one
(by the median of its last `WINDOW` step times) runs, and every `EXPLORE`-th step of the class
runs the other to keep its figure current. A median, not a moving average: a server's steps
on every core are now and then preempted (the event loop, the network, a background page
population), and one such step must not hand the next `EXPLORE` steps to the slower count
(with a moving average that gave 9-10 ms steps instead of 6.5 for stretches of a batch-1
decode on an Intel Xeon, family 6 model 167). Larger steps always use every thread. A step's
results do not depend on its thread count (each output is computed by one thread), only its
time does. Whatever the count, the step's LM head runs on every thread
(ModelRunner.head_threads).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

SMALL_STEP_TOKENS = 8  # steps of at most this many tokens choose their thread count
WARMUP = 3  # steps each thread count runs first, per size class
EXPLORE = 32  # every EXPLORE-th step of a class runs the slower thread count
WINDOW = 5  # the latest step times per thread count whose median decides
T = TypeVar("T")


class StepThreads:
    def __init__(self, max_threads: int, enabled: bool = True) -> None:
        """`max_threads`: the engine's thread count; not `enabled` (a GPU's steps): every
        step keeps it."""
        self.max_threads = max_threads
        self.options = (1, max_threads) if enabled and max_threads > 1 else (max_threads,)
        # size class -> thread count -> its latest WINDOW step times (seconds)
        self._stats: dict[int, dict[int, deque[float]]] = {}
        self._timed: dict[tuple[int, int], int] = {}  # (size class, threads) -> steps timed
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
        if (n := self._unwarmed(cls)) is not None:
            return n
        step = self._steps.get(cls, 0) + 1
        self._steps[cls] = step
        fast, slow = sorted(self.options, key=lambda n: self._median(cls, n))
        return slow if step % EXPLORE == 0 else fast

    def record(self, num_tokens: int, threads: int, seconds: float) -> None:
        cls = self.size_class(num_tokens)
        if cls is None or len(self.options) == 1:
            return
        self._stats.setdefault(cls, {}).setdefault(threads, deque(maxlen=WINDOW)).append(seconds)
        self._timed[cls, threads] = self._timed.get((cls, threads), 0) + 1

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
            cls: min(stats, key=lambda n: self._median(cls, n))
            for cls, stats in sorted(self._stats.items())
            if self._unwarmed(cls) is None
        }

    def _median(self, cls: int, threads: int) -> float:
        return statistics.median(self._stats[cls][threads])

    def _unwarmed(self, cls: int) -> int | None:
        """The first thread count of a size class timed fewer than WARMUP times, or None."""
        return next((n for n in self.options if self._timed.get((cls, n), 0) < WARMUP), None)


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
