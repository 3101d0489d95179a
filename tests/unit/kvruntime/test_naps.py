"""naps.py: kvruntime's own threads sleep with a 1 µs timer slack; the caller's threads keep
theirs. Read back from the kernel (prctl PR_GET_TIMERSLACK, the calling thread's), never timed."""

import ctypes
import ctypes.util
import sys
import threading

import pytest

from kvruntime.naps import SLACK_NS, tighten_timer_slack

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
