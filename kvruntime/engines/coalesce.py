"""Coalesced NIXL transfers: a request of many runs moved through the staging pools.

A direct NIXL transfer costs one descriptor a run (a block, or a token row of a head slice in
mixed TP): ~5 µs each over CUDA IPC on an H100, ~4 over cma on the CPU host, so 4096 random
blocks move at a fraction of one contiguous range. Coalesced, the prefill gathers the request
into a run of its staging pool, the decode READs the run (one descriptor a chunk) into a run of
its own pool and scatters it into the cache as each chunk lands: the pipelined staged path
(staging.py) with pools of the caches' own memory kind, host DRAM for host caches and VRAM
registered with NIXL for device caches. One staging design for both pools and for host-staged
peers; here only what a direct peer adds: the pool of a ``kv_buffer="device"`` side and its
registration, the "pool" offer that tells the decode where the prefill's pool is, and the
choice per request.

``coalesce="auto"`` chooses by a model (``Model``) of what one more descriptor costs on this
pair (a READ of k scattered descriptors against one of the same bytes, probed at connect),
what a gathered byte costs here (our gather into our pool: the client's, measured once at its
start, ``measure_gather``) and one side-channel round trip (the least of the handshake's first
exchange and the "pool" one); a request goes coalesced when its descriptors would cost more
than its gathered bytes and the round trip. ``"always"`` and ``"never"`` force either; every
``TransferResult`` says which ran (``coalesced``) and why (``coalesce_reason``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ..errors import KVRuntimeError
from ..nixl.registration import Registration
from ..pools.staging import StagingExhausted, StagingPool
from ..tp import rows_per_chunk
from ..wire import messages
from .staged import PoolRoute

log = logging.getLogger(__name__)

MODES = ("auto", "always", "never")
# A direct side's pool when the caller sizes none: this many bytes of blocks (at most the
# cache). A request larger than either side's pool moves in pieces (staged.py).
DEFAULT_POOL_BYTES = 256 << 20
# Of a coalesced request's gather and scatter, how much the pipeline leaves exposed, by the
# pools' memory. Device pools: the copies run on the GPUs beside the wire, the first chunk's
# gather and the last one's scatter stay exposed: counted as one of the two whole. Host pools:
# the copies take the cores and the memory bandwidth the wire's own copies (cma) need, so
# nothing hides them, and they slow the wire's copies as much: three counted, at no more than
# the wire's rate (a cold copy: the probe's 4 MiB gather runs from the cache, 15-20 GB/s on
# cpu-2 against the wire's 7-12). cpu-2, 64 MiB of 4096 random 16 KiB blocks: coalesced 35-52
# ms against 8-12 contiguous, 27-40 ms of copies, 3-4 cold copies of the bytes; direct 14-17
# over 2 UCX threads. With two counted at the probe's rate auto took coalesced in two connects
# of three.
EXPOSED = {"device": 1.0, "host": 3.0}
# The probe's scattered READ, in pieces, by pool memory. Host memory: enough pieces that a
# UCX thread's wake-up (agent.ucx_threads: a decode's host memory) or a scheduler's hiccup on
# a host of few cores does not pass for their cost (cpu-2 with 32 and 2 UCX threads: 106 us a
# descriptor in one connect, 3.3 in the next)
PROBE_BLOCKS = {"device": 32, "host": 256}
# The most of each chunk the probe's descriptor READs take, by pool memory (None: the whole
# chunk). What they measure is a descriptor's own cost (cma's process_vm_readv call, its
# post), which its bytes do not change; on host memory 256 cross-layer chunks of 256 KiB were
# 64 MiB a READ and the bytes' noise passed for 0.0-11.1 us a descriptor from one connect to
# the next on the 2-core host (4.1-5.3 in four connects with 32 KiB of each; with 16 KiB a
# per-layer connect once read 0.0). The wire's rate (the cap on a host gather's: a request's
# bytes are cold) is still read from the whole chunks in one range.
PROBE_PIECE_BYTES = {"device": None, "host": 32 << 10}
# The probe's largest gather, by pool memory: large enough that a device gather's fixed cost
# (launches, the wait) does not pass for its rate (2 x H100: 32 blocks of 256 KiB measured
# 50 GB/s, and auto kept 1 GiB of random blocks direct, 4.5 x slower than coalesced), small
# enough to keep a host connect short
PROBE_GATHER_BYTES = {"device": 64 << 20, "host": 4 << 20}


def check_mode(coalesce) -> str:
    if coalesce not in MODES:
        raise KVRuntimeError(f"coalesce must be one of {', '.join(MODES)}, got {coalesce!r}")
    return coalesce


def pool_blocks(layout, staging_blocks: int) -> int:
    """The pool's size in blocks: the caller's, else DEFAULT_POOL_BYTES of them (at most the
    cache's blocks)."""
    if staging_blocks:
        return staging_blocks
    return max(1, min(layout.num_blocks, DEFAULT_POOL_BYTES // layout.block_bytes))


def make_pool(cache, staging_blocks: int) -> StagingPool:
    """A direct side's pool, in the cache's own memory (VRAM for a device cache)."""
    tensors = cache.tensors
    memory = "device" if tensors and tensors[0].device.type != "cpu" else "host"
    pool = StagingPool(cache.layout, pool_blocks(cache.layout, staging_blocks), cache,
                       memory=memory)
    try:
        pool.warm()  # a device pool's copy kernels loaded now, not by a first request
    except Exception as exc:  # the first request loads them then
        log.info("warming the staging pool's copies failed: %s", exc)
    return pool


class PoolRegistration:
    """A direct side's pool registered with its NIXL agent (before the agent's metadata goes
    out, so that peers' READs and WRITEs of it are allowed), deregistered once."""

    def __init__(self, agent, pool: StagingPool):
        self.agent = agent
        r = pool.cache.regions[0]
        self._reg = agent.call("register_memory (staging pool)", agent.nixl.register_memory,
                               [(r.address, r.nbytes, r.device_id, "")], r.mem_type)

    def close(self) -> None:
        if self._reg is not None:
            try:
                self.agent.call("deregister_memory (staging pool)",
                                self.agent.nixl.deregister_memory, self._reg)
            except KVRuntimeError as exc:
                log.warning("%s", exc)
            self._reg = None


def open_pools(stack, agent, cache, kv_buffer: str, coalesce: str, staging_blocks):
    """The memory a side's NIXL ``agent`` sees, registered, each end pushed onto ``stack``
    (an ExitStack: decode/client.py, prefill/server.py): host-staged, a staging pool, never
    the cache; else the cache, and unless ``coalesce`` is "never" a pool beside it for
    coalesced requests (registered before the agent's metadata goes out). Returns (the
    host-staging pool or None, the pool requests go through or None, the Registration)."""
    staging = pool = None
    if kv_buffer == "host_staged":
        staging = pool = StagingPool(cache.layout, staging_blocks or cache.layout.num_blocks,
                                     cache)
        stack.callback(pool.close)
    elif coalesce != "never":
        pool = make_pool(cache, staging_blocks)
        stack.callback(pool.close)
        stack.callback(PoolRegistration(agent, pool).close)
    registration = Registration(agent, staging.cache if staging else cache)
    stack.callback(registration.close)
    return staging, pool, registration


def offer(pool: StagingPool | None, why_not: str = "") -> dict:
    """The prefill's answer to a decode's "pool" frame: where its pool is, or why none."""
    if pool is None:
        return {"unavailable": why_not or "this prefill has no staging pool"}
    r = pool.cache.regions[0]
    return {"region": [r.address, r.nbytes, r.device_id],
            "mem_type": r.mem_type, "units": pool.units,
            "unit_bytes": pool.layout.block_bytes}


def route_from(reply: dict, pool: StagingPool) -> PoolRoute:
    """Our route through the pools from the prefill's "pool" answer, checked: its region is a
    range it registered, its units are the size of ours (the same model)."""
    if "unavailable" in reply:
        why = str(reply["unavailable"])[:200]
        raise KVRuntimeError(f"the prefill offers no staging pool: {why}")
    region, units, unit = reply.get("region"), reply.get("units"), reply.get("unit_bytes")
    ints = isinstance(region, list) and len(region) == 3 and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in region)
    if not (ints and isinstance(units, int) and units > 0 and unit == pool.layout.block_bytes
            and units * unit <= region[1] and reply.get("mem_type") in ("DRAM", "VRAM")):
        raise KVRuntimeError(f"the prefill's pool offer is malformed (region {str(region)[:80]}, "
                             f"{units!r} units of {unit!r} bytes; ours are "
                             f"{pool.layout.block_bytes} bytes)")
    return PoolRoute(pool, tuple(region), reply["mem_type"], units, "nixl")


@dataclass(frozen=True)
class GatherCost:
    """What our gather into our pool costs (the scatter taken as the same): the client's pool,
    not a pair's, so measured once at the client's start (``measure_gather``)."""

    gbps: float
    fixed_us: float  # whatever its bytes (launches, its wait)


def measure_gather(pool: StagingPool | None, layout) -> GatherCost | None:
    """Our gather of every other block of the cache (``layout``: scattered, as requests are)
    into the pool, at two sizes, best of three each: the rate from their difference, the fixed
    cost from what is left of the small one. At the client's start, for ``coalesce="auto"``:
    every connect's probe reads it (it was six gathers of each connect: 2-4 ms of a 2-core
    host's 15-28 ms first handshake). None without a pool or when the cache or the pool is too
    small to gather two blocks."""
    if pool is None:
        return None
    blocks = min(max(2, PROBE_GATHER_BYTES[pool.memory] // layout.block_bytes),
                 layout.num_blocks // 2, pool.units // layout.num_kv_heads)
    if blocks < 2:
        return None
    units = blocks * layout.num_kv_heads
    start = pool.try_acquire(units)
    if start is None:
        return None
    try:
        def gather(n: int) -> float:
            ids = list(range(0, 2 * n, 2))
            times = []
            for _ in range(3):
                t = time.perf_counter()
                pool.gather(ids, start)
                times.append(time.perf_counter() - t)
            return min(times)

        small = max(1, blocks // 4)
        t_small, t_large = gather(small), gather(blocks)
    finally:
        pool.release(start, units)
    if t_large > t_small:
        rate = (blocks - small) * layout.block_bytes / (t_large - t_small)
        fixed = max(0.0, t_small - small * layout.block_bytes / rate)
    else:  # too small to tell them apart: all of it counted as rate
        rate, fixed = blocks * layout.block_bytes / t_large, 0.0
    return GatherCost(rate / 1e9, fixed * 1e6)


@dataclass
class Model:
    """What this pair's transfers cost, from the connect-time probe (``probe``)."""

    descriptor_us: float  # one more NIXL descriptor
    wire_gbps: float  # one descriptor's bytes
    gather_gbps: float  # our gather into the pool (the scatter taken as the same)
    round_trip_us: float  # one side-channel exchange
    gather_fixed_us: float = 0.0  # what a gather costs whatever its bytes (launches, its wait)
    exposed: float = EXPOSED["device"]  # of the gather and the scatter, how much counts

    def choose(self, descriptors: int, nbytes: int, pieces: int = 1) -> tuple[bool, str]:
        """Whether a request of ``descriptors`` descriptors and ``nbytes`` bytes goes
        coalesced (in ``pieces``, a round trip each), and why (the two estimates)."""
        direct = descriptors * self.descriptor_us
        gathered = (self.exposed * nbytes / (self.gather_gbps * 1e3)
                    + pieces * (self.round_trip_us + self.gather_fixed_us))
        if direct > gathered:
            return True, (f"auto: {descriptors} descriptors x {self.descriptor_us:.2f} us = "
                          f"{direct:.0f} us > {gathered:.0f} us of gathering "
                          f"{nbytes} bytes at {self.gather_gbps:.1f} GB/s and a round trip")
        return False, (f"auto: {descriptors} descriptors x {self.descriptor_us:.2f} us = "
                       f"{direct:.0f} us <= {gathered:.0f} us of gathering {nbytes} bytes at "
                       f"{self.gather_gbps:.1f} GB/s and a round trip")

    def to_dict(self) -> dict:
        return {k: round(v, 3) for k, v in vars(self).items()}


def _read(peer, local_rows, remote_rows, remote_mem: str) -> float:
    """Seconds of one READ of ``remote_rows`` of the peer into ``local_rows`` of our pool."""
    from ..nixl.transfer import Rows, read_now

    client = peer.client
    rows = Rows(local_rows, remote_rows, peer.agent, client.pool.cache.mem_type, remote_mem)
    return read_now(client.agent, rows, what="a connect-time READ of the peer",
                    timeout=client.timeout, draining=client.draining)


def warm(peer, route: PoolRoute) -> bool:
    """READ one unit of the peer's pool into ours at connect, so that what a first READ of it
    pays (UCX's rkey unpacked, CUDA IPC's handle opened) is paid now, not by the first
    request. False when our pool is busy (skipped: the first request pays it)."""
    import numpy as np

    pool = route.pool
    start = pool.try_acquire(1)
    if start is None:
        return False
    try:
        local = pool.cache.regions[0]
        n = pool.layout.block_bytes
        _read(peer, np.array([[local.address + start * n, n, local.device_id]], dtype=np.uint64),
              np.array([[route.remote[0], n, route.remote[2]]], dtype=np.uint64),
              route.remote_mem)
        return True
    finally:
        pool.release(start, 1)


def probe(peer, route: PoolRoute, round_trip: float) -> Model | None:
    """Measure this pair at connect: a READ of ``PROBE_BLOCKS`` scattered pieces of the peer's
    cache into our pool (every other chunk, at most ``PROBE_PIECE_BYTES`` of each) against a
    READ of the same bytes in one piece, and the wire's rate from the whole chunks in one piece
    (best of three each; that last is the one before where pieces are whole); with our gather
    (the client's ``gather_cost``) and ``round_trip``, the model. None when our pool is busy
    (another peer's requests hold it), the peer's cache is too small to scatter the pieces,
    or our gather was not measured."""
    import numpy as np

    from ..nixl.transfer import split_runs

    pool, client = route.pool, peer.client
    gathered = client.gather_cost
    theirs = peer.info.layout  # what NIXL sees of the peer: its cache's layout
    piece = theirs.chunk_bytes
    k = min(PROBE_BLOCKS[pool.memory], theirs.num_blocks // 2)
    units = -(-k * piece // pool.layout.block_bytes)
    if gathered is None or k < 2 or units > pool.units:
        return None
    start = pool.try_acquire(units)
    if start is None:
        return None
    try:
        local = pool.cache.regions[0]
        at = local.address + start * pool.layout.block_bytes
        address, _length, device = peer.info.regions[0]
        cap = PROBE_PIECE_BYTES[pool.memory]
        small = piece if cap is None else min(piece, cap)
        scattered = np.array([[address + 2 * i * piece, small, device] for i in range(k)],
                             dtype=np.uint64)
        mine = np.array([[at + i * small, small, local.device_id] for i in range(k)],
                        dtype=np.uint64)

        def read(local_rows, remote_rows) -> float:
            return _read(peer, local_rows, remote_rows, peer.info.mem_type)

        # the same bytes in one range, cut as a request's run is (transfer.split_runs: a
        # descriptor a UCX thread for host memory): with the scattered READ spread over the
        # threads and this one on a single thread, their difference took in the hand-offs
        # (cpu-2, 2 threads: 7.4-8.0 us a descriptor in two connects of three, against 1.8
        # for a request's 4096)
        n = max(1, min(k // 2, split_runs(1, peer.read_threads)))

        def in_one(nbytes: int) -> tuple:
            cut = np.linspace(0, nbytes, n + 1).astype(np.uint64)
            lengths = np.diff(cut)
            return (np.stack([at + cut[:-1], lengths,
                              np.full(n, local.device_id, dtype=np.uint64)], axis=1),
                    np.stack([address + cut[:-1], lengths,
                              np.full(n, device, dtype=np.uint64)], axis=1))

        t_many = min(read(mine, scattered) for _ in range(3))
        t_one = min(read(*in_one(k * small)) for _ in range(3))
        t_wire = t_one if small == piece else min(read(*in_one(k * piece)) for _ in range(3))
    finally:
        pool.release(start, units)
    wire_gbps = k * piece / t_wire / 1e9
    gbps = gathered.gbps
    if pool.memory == "host":  # a request's bytes are cold: no faster than the wire's copy
        gbps = min(gbps, wire_gbps)
    return Model(max(0.0, (t_many - t_one) / (k - n) * 1e6), wire_gbps, gbps,
                 round_trip * 1e6, gathered.fixed_us, EXPOSED[pool.memory])


def open_route(peer) -> tuple[PoolRoute | None, Model | None, str]:
    """At connect, for a direct NIXL peer: its route through the pools, asked of the prefill
    ("pool") and, for auto, measured (``probe``). A prefill without a pool, or a bad offer,
    leaves requests direct. Returns (the route or None, the model or None, why requests may
    or may not go coalesced: ``peer.coalesce_reason``)."""
    client = peer.client
    if client.pool is None:
        return None, None, "coalesce='never'"
    try:
        t = time.perf_counter()
        reply = peer.channel.call(messages.POOL, client.timeout)
        # one round trip: the least of this exchange and the handshake's first (each is a
        # frame the prefill only answers)
        round_trip = min(time.perf_counter() - t, peer.info.round_trip or float("inf"))
        route = route_from(reply, client.pool)
    except KVRuntimeError as exc:
        if peer.broken:
            raise
        reason = f"direct: {exc}"
        log.info("%s: %s", peer.name, reason)
        return None, None, reason
    try:
        warm(peer, route)
    except KVRuntimeError as exc:
        log.info("%s: warming the READ of its pool: %s", peer.name, exc)
    if client.coalesce != "auto":
        return route, None, f"coalesce={client.coalesce!r}"
    model = None
    try:
        model = probe(peer, route, round_trip)
    except KVRuntimeError as exc:
        log.info("%s: coalescing probe: %s", peer.name, exc)
    return route, model, ("auto: by the connect-time probe" if model else
                          "direct: the connect-time probe could not run (our pool busy, the "
                          "peer's cache too small, or our gather unmeasured at our start: our "
                          "cache under four blocks or our pool under two)")


def choose(peer, handle, *, mode: str, route: PoolRoute | None, model: Model | None,
           reason: str) -> tuple[bool, str]:
    """Whether a direct NIXL request goes through the pools (``route``, by the client's
    ``mode`` and the connect's ``model``; ``reason``: why, where neither decides), and why:
    both go into its result. One larger than the pools moves in pieces (said in the reason);
    where not even a block fits, it is refused at once under "always" (StagingExhausted,
    with the numbers) and goes direct under "auto"."""
    if route is None or mode == "never":
        return False, reason
    plan, lay = handle.plan, peer.client.cache.layout
    heads = peer.head_slice.count if peer.head_slice else lay.num_kv_heads
    units, fits = plan.num_blocks * heads, min(route.pool.units, route.remote_units)
    if fits < heads:
        if mode == "always":
            raise StagingExhausted(
                f"request {handle.request_id} can never fit the staging pools: a block is "
                f"{heads} units, the decode's pool {route.pool.units}, the prefill's "
                f"{route.remote_units}; size the pools (staging_blocks) for at least one "
                f"block, or coalesce='auto'")
        return False, f"a block's {heads} units do not fit the pools ({fits} units)"
    # larger than the pools: in pieces as large as both hold, one after another (staged.py)
    count = -(-plan.num_blocks // (fits // heads))
    split = "" if count == 1 else f"; in {count} pieces ({units} units, the pools hold {fits})"
    if mode == "always":
        return True, "coalesce='always'" + split
    if model is None:
        return False, reason
    # mixed TP, direct: a descriptor a token row of each block's head slice
    descriptors = (plan.num_blocks * lay.num_regions * rows_per_chunk(lay)
                   if peer.head_slice is not None else plan.descriptor_count)
    chosen, why = model.choose(descriptors, handle.nbytes, count)
    return chosen, (why + split if chosen else why)
