"""How long a wait spins before it naps: pure bookkeeping of how fast a peer has moved
requests, used by the decode's handles (inflight.py) and the prefill's WRITEs
(prefill/pushes.py)."""

from __future__ import annotations

# wait(): poll without sleeping, yielding the core and the GIL between polls, for as long as the
# request should take (Pace), at least SPIN_SECONDS; then nap, doubling up to a cap. A sleep
# ends its timer slack late, ~50 µs (naps.py), and a nap's wake-up up to ~0.2 ms on the VMs: a
# 1 GiB READ over NVLink (3 ms) that outlived a fixed 2 ms spin ended ~0.3 ms late.
SPIN_SECONDS = 0.002
SPIN_MARGIN, SPIN_CAP = 1.5, 0.05  # spin this many times the expected time, at most this long


class Pace:
    """The fastest a peer has moved a request's bytes, per operation, and from it how long a
    ``wait`` spins: ``SPIN_MARGIN`` times the time a request of that size would take at that
    rate, at least ``SPIN_SECONDS`` and at most ``SPIN_CAP``. Requests slower than their peer
    has been (scattered blocks, a busy link) outlive the spin and nap as before; the rest end
    without a wake-up's delay. Pure bookkeeping, one per peer."""

    __slots__ = ("_best",)

    def __init__(self):
        self._best: dict[str, float] = {}  # op -> bytes a second

    def seen(self, op: str, nbytes: int, seconds: float) -> None:
        if seconds > 0 and nbytes > 0:
            rate = nbytes / seconds
            if rate > self._best.get(op, 0.0):
                self._best[op] = rate

    def spin_seconds(self, op: str, nbytes: int) -> float:
        rate = self._best.get(op)
        if not rate:
            return SPIN_SECONDS
        return min(SPIN_CAP, max(SPIN_SECONDS, SPIN_MARGIN * nbytes / rate))
