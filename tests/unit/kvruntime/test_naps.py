"""naps.py: kvruntime's own threads sleep with a 1 µs timer slack; the caller's threads keep
theirs. Read back from the kernel (prctl PR_GET_TIMERSLACK, the calling thread's), never timed."""

import ctypes
import ctypes.util
import sys
import threading

import pytest

from kvruntime.host.naps import SLACK_NS, tighten_timer_slack

PR_GET_TIMERSLACK = 30


def my_slack() -> int:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return libc.prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timer slack is Linux's")
def test_only_the_calling_thread_is_tightened():
    main_before = my_slack()
    seen = {}

    def worker():
        seen["before"] = my_slack()
        seen["ok"] = tighten_timer_slack()
        seen["after"] = my_slack()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["ok"] is True
    assert seen["after"] == SLACK_NS != seen["before"]
    assert my_slack() == main_before  # the caller's thread untouched


def test_readable_takes_any_fd_wakes_on_input_and_serves_threads_at_once():
    """naps.readable: a socket at fd 1024 or above (select.select refuses those), a nap that
    ends when input comes, and several threads waiting on one socket at once (a select.poll
    object raises "concurrent poll() invocation" there)."""
    import os
    import resource
    import socket
    import time

    from kvruntime.host.naps import readable

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    a, b = socket.socketpair()
    try:
        high = os.dup2(a.fileno(), 1100)
        assert readable(high) is False
        out = []
        waiters = [threading.Thread(target=lambda: out.append(readable(high, 10.0)))
                   for _ in range(3)]
        for w in waiters:
            w.start()
        time.sleep(0.05)
        b.send(b"x")
        for w in waiters:
            w.join(5)
        assert out == [True, True, True]
        os.close(high)
    finally:
        a.close(), b.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("spins", [False, True])
def test_await_readable_ends_on_input_or_at_its_time_either_way(monkeypatch, spins):
    """Polled (many cores) or blocked in ppoll (few): the same answers, on a real socket pair;
    the spinning one gives the core back between looks (sched_yield), never returns early."""
    import os
    import socket

    from kvruntime.host import naps

    monkeypatch.setattr(naps, "SPINS", spins)
    yields = []
    real_yield = os.sched_yield
    monkeypatch.setattr(naps.os, "sched_yield", lambda: yields.append(1) or real_yield())
    a, b = socket.socketpair()
    try:
        assert naps.await_readable(a.fileno(), 0.005) is False
        assert bool(yields) == spins
        b.send(b"x")
        assert naps.await_readable(a.fileno(), 5.0) is True
        a.recv(1)
        b.close()  # a closed peer reads as readable: the read says what happened
        assert naps.await_readable(a.fileno(), 5.0) is True
    finally:
        a.close()
        b.close()
