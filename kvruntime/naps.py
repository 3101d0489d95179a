"""Short sleeps on Linux: the kernel's timer slack.

A thread's sleeps (``nanosleep``, ``select``, ``poll``) end up to its *timer slack* late, 50 µs
by default, so the kernel can batch wake-ups. On the H100 VM ``time.sleep(0)`` took 54 µs and
a 50 µs nap ~104: in a loop that polls a transfer, that lateness lands on every request.

kvruntime's own threads (the prefill's progress loop) set theirs to ``SLACK_NS`` when they
start. A caller's thread is never changed: a wait there polls without sleeping for as long as
a copy the GPU runs takes (samenode.py), or naps as the caller's process is set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("kvruntime")

PR_SET_TIMERSLACK = 29  # <linux/prctl.h>
SLACK_NS = 1000


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
