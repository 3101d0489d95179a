"""Short sleeps on Linux: the kernel's timer slack.

A thread's sleeps (``nanosleep``, ``select``, ``poll``) end up to its *timer slack* late, 50 µs
by default, so the kernel can batch wake-ups. On the H100 VM ``time.sleep(0)`` took 54 µs and
a 50 µs nap ~104: in a loop that polls a transfer, that lateness lands on every request.

kvruntime's own threads (the prefill's progress loop) set theirs to ``SLACK_NS`` when they
start. A caller's thread is never changed: a wait there polls without sleeping for as long as
a copy the GPU runs takes (samenode.py), or naps as the caller's process is set.

``readable`` naps until a socket has input: ``ppoll``, whose timeout is in nanoseconds and
which takes any fd number. ``select.select`` refuses fds of 1024 and above (engines hold
thousands), ``select.poll`` and epoll count whole milliseconds (a 20 µs nap would be 1 ms),
and a ``select.poll`` object cannot be polled by two threads at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import select
import time

log = logging.getLogger(__name__)

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


class _PollFd(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]


class _TimeSpec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_ppoll = _libc.ppoll
_ppoll.argtypes = (ctypes.POINTER(_PollFd), ctypes.c_ulong, ctypes.POINTER(_TimeSpec),
                   ctypes.c_void_p)
_ppoll.restype = ctypes.c_int
_WANTED = select.POLLIN | select.POLLPRI


def readable(fd: int, seconds: float = 0.0) -> bool:
    """Whether ``fd`` has input (or was closed or failed: a read then says so), waiting at most
    ``seconds`` (0: just look). The GIL is let go while it waits (ctypes)."""
    pfd = _PollFd(fd, _WANTED, 0)
    whole = int(seconds)
    ts = _TimeSpec(whole, int((seconds - whole) * 1e9))
    got = _ppoll(ctypes.byref(pfd), 1, ctypes.byref(ts), None)
    if got < 0:
        err = ctypes.get_errno()
        if err == errno.EINTR:
            return False
        raise OSError(err, os.strerror(err))
    return got > 0


# From this many cores of ours, a wait for a peer's frame polls its socket, yielding the core
# between looks, instead of blocking in ppoll: a blocked thread's wake-up waits for a core to
# take it (on a busy host, a scheduler tick), and a side channel's answers are what a
# coalesced request waits for once per chunk. Below it (the 2-core CI host) the core goes to
# the peer's and our copies instead, as it always did.
SPIN_CORES = 8


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


SPINS = _cores() >= SPIN_CORES


def await_readable(fd: int, seconds: float) -> bool:
    """``readable(fd, seconds)``, polled without blocking where ``SPINS`` (many cores)."""
    if not SPINS:
        return readable(fd, seconds)
    until = time.perf_counter() + seconds
    while not readable(fd):
        if time.perf_counter() >= until:
            return False
        os.sched_yield()
    return True
