"""Posting one block transfer through NIXL and waiting for it, with a deadline.

A dead peer shows up as NIXL's ERR state (UCX's peer-failure handling) or, if UCX never
notices, as the deadline passing: either way the caller gets a TransferError, never a hang.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from .agent import Agent
from .errors import NixlError, TransferError, TransferTimeout
from .plan import TransferPlan

log = logging.getLogger("kvruntime")

NOTIF_PREFIX = b"kvr:free:"


@dataclass(frozen=True)
class TransferResult:
    op: str
    nbytes: int
    seconds: float
    runs: int
    descriptors: int  # what kvruntime asked for: runs x regions (x split pieces)
    nixl_descriptors: int | None  # what NIXL posted after merging, when telemetry exists
    peer_seconds: float | None = None  # push: the prefill's own WRITE time (no side channel)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def free_notification(request_id: str) -> bytes:
    return NOTIF_PREFIX + request_id.encode()


def parse_notification(message: bytes) -> str | None:
    if isinstance(message, str):
        message = message.encode()
    if message.startswith(NOTIF_PREFIX):
        return message[len(NOTIF_PREFIX):].decode(errors="replace")
    return None


def run_transfer(
    agent: Agent,
    op: str,
    plan: TransferPlan,
    local_dlist,
    remote_dlist,
    remote_is_src: bool,
    notif: bytes,
    timeout: float,
    split: int = 1,
) -> TransferResult:
    """READ (remote is the source) or WRITE (remote is the destination) ``plan``."""
    src_idx, dst_idx = plan.nixl_indices(split)
    local_idx, remote_idx = (dst_idx, src_idx) if remote_is_src else (src_idx, dst_idx)
    deadline = time.monotonic() + timeout
    nixl = agent.nixl
    start = time.perf_counter()
    try:
        handle = agent.call("make_prepped_xfer", nixl.make_prepped_xfer, op, local_dlist,
                            local_idx, remote_dlist, remote_idx, notif)
    except NixlError as exc:
        raise TransferError(f"{op} could not be prepared: {exc}") from exc
    state = "ERR"
    try:
        state = agent.call("transfer", nixl.transfer, handle)
        polls = 0
        while state == "PROC":
            if time.monotonic() > deadline:
                raise TransferTimeout(
                    f"{op} of {plan.nbytes} bytes missed its {timeout:.1f}s deadline "
                    f"(peer dead or stalled); the transfer was aborted"
                )
            polls += 1
            if polls > 64:
                time.sleep(0.0002)  # keep a core for UCX's progress on small hosts
            state = agent.call("check_xfer_state", nixl.check_xfer_state, handle)
        if state != "DONE":
            raise TransferError(f"{op} of {plan.nbytes} bytes failed in NIXL (state {state}): "
                                f"the peer is gone or refused the memory access")
        seconds = time.perf_counter() - start
        return TransferResult(op, plan.nbytes, seconds, len(plan.runs), plan.piece_count(split),
                              agent.descriptor_count(handle))
    except NixlError as exc:
        raise TransferError(f"{op} failed: {exc}") from exc
    finally:
        try:
            with agent.lock:
                handle.release()
        except Exception as exc:  # an un-abortable transfer: NIXL keeps it in its leak list
            log.warning("releasing the %s handle (state %s) failed: %s", op, state, exc)
