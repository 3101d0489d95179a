"""What moves a decode peer's requests: one ``Engine``, chosen once at the connect (choice.py)
and held by the peer (``PrefillPeer.mover``) until it closes.

Three engines, one protocol: ``pull``, ``push``, the pushes it takes (``pushes_refused``,
``expect``, ``ready``), a batch of pulls (``pulls``) and ``close``. The peer asks its engine and
never which engine it has; ``name`` is what results and reports say ("nixl", "host_staged", or
the same-node engine's name, e.g. "samenode:process_vm_readv").

- ``NixlEngine``: a direct NIXL peer. A request is one READ with the caches' descriptor lists
  (the peer's ``post_read``), or a push the prefill WRITEs (``ask_push``); one of many runs may
  go coalesced, through the staging pools (coalesce.py decides, ``route`` is the way).
- ``SameNodeEngine``: the prefill proved to be on this host (samenode.py): every request, a
  push too, is our copy out of its memory (the peer's ``start_local``); a batch is one gather.
- ``HostStagedEngine``: a host-staged client (staging.py): every request goes through the pools,
  their runs moved by NIXL or, on this host, by the same-node engine's readers (``reader``).

The engines start requests through the peer's road methods (``post_read``, ``start_staged``,
``start_local``, ``ask_push``); they write no field of the peer's or of a handle's.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod

from ..errors import KVRuntimeError
from . import coalesce as coalescing
from .samenode import REHEARSALS, Batch, SharedJob
from .staged import PoolRoute

log = logging.getLogger(__name__)


class Engine(ABC):
    """What moves one peer's requests (see module doc). ``peer`` in each call is the
    ``decode.PrefillPeer`` that holds the engine (not imported: decode imports engines)."""

    name: str  # what TransferResult, reports and logs say moved the bytes
    reason: str  # why it was chosen (peer.engine_reason)
    route: PoolRoute | None = None  # the way through the staging pools, if any
    # the same-node engine that copies (samenode.py); None where NIXL moves the bytes
    samenode = None
    # UCX carries its bytes: the agent's lanes and transports are this engine's
    over_nixl = True
    # a pull is one NIXL READ of the caches' own descriptor lists (unless coalesced)
    reads_direct = False
    coalesce_model: coalescing.Model | None = None
    coalesce_reason = "not a NIXL peer"  # why requests may (not) go coalesced

    def __init__(self, reason: str, lanes=None):
        self.reason = reason
        self.lanes = lanes  # UCX's protocols of our agent after the connect-time probe

    @property
    def staged_copy(self) -> str | None:
        """Host-staged: what moves a staged run from the prefill's pool into ours; None for
        a direct peer."""
        return None

    @property
    def coalesces(self) -> bool:
        """A direct NIXL peer whose requests may go through the pools."""
        return False

    @abstractmethod
    def pull(self, peer, handle, split: int | None):
        """Start moving pull ``handle`` (``split``: NIXL descriptors per run, None: the
        peer's choice); returns the handle."""

    @abstractmethod
    def push(self, peer, handle, split: int):
        """Start push ``handle`` (its request id already checked new); returns the handle."""

    def pulls(self, peer, admitted, merged, timeout: float, t0: float) -> list:
        """A batch of planned pulls (``(plan, request id)`` pairs; ``merged``: their plan as
        one): each its own pull, split 1 (as the batch has always posted its READs)."""
        return [self.pull(peer, peer.make_handle("pull", rid, plan, timeout, t0), 1)
                for plan, rid in admitted]

    def pushes_refused(self, peer) -> str | None:
        """Why the prefill may not push into this peer's client (None: it may)."""
        return None

    @abstractmethod
    def expect(self, peer, handle) -> dict:
        """The fields of the "expect" frame for a push the prefill starts: how it delivers
        (a WRITE: none; "copy": its ids, we copy; "stage": its ids once staged)."""

    def copies_ready(self, handle) -> bool:
        """Whether a "ready" for push ``handle`` (decode/pushes.py) is ours to copy."""
        return False

    def ready(self, peer, handle) -> None:
        """The prefill's "ready" for push ``handle`` (``copies_ready``): start our copy."""
        raise KVRuntimeError("no same-node engine serves this peer here, and it was not "
                             "asked for through the pools")

    def rehearse(self, peer) -> None:
        """At connect: run a request's path once or more where a first request pays more."""

    def close(self) -> None:
        """Let go of what the engine opened (memory of the prefill's lives as long as it)."""


class NixlEngine(Engine):
    """A direct NIXL peer: one READ of the caches' lists, a push the prefill WRITEs, or a
    request coalesced through the pools (coalesce.py)."""

    name = "nixl"
    reads_direct = True

    def __init__(self, reason: str, lanes=None, *, mode: str = "never",
                 route: PoolRoute | None = None, model: coalescing.Model | None = None,
                 coalesce_reason: str = "not a NIXL peer"):
        super().__init__(reason, lanes)
        self.mode = mode  # the client's coalesce mode (coalesce.MODES)
        self.route = route
        self.coalesce_model = model
        self.coalesce_reason = coalesce_reason

    @property
    def coalesces(self) -> bool:
        return self.route is not None

    def coalesced(self, peer, handle) -> bool:
        """Whether ``handle`` goes through the pools; the choice and why go into its result."""
        chosen, why = coalescing.choose(peer, handle, mode=self.mode, route=self.route,
                                        model=self.coalesce_model, reason=self.coalesce_reason)
        handle.chose_coalesce(chosen, why)
        return chosen

    def pull(self, peer, handle, split):
        if self.coalesced(peer, handle):
            return peer.start_staged(handle, self.route)
        return peer.post_read(handle, split)

    def push(self, peer, handle, split):
        if self.coalesced(peer, handle):  # the pull's road; the outcome is the push's
            return peer.start_staged(handle, self.route)
        return peer.ask_push(handle, split)

    def expect(self, peer, handle) -> dict:
        # through the pools: "send the ids when ready, we have them staged and READ them as
        # a pull" (our pool taken then, not while the prefill computes)
        return {"stage": True} if self.coalesced(peer, handle) else {}

    def copies_ready(self, handle) -> bool:
        return handle.coalesced  # asked for through the pools ("stage")

    def ready(self, peer, handle) -> None:
        peer.start_staged(handle, self.route, new=False)


class SameNodeEngine(Engine):
    """The prefill's memory opened on this host (samenode.py): every request is our copy."""

    over_nixl = False

    def __init__(self, samenode, reason: str):
        super().__init__(reason)
        self.samenode = samenode
        self.name = samenode.name
        self.rehearsal = None  # a failed rehearsal's scratch (rehearse)

    def pull(self, peer, handle, split):
        return peer.start_local(handle, self.samenode.start("READ", handle.plan,
                                                            peer.head_slice))

    # Same node: we copy out of the prefill's memory ourselves; the outcome (blocks here, the
    # prefill told it may free them) is the push's, at the pull's speed.
    push = pull

    def pulls(self, peer, admitted, merged, timeout, t0) -> list:
        """The whole batch is one gather (one id upload, one launch per region): a
        request's host cost is then its planning alone."""
        batch = Batch(self.samenode.start("READ", merged, peer.head_slice))
        handles = batch.handles
        for plan, rid in admitted:
            handle = peer.make_handle("pull", rid, plan, timeout, t0)
            handle.attach(SharedJob(batch, plan))
            handles.append(handle)
        peer.port.track_all(handles)
        return list(handles)

    def expect(self, peer, handle) -> dict:
        return {"copy": True}  # "send the ids when ready, we copy"

    def copies_ready(self, handle) -> bool:
        return True

    def ready(self, peer, handle) -> None:
        self.pull(peer, handle, None)

    def rehearse(self, peer) -> None:
        """A pull's whole path on this host (the plan, the handle, the engine's start, the
        polls and the wait) run REHEARSALS times, each moving a scratch request (the engine's
        ``scratch_request``: its copies land in scratch, never the cache; the prefill is told
        nothing). What a first request paid after the kernels' warm-up was host time (one
        H100, 16 MiB: the engine's start took 178-315 µs the first time, 122-175 the second,
        ~50 later; the request 3.4x the median): CPython specializes a function's code only
        after its first runs, and numpy, ctypes and torch build their call paths at their
        first calls. A rehearsal that fails is logged, never fatal: the first requests pay it
        then."""
        scratch = self.samenode.scratch_request()
        if scratch is None:
            return
        plan, start = scratch
        try:
            for _ in range(REHEARSALS):
                handle = peer.make_handle("pull", "rehearsal", plan, peer.port.timeout,
                                          time.perf_counter())
                job = start()
                job.tells_prefill = False  # no request of the prefill's
                handle.attach(job, uses_peer=False)
                handle.wait()
        except Exception as exc:
            # a copy that missed its deadline may still write into the scratch: kept as long
            # as the engine, whose close waits for the devices before anything is let go
            self.rehearsal = scratch
            log.info("%s: rehearsing the request path failed: %s", peer.name, exc)

    def close(self) -> None:
        if self.samenode is not None:  # opened memory lives exactly as long as the peer
            self.samenode.close()
        self.samenode = self.rehearsal = None


class HostStagedEngine(Engine):
    """A host-staged client: every request through the pools (staging.py), each staged run
    READ by NIXL or, on this host, by the same-node engine's readers (``reader``)."""

    name = "host_staged"

    def __init__(self, route: PoolRoute, reason: str, lanes=None):
        super().__init__(reason, lanes)
        self.route = route

    @property
    def reader(self):
        return self.route.reader

    @property
    def staged_copy(self) -> str:
        return self.reader.name if self.reader is not None else "nixl"

    def pull(self, peer, handle, split):
        # NIXL holds the pools here, never the caches: a READ with the registration's lists
        # would read pool into pool
        return peer.start_staged(handle, self.route)

    def push(self, peer, handle, split):
        return peer.start_staged(handle, self.route)

    def pushes_refused(self, peer) -> str:
        return (f"{peer.name}: a host-staged decode cannot be pushed into (NIXL holds its "
                f"staging pool, not its cache); pull instead")

    def expect(self, peer, handle) -> dict:
        raise KVRuntimeError(self.pushes_refused(peer))

    def close(self) -> None:
        if self.route.reader is not None:  # opened memory lives exactly as long as the peer
            self.route.reader.close()


class NotChosen(Engine):
    """A peer's engine between its handshake and the choice (choice.py): moves nothing."""

    name = "not chosen"
    over_nixl = False

    def __init__(self):
        super().__init__("not asked")

    def pull(self, peer, handle, split):
        raise KVRuntimeError(f"{peer.name}: no engine chosen yet (the connect has not ended)")

    push = pull

    def expect(self, peer, handle) -> dict:
        return self.pull(peer, handle, None)
