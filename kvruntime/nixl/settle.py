"""What UCX still holds of an agent's failed transfers, progressed out before the agent goes.

NIXL's UCX backend reports a transfer failed as soon as UCX fails its requests (the peer
died), but UCX may still hold copies it had queued on the endpoint to that peer: they leave
its queue at a later progress of the worker they were posted on. With UCX threads (NIXL's
thread-pool engine, ``num_threads``) a thread progresses its worker only while it has a piece
of a transfer of its own; once its piece has failed it never does again. Destroying the agent
then destroys that worker with the copy queued, and UCX aborts the process::

    arbiter.c:36 Assertion `ucs_arbiter_group_is_empty(group)' failed
    ucs_arbiter_group_cleanup <- uct_cma_ep_t_delete <- ucp_ep_cleanup_lanes
    <- ucp_worker_destroy <- ~nixlUcxEngine <- ~nixlUcxThreadPoolEngine

(a core dump of kvruntime's killed-prefill test, with UCX's "get(multi) ... 128 MiB zero-copy
cma ... was not returned to mpool ucp_requests" before it; CI saw the abort in 1 of 3 runs).

``settle`` gives every worker progress before the agent is destroyed: NIXL's notification poll
progresses the shared workers (no NIXL progress thread: agent.py), and loopback READs of
``threads`` pieces each, repeated, hand each UCX thread a piece whose wait progresses its worker
until UCX has nothing left to do there. A copy queued to a dead peer fails at once (its pages
are gone), so a worker's first progress ends it. NIXL gives no way to see a worker's queue:
that each thread got a piece is likely, not proved, and the rounds are what makes it likely
(``ROUNDS``). It runs only for an agent that saw a transfer fail: a transfer that ended well
left nothing queued.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from ..errors import KVRuntimeError, NixlError

log = logging.getLogger(__name__)

ROUNDS = 8  # loopback READs, each cut into one piece a UCX thread
PIECE = 64 << 10  # bytes a piece: large enough that a thread's post takes a moment
WAIT = 2.0  # seconds one loopback READ may take before settling gives up


def settle(agent) -> bool:
    """Progress every UCX worker of ``agent`` (agent.Agent, still open) so that what its failed
    transfers left queued ends before its workers are destroyed. Returns True when every
    loopback READ ended; logs and returns False otherwise (the agent is closed all the same)."""
    try:
        for _ in range(3):  # the shared workers: NIXL's poll runs them until they are idle
            agent.call("get_new_notifs", agent.nixl.get_new_notifs)
        if agent.ucx_threads > 0:
            return _threads(agent, agent.ucx_threads)
        return True
    except KVRuntimeError as exc:  # NIXL's refusal, or no memory for the loopback's buffer
        log.warning("settling UCX's workers before the agent goes: %s", exc)
        return False


def _threads(agent, threads: int) -> bool:
    from ..memory import HostBuffer

    buffer = HostBuffer(2 * threads * PIECE, huge_pages=False)
    reg = None
    try:
        nixl = agent.nixl
        reg = agent.call("register_memory (settle)", nixl.register_memory,
                         [(buffer.address, buffer.nbytes, 0, "")], "DRAM")
        rows = [[buffer.address + i * PIECE, PIECE, 0] for i in range(2 * threads)]
        source = np.array(rows[:threads], dtype=np.uint64)
        target = np.array(rows[threads:], dtype=np.uint64)
        return all(_loopback(agent, target, source) for _ in range(ROUNDS))
    finally:
        if reg is not None:
            try:
                agent.call("deregister_memory (settle)", agent.nixl.deregister_memory, reg)
            except NixlError as exc:
                log.warning("%s", exc)
        buffer.close()


def _loopback(agent, target, source) -> bool:
    """One READ of ``source`` into ``target``, both ours: NIXL's thread-pool engine cuts it
    into one piece a thread."""
    nixl = agent.nixl
    handle = agent.call("initialize_xfer (settle)", nixl.initialize_xfer, "READ",
                        nixl.get_xfer_descs(target, "DRAM"), nixl.get_xfer_descs(source, "DRAM"),
                        agent.name, b"")
    state = agent.call("transfer (settle)", nixl.transfer, handle)
    until = time.monotonic() + WAIT
    while state not in ("DONE", "ERR", b"DONE", b"ERR") and time.monotonic() < until:
        state = agent.call("check_xfer_state (settle)", nixl.check_xfer_state, handle)
    if state not in ("DONE", b"DONE"):
        log.warning("settling UCX's workers before the agent goes: a loopback READ ended %s",
                    state)
        return False  # its handle is left to the agent's end: releasing it may not stop it
    agent.call("release_xfer_handle (settle)", nixl.release_xfer_handle, handle)
    return True
