"""A role process's report, read by its parent (kvruntime/tools/roles.py ``answer``)."""

import multiprocessing as mp
import queue

from kvruntime.tools.roles import answer


class _LateQueue:
    """A real multiprocessing queue whose first wait ends empty, as a wait does when it times
    out just before the report's bytes come through the pipe. That moment is a race no test
    can force with real timing; the queue, the process and its report are real."""

    def __init__(self, q):
        self._q, self._first = q, True

    def get(self, timeout=None):
        if self._first:
            self._first = False
            raise queue.Empty
        return self._q.get(timeout=timeout)


def _report_and_exit(q):
    q.put({"ok": False, "error": "NixlNotFoundError: no module named nixl_missing_here"})


def test_a_report_put_just_before_its_process_exited_is_read_not_lost():
    """Before: the wait that ended empty found the process gone and reported its exit ("prefill
    process: prefill exited with code 0", seen in CI) instead of the report it had put."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    proc = ctx.Process(target=_report_and_exit, args=(q,), name="prefill")
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0
    got = answer(_LateQueue(q), 10, "prefill process", [proc])
    assert got == {"ok": False, "error": "NixlNotFoundError: no module named nixl_missing_here"}


def test_a_process_that_exits_without_a_report_is_named_with_its_exit_code():
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    proc = ctx.Process(target=lambda: None, name="prefill")
    proc.start()
    proc.join(30)
    got = answer(q, 10, "prefill process", [proc])
    assert got == {"ok": False, "error": "prefill process: prefill exited with code 0"}
