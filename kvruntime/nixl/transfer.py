"""One NIXL block transfer: posted without waiting, polled, released or aborted, once.

Posting (``make_prepped_xfer`` + ``transfer``) and each poll take the agent lock for one NIXL
call only, never for the transfer's duration: transfers of one agent to different peers, and
many requests in flight to one peer, progress side by side. A dead peer shows up as NIXL's ERR
state (UCX's peer-failure handling) or, if UCX never notices, as the deadline passing: either
way the request fails, never hangs.

A posted READ or WRITE cannot be stopped: UCX's ``ucp_request_cancel`` cancels tag receives only,
and NIXL's release of a handle still in flight calls it and lets the request run on, so the bytes
of a "released" transfer land at a later progress of either side's worker (over tcp every time,
measured: a 32 MiB READ released at its 2 ms deadline was written whole into blocks the caller
had reused). So a transfer ends only when UCX says it has: ``abort`` releases the handle of one
that has ended and otherwise keeps it (False: it may still touch its memory), and ``Draining``
holds such transfers, polled by their owner's progress until UCX completes them, then released,
and only then is their memory trusted again (``settled``). The one exception is the owner's
close: what is still in flight at its deadline is dropped with the agent (``Draining.close``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from ..errors import KVRuntimeError, NixlError, TransferError
from ..jobs import TransferResult
from ..plan import TransferPlan
from .agent import Agent

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Rows:
    """A transfer's own descriptor lists (Nx3 address, length, device id), paired row by row,
    for what prepared per-block lists cannot express: a head slice of each block (mixed TP)."""

    local: object
    remote: object
    remote_agent: str
    local_mem: str
    remote_mem: str

    @property
    def nbytes(self) -> int:
        return int(self.local[:, 1].sum())


class PostedTransfer:
    """READ (remote is the source) or WRITE (remote is the destination) of ``plan``, posted at
    construction. ``poll`` returns "PROC", "DONE" or "ERR"; the NIXL handle is released exactly
    once, by ``finish`` (after DONE/ERR) or ``abort`` (before). A decode's READ is a
    ``jobs.Job``."""

    waiting: str | None = None  # past its deadline it waited for the peer (jobs.Job)

    def __init__(self, agent: Agent, op: str, *, plan: TransferPlan | None = None,
                 local_dlist=None, remote_dlist=None, rows: "Rows | None" = None,
                 notif: bytes = b"", split: int = 1):
        """Either ``rows`` (this request's own descriptor lists) or ``plan`` over the prepared
        ``local_dlist`` and ``remote_dlist`` (cut ``split`` pieces a run); ``notif``: the NIXL
        notification the remote side gets when it ends (empty: none)."""
        self.agent = agent
        self.op = op
        self.plan = plan
        self.split = split
        self.rows = rows
        self.state = "PROC"
        self.released = False
        self.descriptors_posted: int | None = None
        nixl = agent.nixl
        self.start = time.perf_counter()
        try:
            if rows is not None:  # descriptors of this request only (mixed TP: head rows)
                self._handle = agent.call(
                    "initialize_xfer", nixl.initialize_xfer, op,
                    nixl.get_xfer_descs(rows.local, rows.local_mem),
                    nixl.get_xfer_descs(rows.remote, rows.remote_mem), rows.remote_agent, notif)
            else:
                src_idx, dst_idx = plan.nixl_indices(split)
                remote_is_src = op == "READ"
                local_idx, remote_idx = (dst_idx, src_idx) if remote_is_src else (src_idx, dst_idx)
                self._handle = agent.call("make_prepped_xfer", nixl.make_prepped_xfer, op,
                                          local_dlist, local_idx, remote_dlist, remote_idx, notif)
        except NixlError as exc:
            raise TransferError(f"{op} could not be prepared: {exc}") from exc
        try:
            self.state = self._seen(_state(agent.call("transfer", nixl.transfer, self._handle)))
        except NixlError as exc:
            # never posted whole; UCX may hold the pieces posted before the failure (settle.py)
            self.agent.failed_transfers += 1
            self._release()
            raise TransferError(f"{op} of {self.nbytes} bytes could not be posted: {exc}"
                                ) from exc
        self.end = time.perf_counter() if self.state != "PROC" else None

    def poll(self) -> str:
        if self.state == "PROC" and not self.released:
            try:
                state = _state(self.agent.call("check_xfer_state",
                                               self.agent.nixl.check_xfer_state, self._handle))
            except NixlError as exc:
                log.warning("%s: %s", self.op, exc)
                state = "ERR"
            if state != "PROC":
                self.end = time.perf_counter()
                self.state = self._seen(state)
        return self.state

    def drop(self) -> None:
        """Release the handle of a transfer still in flight, at its owner's close, just before
        its agent goes (``Draining.close``): it counts as failed (settle.py)."""
        self.agent.failed_transfers += 1
        self._release()

    def _seen(self, state: str) -> str:
        if state == "ERR":  # UCX may still hold some of it (settle.py)
            self.agent.failed_transfers += 1
        return state

    @property
    def seconds(self) -> float:
        return (self.end or time.perf_counter()) - self.start

    @property
    def engine(self) -> str:
        return f"NIXL {self.op}"

    @property
    def error(self) -> str:
        """Why a transfer that ended in error failed, as far as this side can tell."""
        side = "prefill" if self.op == "READ" else "decode"
        return f"the {side} is gone or refused the memory access"

    def release(self, peer, request_id: str) -> None:
        """A READ carries no NIXL notification (decode/client.py): the prefill hears of it by frame,
        whether it ended well or, failed, reads nothing any more (``give_back``)."""
        peer.release_later([request_id])

    give_back = release

    def finish(self) -> None:
        """Release the handle of a finished transfer (after taking its telemetry)."""
        if self.released:
            return
        if self.state == "DONE":
            self.descriptors_posted = self.agent.descriptor_count(self._handle)
        self._release()

    def abort(self) -> bool:
        """Stop this transfer if it has ended: True once UCX has completed it (DONE or ERR)
        and its handle is released, so that nothing more touches its memory. False while it
        is still in flight: the handle is kept (releasing it would not stop the READ or
        WRITE, module doc) and the owner hands it to a ``Draining``."""
        if self.released:
            return True
        if self.poll() == "PROC":
            return False
        self.finish()
        return self.released

    def _release(self) -> bool:
        if self.released:
            return True
        try:
            with self.agent.lock:
                self._handle.release()
        except Exception as exc:  # an un-abortable transfer: NIXL keeps it in its leak list
            log.warning("releasing the %s handle (state %s) failed: %s", self.op, self.state,
                        exc)
            return False
        self.released = True
        return True

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes if self.rows is not None else self.plan.nbytes

    def result(self) -> TransferResult:
        pieces = (len(self.rows.local) if self.rows is not None
                  else self.plan.piece_count(self.split))
        return TransferResult(self.op, self.nbytes, self.seconds, self.plan.num_runs, pieces,
                              self.descriptors_posted)


# Pieces a run is cut into at most (``split``): more than NIXL's UCX threads buys nothing, and
# a run of n blocks is cut into n pieces at most whatever is asked.
MAX_SPLIT = 1024


def check_split(split) -> int:
    """A caller's ``split`` (pieces a run), checked: an integer in 1..MAX_SPLIT."""
    if isinstance(split, bool) or not isinstance(split, int) or not 0 < split <= MAX_SPLIT:
        raise KVRuntimeError(f"split must be an integer in 1..{MAX_SPLIT} (pieces a run of "
                             f"blocks is cut into), got {split!r}")
    return split


def split_runs(descriptors: int, threads: int) -> int:
    """Pieces per run for a READ of ``descriptors`` runs over ``threads`` UCX threads: NIXL
    spreads a request's descriptors over its UCX threads but cannot split one, so host memory
    with several copy streams gets at least one descriptor per stream; one thread, 1 (the
    coalesce probe cuts its one-range READ by this too)."""
    if threads < 2:
        return 1
    return min(MAX_SPLIT, -(-threads // descriptors))


def _state(value) -> str:
    state = value.decode() if isinstance(value, bytes) else str(value)
    return state if state in ("PROC", "DONE") else "ERR"


class Draining:
    """Copies that failed while still in flight (a READ or WRITE past its deadline, a same-node
    gather on the GPU), each with what to do once it has ended: polled by their owner's
    progress (``poll``) until UCX, or the copy's own engine, says it has ended, then released
    and ``on_end`` called — the moment their memory is settled."""

    def __init__(self):
        self._items: list = []
        self._lock = threading.Lock()

    def add(self, xfer, on_end, owner: str | None = None) -> None:
        """``owner``: the remote agent it reads from or writes to (whose metadata it uses)."""
        with self._lock:
            self._items.append((xfer, on_end, owner))

    def __len__(self) -> int:
        return len(self._items)

    def holds(self, owner: str) -> bool:
        with self._lock:
            return any(o == owner for _x, _e, o in self._items)

    def poll(self) -> int:
        """Poll each once; end those done. Returns how many are still in flight."""
        if not self._items:
            return 0
        with self._lock:
            items, self._items = self._items, []
        left = []
        for item in items:
            xfer, on_end, _owner = item
            if xfer.poll() == "PROC":
                left.append(item)
                continue
            xfer.finish()
            try:
                on_end()
            except Exception:  # one owner's callback never keeps the others in flight
                log.exception("settling a drained %s", getattr(xfer, "op", "copy"))
        with self._lock:
            self._items.extend(left)
            return len(self._items)

    def drain(self, seconds: float) -> int:
        """Poll until none is left or ``seconds`` have passed (a close); how many are left."""
        until = time.monotonic() + seconds
        while self.poll() and time.monotonic() < until:
            time.sleep(0.001)
        return len(self._items)

    def close(self, seconds: float) -> int:
        """At the owner's close, before its agent's: drain for up to ``seconds``, then release
        the handles of those still in flight (a peer stalled: a READ over tcp waits for its
        process), so that the agent is destroyed with its close and UCX's end of the
        connections goes with it. A handle kept would keep NIXL's agent and its UCX threads
        alive, and the stalled peer's bytes would land once it resumes, in memory the caller
        has freed (SIGSEGV in ucp_get_rep_handler; or, reused, another tensor's). Their
        ``on_end`` is not called: the memory is settled only once the agent is gone. Returns
        how many were released in flight; they count as failed on their agent (settle.py)."""
        if not self.drain(seconds):
            return 0
        with self._lock:
            items, self._items = self._items, []
        for xfer, _on_end, _owner in items:
            xfer.drop()
        return len(items)


def read_now(agent: Agent, rows: Rows, *, what: str, timeout: float, draining: Draining,
             plan: TransferPlan | None = None, nap: float = 0.0) -> float:
    """One NIXL READ of ``rows`` posted and waited for here, for a connect's probe or warm-up
    (never a request: those are polled by their handles). Returns its seconds, from before
    the post to the poll that saw it done; ``nap``: seconds between polls (0: spin, where the
    seconds are measured). Raises TransferError naming ``what`` when it fails or has not
    ended within ``timeout``: one still in flight then is held by ``draining`` until UCX ends
    it (its memory is not trusted before)."""
    start = time.perf_counter()
    xfer = PostedTransfer(agent, "READ", plan=plan, rows=rows)
    until = time.monotonic() + timeout
    try:
        while xfer.poll() == "PROC":
            if time.monotonic() > until:
                raise TransferError(f"{what} did not finish in {timeout:.1f}s")
            if nap:
                time.sleep(nap)
        seconds = time.perf_counter() - start
        if xfer.state != "DONE":
            raise TransferError(f"{what} failed")
        return seconds
    finally:
        if not xfer.abort():  # still in flight: released once UCX ends it
            draining.add(xfer, lambda: None, rows.remote_agent)
