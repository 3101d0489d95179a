"""Which engine moves a decode peer's requests, chosen and opened once, at its connect.

``choose`` runs after the handshake: with ``engine="auto"`` a prefill proved to run on this host
as a user allowed to read its memory is served by the same-node engine (samenode.py; for a
host-staged peer, what it opens is the prefill's staging pool); any other, or ``engine="nixl"``,
goes through NIXL, and ``engine="samenode"`` fails the connect with the reason when it cannot be
used. Mixed TP keeps the same-node engine only where it copies head slices. Device memory over
NIXL is probed once (``LaneProbe``), so that a lane on TCP is refused before any KV moves.
``peer.engine_reason`` keeps why.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from ..errors import KVRuntimeError, PeerError, TransferError
from ..nixl.registration import Scratch
from ..nixl.transfer import PostedTransfer, Rows
from ..plan import make_plan
from ..tp import HeadSlice, direct_slice, slice_from
from ..wire import messages
from ..wire.handshake import PeerInfo
from ..wire.mailbox import MailboxReader
from .samenode import SameNodeUnavailable, open_engine

log = logging.getLogger(__name__)


def head_slice(theirs: PeerInfo, ours: PeerInfo, our_layout, staged: bool) -> HeadSlice | None:
    """Which of the peer's heads land in which of ours (tp.py): None when whole blocks move
    (same TP and ranks, direct)."""
    args = (theirs.cache_layout, theirs.tp_rank, our_layout, ours.tp_rank)
    if staged:
        return slice_from(*args)
    return direct_slice(*args)  # a row range of each block: the handshake checked the kinds


def choose(peer, mode: str, probe: "LaneProbe") -> None:
    """Choose and open ``peer``'s engine by the client's ``mode`` ("auto", "nixl",
    "samenode"); raises when ``mode`` cannot be had or the device lanes are refused (the
    caller closes the peer)."""
    staged = peer.client.staging is not None
    if mode == "nixl":
        peer.engine_reason = f"{'host-staged: ' if staged else ''}NIXL: forced (engine='nixl')"
    else:
        open_samenode(peer, required=mode == "samenode")
        if peer.head_slice is not None and not staged:
            check_engine_heads(peer, required=mode == "samenode")
        if peer.closed or peer.broken:  # the side channel broke on the way
            raise PeerError(f"{peer.name}: the connection failed during the connect: "
                            f"{peer.broken or 'closed'}; connect again")
    if peer.engine == "nixl" and "VRAM" in (peer.client.cache.mem_type, peer.info.mem_type):
        probe.check(peer)


def open_samenode(peer, required: bool) -> None:
    """Ask the prefill for its same-node offer and open its memory — for a host-staged peer,
    its staging pool; NIXL stays the path (and the reason is kept) when that cannot be proved
    or opened."""
    client = peer.client
    staged = client.staging is not None
    try:
        offer = peer.channel.call(messages.SAMENODE, client.timeout)
        engine = open_engine(offer, peer.channel.sock, client.staging.cache if staged else
                             client.cache, peer.info.layout, peer.info.regions,
                             client.host_streams)
        proved = f"proved: {engine.proved}"
        if staged:
            peer.pool_engine = engine
            n = engine.streams
            peer.engine_reason = (f"host-staged: pool to pool by process_vm_readv over {n} "
                                  f"thread{'s' if n > 1 else ''} ({proved})")
        else:
            peer.samenode = engine
            peer.engine_reason = proved
            peer.channel.ring = MailboxReader.from_offer(offer.get("pid"), offer)
    except KVRuntimeError as exc:
        if required:
            raise SameNodeUnavailable(f"{peer.name}: same-node engine unavailable: {exc}"
                                      ) from exc
        peer.engine_reason = (f"{'host-staged: ' if staged else ''}NIXL: same-node engine "
                              f"unavailable: {exc}")
        log.info("%s: %s", peer.name, peer.engine_reason)


def check_engine_heads(peer, required: bool) -> None:
    """Mixed TP: keep the same-node engine only if it copies head slices (CUDA IPC on one
    GPU); otherwise NIXL, one descriptor per token row of each block's head slice."""
    engine = peer.samenode
    if engine is not None and engine.moves_head_slices:
        peer.engine_reason += "; mixed TP: one strided copy per region of the head slice"
        engine.warm_heads(peer.head_slice)  # its kernel made now, not in the first request
        return
    why = (f"prefill TP {peer.info.cache_layout.tp_size} / decode TP "
           f"{peer.client.cache.layout.tp_size} moves head slices, which the same-node "
           f"engine here does not copy" + (f" ({engine.name})" if engine else ""))
    if engine is not None:
        engine.close()
        peer.samenode = None
    if required:
        raise SameNodeUnavailable(f"{peer.name}: same-node engine unavailable: {why} (use "
                                  f"engine='nixl' or kv_buffer='host_staged')")
    peer.engine_reason = f"NIXL: {why}; one descriptor per token row of each head slice"


class LaneProbe:
    """Device memory over NIXL: READ a few bytes of a peer's cache into our scratch, so that
    UCX selects (and logs, ucxlog.py) the protocol this pair's memory takes, then refuse a
    device-memory lane on TCP — before any KV moves, never silently. One per client."""

    def __init__(self, agent, cache, *, draining, timeout: float):
        self.agent = agent
        self.cache = cache
        self.draining = draining  # the client's: a probe still in flight is released there
        self.timeout = timeout
        self._scratch: Scratch | None = None  # the probe's destination (registration.py)

    def check(self, peer) -> None:
        if self._scratch is None:
            self._scratch = Scratch(self.agent, self.cache)
        address, _length, device = peer.info.regions[0]
        n = Scratch.NBYTES
        rows = Rows(self._scratch.descriptor(n),
                    np.array([[address, n, device]], dtype=np.uint64), peer.agent,
                    self._scratch.mem_type, peer.info.mem_type)
        plan = make_plan(peer.info.layout, [0])
        probe = PostedTransfer(self.agent, "READ", plan=plan, rows=rows)
        until = time.monotonic() + self.timeout
        try:
            while probe.poll() == "PROC":
                if time.monotonic() > until:
                    raise TransferError(f"{peer.name}: the connect-time probe READ did not "
                                        f"finish in {self.timeout:.1f}s")
                time.sleep(0.0002)
            if probe.state != "DONE":
                raise TransferError(f"{peer.name}: the connect-time probe READ failed")
        finally:
            if not probe.abort():  # still in flight: released once UCX ends it
                self.draining.add(probe, lambda: None, peer.agent)
        peer.lanes = self.agent.lanes()
        self.agent.check_device_lanes(peer.name, self._scratch.mem_type == "VRAM",
                                      peer.info.mem_type == "VRAM")

    def close(self) -> None:
        if self._scratch is not None:
            self._scratch.close()
