"""The free units of a staging pool (staging.py) as runs: first fit of ``n`` consecutive units.

A pool's units (one KV head of one block) are taken a request's run at a time and given back
whole, so the free ones form few runs. Kept as sorted, disjoint, non-touching ``[start, end)``
runs, a take walks the runs (one, while the pool is idle) and a give merges with its
neighbours by bisection. The byte-a-unit map this replaces searched for ``n`` free bytes with
``bytearray.find``: ~50 µs for a 1 GiB request's 32768 units on the 2-core host, 80 on the
H100 VM, paid by both sides of every coalesced request on its critical path.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left, bisect_right

from ..errors import StagingExhausted


class FreeRuns:
    """``units`` units, all free at first. Not thread-safe: the pool's lock guards it."""

    __slots__ = ("units", "_starts", "_ends")

    def __init__(self, units: int):
        self.units = units
        self._starts = [0] if units else []
        self._ends = [units] if units else []

    def take(self, n: int) -> int | None:
        """The first ``n`` consecutive free units (now taken): their start, or None."""
        if n < 1:
            raise ValueError(f"a take of {n} units: at least one is taken")
        for i, (start, end) in enumerate(zip(self._starts, self._ends)):
            if end - start >= n:
                if end - start == n:
                    del self._starts[i], self._ends[i]
                else:
                    self._starts[i] = start + n
                return start
        return None

    def give(self, start: int, n: int) -> None:
        """Units ``start .. start + n - 1`` are free (again): merged with the runs they touch.
        Giving back units already free leaves them free (a union, never an error)."""
        end = start + n
        if not 0 <= start <= end <= self.units:
            raise ValueError(f"units {start}..{end - 1} are outside the pool's {self.units}")
        if n == 0:
            return
        i = bisect_left(self._ends, start)  # the first run ending at or after ``start``
        j = bisect_right(self._starts, end)  # runs before j start at or before ``end``
        if i < j:  # runs i..j-1 overlap or touch: one run with ours
            start, end = min(start, self._starts[i]), max(end, self._ends[j - 1])
        self._starts[i:j] = [start]
        self._ends[i:j] = [end]

    def is_free(self, start: int, n: int) -> bool:
        """Every unit of ``start .. start + n - 1`` is free."""
        i = bisect_right(self._starts, start) - 1
        return i >= 0 and self._ends[i] >= start + n

    @property
    def free(self) -> int:
        return sum(e - s for s, e in zip(self._starts, self._ends))

    @property
    def largest(self) -> int:
        return max((e - s for s, e in zip(self._starts, self._ends)), default=0)

    def runs(self) -> list[tuple[int, int]]:
        """The free runs, ``(start, end)`` each, in order."""
        return list(zip(self._starts, self._ends))


def take_waiting(free: FreeRuns, cv: threading.Condition, n: int, deadline: float) -> int:
    """``n`` consecutive units of ``free`` (guarded by ``cv``, notified when units are given
    back), waited for until ``deadline`` (monotonic), never longer: past it, StagingExhausted
    with the pool's numbers."""
    t0 = time.monotonic()
    with cv:
        while True:
            start = free.take(n)
            if start is not None:
                return start
            left = deadline - time.monotonic()
            if left <= 0:
                raise StagingExhausted(
                    f"staging pool exhausted: {n} units wanted, largest free run "
                    f"{free.largest} of {free.units}, waited "
                    f"{time.monotonic() - t0:.3f}s until the request's deadline")
            cv.wait(left)

