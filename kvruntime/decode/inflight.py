"""Requests in flight: the handle an engine holds for each pull or push it started.

A handle is created by ``PrefillPeer.start_pull``/``start_push`` and returned at once. It moves
forward only when someone polls: ``handle.done()``, ``handle.wait()``, or the client's
``get_finished()`` (the shape an engine's step loop calls once per step). No thread of ours
spins in the background, so on a 2-core host the cores stay with the copies.

Every handle ends in exactly one of ``DONE`` or ``FAILED``, at the latest at its deadline, and is
reported once: by the ``wait``/``get_finished`` call that saw it finish. A failed handle says
whether it is *settled*: True when nothing can write into its destination blocks any more — its
copy ended (UCX completed the READ or WRITE, well or not; our own copy returned), never
started (refused, cancelled before it was posted), or the prefill said its WRITE ended. A
transfer cannot be cancelled once posted (transfer.py), so a request failed at its deadline
while its copy is in flight is *unsettled*: its blocks may still be written and must not be
reused until ``settled`` turns True, which happens as the client is polled (``get_finished``,
``get_settled``, ``wait_settled``) once the copy ends. A push's peer that leaves a cancel
unanswered is not trusted with new requests until it answers or is reconnected.
"""

from __future__ import annotations

import os
import threading
import time

from ..errors import KVRuntimeError, TransferError, TransferTimeout, WaitTimeout
from ..jobs import Job, TransferResult
from ..numbers import finite
from ..plan import TransferPlan
from ..wire import messages
from .states import DONE, FAIL, FAIL_UNSETTLED, FAILED, FINISH, PENDING, SETTLE, RequestState

# wait(): spin as long as the request should take (pace.py), then nap, doubling up to a cap
NAP_FIRST, NAP_MAX = 0.00002, 0.0002


class TransferHandle:
    """One pull (decode READs) or push (prefill WRITEs) request: a push the decode asks for
    (``start_push``), or one the prefill starts into blocks the decode named (``expect_push``).
    ``peer`` is the ``decode.PrefillPeer`` that started it (not imported here: decode imports
    this module, and a handle needs no name of its peer's class)."""

    def __init__(self, peer, op: str, request_id: str, *, plan: TransferPlan,
                 timeout: float, started: float | None = None, nbytes: int | None = None,
                 by_prefill: bool = False):
        self.peer = peer
        self.op = op
        self.request_id = request_id
        self.plan = plan
        # bytes that land here: the plan's blocks, or the head slice of them one prefill rank
        # holds (mixed TP: the peer's)
        self.nbytes = plan.nbytes if nbytes is None else nbytes
        self.timeout = timeout
        self.started = time.perf_counter() if started is None else started  # before planning
        self.deadline = time.monotonic() + timeout
        self._state = RequestState()  # its states and their moves: states.py
        self._result: TransferResult | None = None
        self._error: KVRuntimeError | None = None
        self.lock = threading.Lock()
        self._xfer: Job | None = None  # the copy that moves it (jobs.py); None: a push's WRITE
        self._reply: dict | None = None  # push: the "pushed" notification of its WRITE
        # push: the number its "push" or "expect" frame gave it, which its notification names
        self.number: int | None = None
        # whether progress needs the side channel (a push, a staged copy); a READ or a
        # same-node copy moves by polling its own transfer alone
        self.uses_peer = op == "push"
        self.reported = False
        # a push the prefill starts (expect_push): done by its WRITE's notification, timed
        # from its start (the notification's "posted") to the notification's arrival here
        self.by_prefill = by_prefill
        self._arrived: float | None = None  # wall clock, as "posted" is the prefill's
        # a direct NIXL request: whether it went through the pools, and why (coalesce.py)
        self.coalesce: tuple[bool, str] | None = None

    # where it stands (states.py): PENDING, DONE or FAILED; and whether nothing more can
    # write into its blocks (see module doc)
    state = property(lambda self: self._state.outcome)
    settled = property(lambda self: self._state.settled)

    # -- the caller's side -----------------------------------------------------------------
    def done(self) -> bool:
        """Poll once; True when the request has finished (either way)."""
        return self.poll() != PENDING

    def poll(self) -> str:
        if self.state == PENDING:
            if self.uses_peer:
                self.peer.pump()
            self.advance()
            if self.state == FAILED and not self.uses_peer:
                self.peer.pump()  # a failed copy: notice at once if the peer's connection died
            elif self.state == PENDING:  # our copy runs meanwhile: finished ones are released
                self.peer.port.flush_releases()  # now (releases.py), not as a wait returns
        return self.state

    def wait(self, timeout: float | None = None) -> TransferResult:
        """Block until finished and return the result, or raise the request's error. With
        ``timeout`` shorter than the request's own, raise ``WaitTimeout`` and leave the request
        running (a ``TransferTimeout`` means the request itself missed its deadline)."""
        return _block(self, timeout)

    @property
    def pooled(self) -> bool:
        """Its copy goes through the staging pools (staged.StagedPull): it may wait for pool
        units another request of its peer holds until that one is polled."""
        return getattr(self._xfer, "route", None) is not None

    def wait_settled(self, timeout: float) -> bool:
        """Poll until nothing more can land in this request's blocks (``settled``), at most
        ``timeout`` seconds; returns ``settled``. A pending request is waited for first."""
        return _wait_settled(self, timeout)

    def result(self) -> TransferResult:
        if self.state == PENDING:
            raise WaitTimeout(f"{self.op} request {self.request_id} has not finished")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    error = property(lambda self: self._error, doc="Its error (None: none, or not ended).")
    ok = property(lambda self: self.state == DONE)

    def __repr__(self) -> str:
        return (f"<TransferHandle {self.op} {self.request_id} {self.state} "
                f"{self.plan.num_blocks} blocks>")

    def attach(self, xfer: Job, *, uses_peer: bool | None = None,
               nbytes: int | None = None) -> None:
        """The copy that moves this request (jobs.py), timed from the caller's start_* call:
        planning and the launch count (the copy may run while the host is still launching
        it). ``uses_peer``: whether its progress needs the side channel (None: as it was);
        ``nbytes``: what lands, where the copy says (a READ of head-slice rows)."""
        xfer.start = self.started
        self._xfer = xfer
        if uses_peer is not None:
            self.uses_peer = uses_peer
        if nbytes is not None:
            self.nbytes = nbytes

    def replan(self, plan: TransferPlan, started: float | None) -> None:
        """A push the prefill started, at its "ready": from here it is our copy's ``plan``,
        timed from the prefill's start (``started`` on our clock; None: as it was)."""
        self.plan = plan
        if started is not None:
            self.started = started

    def chose_coalesce(self, chosen: bool, why: str) -> None:
        """Whether it goes through the pools, and why (coalesce.py): said in its result."""
        self.coalesce = (chosen, why)

    @property
    def coalesced(self) -> bool:
        return bool(self.coalesce and self.coalesce[0])

    # -- progress (called with the peer's I/O already pumped) ----------------------------------
    def advance(self) -> None:
        with self.lock:
            if self.state != PENDING:
                return
            if self._xfer is not None:
                self._advance_local()
                return
            missed = self._advance_push()
        if missed:  # sent outside our lock: a send that fails loses the channel, which
            self.peer.cancel(self)  # fails its pending handles, this one too (under its lock)

    def _advance_local(self) -> None:
        """A copy this process drives: a NIXL READ, a same-node engine's gather, a staged pull."""
        xfer = self._xfer
        state = xfer.poll()
        if state == "DONE":
            xfer.finish()
            # its clock started at the caller's start (attach): planning and the launch count
            self._finish(xfer.result())
            xfer.release(self.peer, self.request_id)
        elif state == "ERR":
            xfer.finish()
            self.fail(TransferError(f"{xfer.engine} of {self.nbytes} bytes for request "
                                    f"{self.request_id} failed: {xfer.error}"))
            xfer.give_back(self.peer, self.request_id)
        elif time.monotonic() > self.deadline:
            stopped = xfer.abort()
            why = ("its copy had ended: nothing more lands" if stopped else
                   "its copy is still in flight and may still write into the destination "
                   "blocks: reuse them only once handle.settled is True")
            waiting = xfer.waiting or "peer dead or stalled"
            self.fail(TransferTimeout(f"{self.op} of {self.nbytes} bytes for request "
                                       f"{self.request_id} missed its {self.timeout:.3f}s "
                                       f"deadline ({waiting}); {why}"), settled=stopped)
            self._stopped_or_drained(xfer, stopped)

    def _stopped_or_drained(self, xfer: Job, stopped: bool) -> None:
        """A failed copy: given back now if it has ended, else once it ends (settled then):
        the prefill may free its blocks then, not at its engine's own timeout."""
        if stopped:
            xfer.give_back(self.peer, self.request_id)
            return

        def ended():
            self._state.to(SETTLE)
            xfer.give_back(self.peer, self.request_id)
            self.peer.port.settled_late(self)

        self.peer.port.drain_later(xfer, ended, self.peer.agent)

    def done_elsewhere(self) -> None:
        """Another handle saw the copy that also moves this request end well (a batch's
        gather): finish now, unless this handle's own poll is at it (it then finishes itself;
        no lock order between handles, so none waits here)."""
        if not self.lock.acquire(blocking=False):
            return
        try:
            if self.state == PENDING:
                self._finish(self._xfer.result())
        finally:
            self.lock.release()

    def _advance_push(self) -> bool:
        """A push: finished once the prefill's answer came; failed at its deadline (True: its
        cancel is to be sent, once our lock is let go)."""
        if self._reply is not None:  # sent once NIXL flushed the WRITE: it has landed
            self._finish(_push_result(self, self._reply))
            self.peer.settled(self)
        elif time.monotonic() > self.deadline:
            # Ask the prefill to cancel; it also refuses any push read after its deadline, so
            # a stalled prefill that wakes up later never writes. Settled once it answers.
            why = ("the prefill had not pushed it or its WRITE had not landed" if self.by_prefill
                   else "the prefill had not answered it")
            why += ("; cancel sent: a WRITE the prefill has started cannot be stopped, so the "
                    "destination blocks may still be written: reuse them only once "
                    "handle.settled is True (the prefill's answer)")
            self.fail(TransferTimeout(
                f"push of request {self.request_id} ({self.nbytes} bytes) missed its "
                f"{self.timeout:.3f}s deadline; {why}"), settled=False)
            return True
        return False

    # -- events from the peer (frames) ----------------------------------------------------------
    def on_reply(self, message: dict) -> None:
        kind = message.get("type")
        if kind == messages.STAGE_QUEUED.type:  # the staged job's: why it waits
            heard = getattr(self._xfer, "on_reply", None)
            if heard is not None:
                heard(message)
            return
        if kind in (messages.STAGED.type, messages.STAGE_FAILED.type):  # the staged job's
            if kind == messages.STAGE_FAILED.type or (  # no more chunks (of its last piece)
                    message.get("last") is True and getattr(self._xfer, "last_piece", True)):
                self.peer.settled(self)
            self._xfer.on_reply(message)
            return
        with self.lock:
            if kind == messages.PUSHED.type:
                self._arrived = time.time()
                self._reply = message
                if self.state == FAILED:  # it landed after we gave up: the blocks were written
                    self._settle_now()
                    self.peer.port.log_late(self, "the prefill's WRITE ended after its "
                                                     "deadline (the blocks were written)")
            elif kind in (messages.PUSH_FAILED.type, messages.CANCELLED.type):
                # the prefill says its WRITE has ended (in error) or never started
                if self.state == PENDING:
                    self.fail(TransferError(f"prefill refused push of request "
                                             f"{self.request_id}: {message.get('error')}"))
                    self.peer.settled(self)
                else:
                    self._settle_now()

    def _settle_now(self) -> None:
        """A failed push the prefill has now answered: nothing more of it lands."""
        was = self.settled
        self._state.to(SETTLE)
        self.peer.settled(self)
        if not was:
            self.peer.port.settled_late(self)

    def close_push(self, why: str) -> str | None:
        """Its peer is closing (``PrefillPeer.close``) and will read nothing after: a push the
        prefill WRITEs (no copy of ours) fails now, unsettled, as its WRITE may run. Returns
        "cancel" for one failed here (its cancel is the close's to send), "wait" for one that
        failed before and awaits the answer to the cancel sent then, None for anything else
        (not such a push, settled, or done: a "pushed" already here finishes it)."""
        with self.lock:
            if self.op != "push" or self._xfer is not None:
                return None
            if self.state == PENDING and self._reply is not None:
                self._advance_push()  # it has landed: done, as the next poll would say
                return None
            if self.state == PENDING:
                self.fail(TransferError(f"push of request {self.request_id}: {why}"),
                          settled=False)
                return "cancel"
            return None if self.settled else "wait"

    def closed_unanswered(self, why: str, seconds: float) -> None:
        """The close read the prefill's frames ``seconds`` for the answer to this push's
        cancel: its error says whether it came (settled: nothing more lands) or not."""
        with self.lock:
            if self.settled:
                said = "the prefill answered its cancel: nothing more lands"
            else:
                said = (f"the prefill did not answer its cancel within {seconds:.1f}s, so the "
                        f"destination blocks may still be written: reuse them only once that "
                        f"prefill process has exited")
            self._error = TransferError(f"push of request {self.request_id}: {why}; {said}")

    def on_peer_lost(self, why: str) -> None:
        """The side channel broke: pending requests fail. A push the prefill has not answered
        stays unsettled: its WRITE may be running (a stalled prefill resumes and goes on with
        it before it reads that the connection ended)."""
        with self.lock:
            if self.state == PENDING:
                if self._xfer is not None:  # our own copy: settled once it has ended
                    stopped = self._xfer.abort()
                    self.fail(TransferError(f"{self.op} request {self.request_id}: {why}" + (
                        "" if stopped else "; its copy is still in flight and may still write "
                        "into the destination blocks until handle.settled")), settled=stopped)
                    self._stopped_or_drained(self._xfer, stopped)
                    return
                # a WRITE the prefill may have started: only its word settles it, and it is gone
                self.fail(TransferError(
                    f"{self.op} request {self.request_id}: {why}; the prefill never said its "
                    f"WRITE ended, so the destination blocks may still be written: reuse them "
                    f"only once that prefill process has exited"), settled=False)

    def _finish(self, result: TransferResult) -> None:
        if result.nbytes != self.nbytes:  # a copy job counts whole blocks; we got a head slice
            result = result._replace(nbytes=self.nbytes)
        if self.coalesce is not None:
            result = result._replace(coalesced=self.coalesce[0], coalesce_reason=self.coalesce[1])
        self._state.to(FINISH)
        self._result = result
        self.peer.pace.seen(self.op, result.nbytes, result.seconds)

    def fail(self, error: KVRuntimeError, settled: bool = True) -> None:
        self._state.to(FAIL if settled else FAIL_UNSETTLED)
        self._error = error


def _block(handle: TransferHandle, timeout: float | None) -> TransferResult:
    """``TransferHandle.wait``: poll until the request ends, spinning first where our polls
    drive its copy, then napping longer the longer it runs."""
    if handle.poll() != PENDING:  # already ended (a batch's handles after its first)
        handle.peer.port.consumed(handle)
        return handle.result()
    until = None if timeout is None else time.monotonic() + timeout
    own_thread = getattr(handle._xfer, "block", None)  # a copy that a thread of ours runs
    # spin first, yielding, where our polls drive the transfer: a READ, a staged copy's
    # READs, and a push, whose WRITE completes only as our UCX worker progresses (a nap
    # held it back); not where a thread of ours runs the copy (it has its own wait)
    spins = own_thread is None
    spin_until = time.perf_counter() + (
        handle.peer.pace.spin_seconds(handle.op, handle.nbytes) if spins else 0.0)
    nap = NAP_FIRST
    while handle.poll() == PENDING:
        if handle.pooled:  # the others through the pools move too (their runs free ours)
            handle.peer.advance_pooled(handle)
        if until is not None and time.monotonic() > until:
            raise WaitTimeout(f"{handle.op} request {handle.request_id} still in flight after "
                              f"{timeout:.3f}s (its own deadline is {handle.timeout:.3f}s)")
        if time.perf_counter() < spin_until:
            os.sched_yield()
            continue
        # a long request: give a core back to UCX's progress and the peer (2-core hosts),
        # napping longer the longer it runs, but waking as soon as what we wait for ends
        own_thread = getattr(handle._xfer, "block", None)  # a prefill's ready may start one
        if own_thread is not None:
            own_thread(NAP_MAX)
        elif handle.uses_peer:
            handle.peer.await_frame(nap)  # the prefill's answer ends the nap
        else:
            time.sleep(nap)
        nap = min(nap * 2, NAP_MAX)
    handle.peer.port.consumed(handle)
    return handle.result()


def _wait_settled(handle: TransferHandle, timeout: float) -> bool:
    """``TransferHandle.wait_settled``."""
    until = time.monotonic() + timeout
    while handle.poll() == PENDING and time.monotonic() < until:
        time.sleep(0.0002)
    while not handle.settled and time.monotonic() < until:
        handle.peer.port.progress_settling()
        if not handle.settled:
            time.sleep(0.0005)
    return handle.settled


def _push_result(handle: TransferHandle, reply: dict) -> TransferResult:
    """A push's result from its WRITE's "pushed" notification (``reply``): timed from the
    caller's start, or for one the prefill started, from its start to the notification's
    arrival (wall clocks). What NIXL posted is not known here (None)."""
    posted = _seconds(reply.get("posted")) if handle.by_prefill else None
    seconds = (max(handle._arrived - posted, 1e-9) if posted is not None else
               time.perf_counter() - handle.started)
    plan = handle.plan
    descriptors = reply.get("descriptors")
    if (not isinstance(descriptors, int) or isinstance(descriptors, bool)
            or not 0 < descriptors < 1 << 31):
        descriptors = plan.descriptor_count
    return TransferResult("WRITE", handle.nbytes, seconds, plan.num_runs, descriptors, None)


def _seconds(value) -> float | None:
    """A positive time a peer sent, or None (absent or not a finite number)."""
    out = finite(value)
    return out if out is not None and out > 0 else None
