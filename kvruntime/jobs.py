"""What a request's copy is to the handle that waits for it: the ``Job`` protocol.

A ``TransferHandle`` (inflight.py) moves a request by polling one job, whatever moves the bytes:
a NIXL READ (``transfer.PostedTransfer``), a same-node engine's gather (``samenode.CopyJob``),
one request's share of a batch's gather (``samenode.SharedJob``), or a pull through the staging
pools, host-staged or coalesced (``staged.StagedPull``). This is everything the handle calls on it.
"""

from __future__ import annotations

from typing import Protocol

from .transfer import TransferResult


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


class Blocking(Job, Protocol):
    """A job that a thread of ours runs (a same-node host copy, a CUDA event): a long wait
    sleeps in ``block`` until it ends instead of napping. The handle looks for ``block``
    (``getattr``): a job without it is driven by polls alone."""

    def block(self, seconds: float) -> None:
        """Wait at most ``seconds`` for the job to end."""
