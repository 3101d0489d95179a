"""Which engine moves a decode peer's requests, chosen and opened once, at its connect.

``choose`` runs after the handshake: with ``engine="auto"`` a prefill proved to run on this host
as a user allowed to read its memory is served by the same-node engine (samenode.py; for a
host-staged peer, what it opens is the prefill's staging pool); any other, or ``engine="nixl"``,
goes through NIXL, and ``engine="samenode"`` fails the connect with the reason when it cannot be
used. Mixed TP keeps the same-node engine only where it copies head slices. Device memory over
NIXL is probed once (``LaneProbe``), so that a lane on TCP is refused before any KV moves.
``choose`` returns the peer's ``Engine`` (engine.py), which keeps why (``reason``); this is the
one place that asks which engine a peer gets.
"""

from __future__ import annotations

import logging

import numpy as np

from ..errors import KVRuntimeError, PeerError
from ..nixl.registration import Scratch
from ..nixl.transfer import Rows, read_now
from ..plan import make_plan
from ..tp import HeadSlice, direct_slice, slice_from
from ..wire import messages
from ..wire.handshake import PeerInfo
from ..wire.mailbox import MailboxReader
from . import coalesce as coalescing
from .engine import Engine, HostStagedEngine, NixlEngine, SameNodeEngine
from .samenode import SameNodeUnavailable, open_engine
from .staged import PoolRoute

log = logging.getLogger(__name__)


def head_slice(theirs: PeerInfo, ours: PeerInfo, our_layout, staged: bool) -> HeadSlice | None:
    """Which of the peer's heads land in which of ours (tp.py): None when whole blocks move
    (same TP and ranks, direct)."""
    args = (theirs.cache_layout, theirs.tp_rank, our_layout, ours.tp_rank)
    if staged:
        return slice_from(*args)
    return direct_slice(*args)  # a row range of each block: the handshake checked the kinds


def choose(peer, mode: str, probe: "LaneProbe") -> Engine:
    """Choose and open ``peer``'s engine by the client's ``mode`` ("auto", "nixl",
    "samenode"), once, at its connect; raises when ``mode`` cannot be had or the device lanes
    are refused (the caller closes the peer; what was opened here is closed here)."""
    client = peer.client
    staged = client.staging is not None
    opened = None
    if mode == "nixl":
        reason = f"{'host-staged: ' if staged else ''}NIXL: forced (engine='nixl')"
    else:
        opened, reason, ring = open_samenode(peer, required=mode == "samenode")
        if ring is not None:  # the prefill's readies, read from its memory as we poll
            peer.channel.read_ring(ring)
        if peer.head_slice is not None and not staged:
            opened, reason = check_engine_heads(peer, opened, reason,
                                                required=mode == "samenode")
        if peer.closed or peer.broken:  # the side channel broke on the way
            if opened is not None:
                opened.close()
            raise PeerError(f"{peer.name}: the connection failed during the connect: "
                            f"{peer.broken or 'closed'}; connect again")
    if staged:  # the prefill's pool is what it registered
        info = peer.info
        return HostStagedEngine(PoolRoute(client.staging, tuple(info.regions[0]), info.mem_type,
                                          info.layout.num_blocks, "host_staged", opened,
                                          "host_staged"), reason)
    if opened is not None:
        return SameNodeEngine(opened, reason)
    lanes = None
    if "VRAM" in (client.cache.mem_type, peer.info.mem_type):
        lanes = probe.check(peer)
    route, model, why = coalescing.open_route(peer)
    return NixlEngine(reason, lanes, mode=client.coalesce, route=route, model=model,
                      coalesce_reason=why)


def prewarm(mode: str, kv_buffer: str, cache) -> str | None:
    """What the same-node engine's first connect would pay (its gather kernel), paid at the
    client's start: None where no same-node CUDA engine can serve (``mode`` "nixl", a
    host-staged client, host memory), else what was done."""
    if mode == "nixl" or kv_buffer == "host_staged" or cache.mem_type != "VRAM":
        return None
    from .gather import prewarm as prewarm_gather

    return prewarm_gather(cache)


def open_samenode(peer, required: bool):
    """Ask the prefill for its same-node offer and open its memory — for a host-staged peer,
    its staging pool. Returns (the opened engine or None, why, the prefill's ring of readies
    or None); NIXL stays the path (and the reason is kept) when that cannot be proved or
    opened."""
    client = peer.client
    staged = client.staging is not None
    try:
        offer = peer.channel.call(messages.SAMENODE, client.timeout)
        engine = open_engine(offer, peer.channel.sock, client.staging.cache if staged else
                             client.cache, peer.info.layout, peer.info.regions,
                             client.host_streams)
        proved = f"proved: {engine.proved}"
        if staged:
            n = engine.streams
            return engine, (f"host-staged: pool to pool by process_vm_readv over {n} "
                            f"thread{'s' if n > 1 else ''} ({proved})"), None
        try:
            ring = MailboxReader.from_offer(offer.get("pid"), offer)
        except BaseException:
            engine.close()
            raise
        return engine, proved, ring
    except KVRuntimeError as exc:
        if required:
            raise SameNodeUnavailable(f"{peer.name}: same-node engine unavailable: {exc}"
                                      ) from exc
        reason = (f"{'host-staged: ' if staged else ''}NIXL: same-node engine "
                  f"unavailable: {exc}")
        log.info("%s: %s", peer.name, reason)
        return None, reason, None


def check_engine_heads(peer, engine, reason: str, required: bool):
    """Mixed TP: keep the same-node ``engine`` only if it copies head slices (CUDA IPC on
    one GPU); otherwise NIXL, one descriptor per token row of each block's head slice.
    Returns (the engine kept or None, why)."""
    if engine is not None and engine.moves_head_slices:
        engine.warm_heads(peer.head_slice)  # its kernel made now, not in the first request
        return engine, reason + "; mixed TP: one strided copy per region of the head slice"
    why = (f"prefill TP {peer.info.cache_layout.tp_size} / decode TP "
           f"{peer.client.cache.layout.tp_size} moves head slices, which the same-node "
           f"engine here does not copy" + (f" ({engine.name})" if engine else ""))
    if engine is not None:
        engine.close()
    if required:
        raise SameNodeUnavailable(f"{peer.name}: same-node engine unavailable: {why} (use "
                                  f"engine='nixl' or kv_buffer='host_staged')")
    return None, f"NIXL: {why}; one descriptor per token row of each head slice"


class LaneProbe:
    """Device memory over NIXL: READ a few bytes of a peer's cache into our scratch, so that
    UCX selects (and logs, ucxlog.py) the protocol this pair's memory takes, then refuse a
    device-memory lane on TCP — before any KV moves, never silently. One per client.

    Its scratch is registered at once, before the client's NIXL metadata is taken: a prefill
    WRITEs into it at our connect (``triple``, in our handshake's info; prefill/warm.py)."""

    def __init__(self, agent, cache, *, draining, timeout: float):
        self.agent = agent
        self.cache = cache
        self.draining = draining  # the client's: a probe still in flight is released there
        self.timeout = timeout
        self._scratch = Scratch(agent, cache)  # the probe's destination (registration.py)

    @property
    def triple(self) -> tuple[int, int, int]:
        """Our scratch as (address, length, device id), for the handshake's info."""
        s = self._scratch
        return (s.address, Scratch.NBYTES, s.device_id)

    def check(self, peer) -> list:
        """Probe ``peer``'s lanes; returns them (UCX's protocols of our agent, ucxlog.py)."""
        address, _length, device = peer.info.regions[0]
        n = Scratch.NBYTES
        rows = Rows(self._scratch.descriptor(n),
                    np.array([[address, n, device]], dtype=np.uint64), peer.agent,
                    self._scratch.mem_type, peer.info.mem_type)
        read_now(self.agent, rows, what=f"{peer.name}: the connect-time probe READ",
                 timeout=self.timeout, draining=self.draining,
                 plan=make_plan(peer.info.layout, [0]), nap=0.0002)
        self.agent.check_device_lanes(peer.name, self._scratch.mem_type == "VRAM",
                                      peer.info.mem_type == "VRAM")
        return self.agent.lanes()

    def close(self) -> None:
        self._scratch.close()
