"""Short sleeps on Linux: the kernel's timer slack, and how long to poll instead of sleeping.

A thread's sleeps (``nanosleep``, ``select``, ``poll``) end up to its *timer slack* late, 50 µs
by default, so the kernel can batch wake-ups. On the H100 VM ``time.sleep(0)`` took 54 µs and
a 50 µs nap ~104: in a loop that polls a transfer, that lateness lands on every request.

kvruntime's own threads (the prefill's progress loop) set theirs to ``SLACK_NS`` when they
start. A caller's thread is never changed: a wait there polls without sleeping for as long as
a copy the GPU runs takes (samenode.py), or naps as the caller's process is set.

A thread that waits for a transfer polls without sleeping (yielding the core and the GIL
between polls) for as long as ``Pace`` says the transfer should take, then naps: a nap's
wake-up was up to ~0.2 ms late on the VMs, and a 1 GiB READ over NVLink (~3 ms) that outlived
a fixed 2 ms spin ended ~0.3 ms late.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("kvruntime")

PR_SET_TIMERSLACK = 29  # <linux/prctl.h>
SLACK_NS = 1000
SPIN_SECONDS = 0.002  # the least a wait polls without sleeping
SPIN_MARGIN, SPIN_CAP = 1.5, 0.05  # spin this many times the expected time, at most this long
# a prefill's progress loop sleeps through this much of a WRITE's expected time before it polls
# it without sleeping (the rest, and past it up to SPIN_MARGIN)
DUE_FRACTION = 0.7


class Pace:
    """The fastest a peer has moved a request's bytes, per operation, and from it how long to
    poll a transfer without sleeping: ``SPIN_MARGIN`` times the time a request of that size
    would take at that rate, at least ``SPIN_SECONDS`` and at most ``SPIN_CAP``. Requests slower
    than their peer has been (scattered blocks, a busy link) outlive the spin and nap as
    before; the rest end without a wake-up's delay. Pure bookkeeping, one per peer."""

    __slots__ = ("_best",)

    def __init__(self):
        self._best: dict[str, float] = {}  # op -> bytes a second

    def seen(self, op: str, nbytes: int, seconds: float) -> None:
        if seconds > 0 and nbytes > 0:
            rate = nbytes / seconds
            if rate > self._best.get(op, 0.0):
                self._best[op] = rate

    def expected(self, op: str, nbytes: int) -> float | None:
        """Seconds a request of ``nbytes`` takes at the fastest rate seen; None before any."""
        rate = self._best.get(op)
        return nbytes / rate if rate else None

    def spin_seconds(self, op: str, nbytes: int) -> float:
        expected = self.expected(op, nbytes)
        if expected is None:
            return SPIN_SECONDS
        return min(SPIN_CAP, max(SPIN_SECONDS, SPIN_MARGIN * expected))


def tighten_timer_slack(ns: int = SLACK_NS) -> bool:
    """Set the calling thread's timer slack to ``ns`` (Linux; its threads started later inherit
    it). False where the kernel or libc says no (then sleeps stay as they were)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(ns), 0, 0, 0) == 0:
            return True
        log.debug("prctl(PR_SET_TIMERSLACK) failed: errno %d", ctypes.get_errno())
    except (OSError, AttributeError) as exc:
        log.debug("no prctl for the timer slack: %s", exc)
    return False
