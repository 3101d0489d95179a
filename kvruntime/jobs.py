"""What a request's copy is to the handle that waits for it: the ``Job`` protocol, the
``TransferResult`` every job ends with, and ``CopyJob``, the base of the copies this process drives.

A ``TransferHandle`` (inflight.py) moves a request by polling one job, whatever moves the bytes:
a NIXL READ (``transfer.PostedTransfer``), a same-node engine's gather (``samenode._HostJob``,
``samenode._CudaJob``), one request's share of a batch's gather (``samenode.SharedJob``), or a
pull through the staging pools, host-staged or coalesced (``staged.StagedPull``). ``Job`` is
everything the handle calls on it. They all live below the engines, so that every engine and the
handle take them from here.
"""

from __future__ import annotations

import time
from typing import NamedTuple, Protocol

from .plan import TransferPlan


class TransferResult(NamedTuple):
    """What one request moved, and how fast. A named tuple, immutable as a frozen dataclass
    but made in 0.3 µs against 1.1 (one ``object.__setattr__`` a field): a batch finishes a
    result a request, at once (samenode.Batch)."""

    op: str
    nbytes: int
    seconds: float
    runs: int
    descriptors: int  # what kvruntime asked for: runs x regions (x split pieces)
    nixl_descriptors: int | None  # what NIXL posted after merging, when telemetry exists
    engine: str = "nixl"  # which engine moved the bytes ("nixl", or a same-node engine)
    coalesced: bool = False  # a NIXL request moved through the staging pools (coalesce.py)
    coalesce_reason: str | None = None  # why it was, or was not (None: not a NIXL choice)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


class Job(Protocol):
    engine: str  # what moves it, as errors name it ("NIXL READ", "samenode:cuda_ipc"...)
    start: float  # perf_counter of the caller's start_* (set by TransferHandle.attach)
    error: str | None  # why it failed, once ``poll`` said "ERR" (None: no more is known)
    waiting: str | None  # what it waited for, if its deadline comes (None: the peer)

    def poll(self) -> str:
        """"PROC", "DONE" or "ERR"; never blocks."""

    def finish(self) -> None:
        """After "DONE" or "ERR": let go of what it holds (once its telemetry is taken)."""

    def result(self) -> TransferResult:
        """What it moved and how long it took (after "DONE")."""

    def abort(self) -> bool:
        """True once nothing more of it can land (it has ended); False while it still runs
        (it cannot be stopped: the handle hands it to a ``transfer.Draining``)."""

    def release(self, peer, request_id: str) -> None:
        """It ended well: tell ``peer`` (decode.PrefillPeer) the prefill may free the blocks."""

    def give_back(self, peer, request_id: str) -> None:
        """It failed and reads nothing any more: the prefill may free the blocks too."""

    def drop(self) -> None:
        """Still in flight at its owner's close deadline (``transfer.Draining.close``): let
        go of it before the owner's agent goes."""


class Blocking(Job, Protocol):
    """A job that a thread of ours runs (a same-node host copy, a CUDA event): a long wait
    sleeps in ``block`` until it ends instead of napping. The handle looks for ``block``
    (``getattr``): a job without it is driven by polls alone."""

    def block(self, seconds: float) -> None:
        """Wait at most ``seconds`` for the job to end."""


class CopyJob:
    """A copy this process drives (a ``jobs.Job``, as a NIXL READ is); the same-node jobs and
    staging's StagedPull build on it."""

    engine = "samenode"
    waiting: str | None = None  # past its deadline it waited for the peer
    # False for a rehearsal's copy into scratch (PrefillPeer.rehearse): the prefill holds no
    # request of it, so its end says nothing
    tells_prefill = True

    def __init__(self, op: str, plan: TransferPlan):
        self.op = op
        self.plan = plan
        self.state = "PROC"
        self.error: str | None = None
        self.start = time.perf_counter()
        self.end: float | None = None
        self.released = False

    @property
    def seconds(self) -> float:
        return (self.end or time.perf_counter()) - self.start

    def finish(self) -> None:
        self.released = True

    def release(self, peer, request_id: str) -> None:
        """The copy of ``request_id`` is done, or failed and reads nothing any more
        (``give_back``): tell the prefill it may free the blocks."""
        if self.tells_prefill:
            peer.release_later([request_id])

    give_back = release

    def abort(self) -> bool:
        """A local copy cannot be stopped; True once it has ended (then nothing writes)."""
        return self.poll() != "PROC"

    def drop(self) -> None:
        """Nothing to let go of: no NIXL handle keeps an agent alive (a GPU gather still
        queued runs on its stream after the close)."""

    def result(self):
        return TransferResult(self.op, self.plan.nbytes, self.seconds, self.plan.num_runs,
                              self.plan.descriptor_count, None, engine=self.engine)
