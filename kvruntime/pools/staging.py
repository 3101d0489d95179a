"""Staging pools: the one design requests go through when they do not move directly — host-staged
peers (device memory NIXL cannot register: TPU-style hosts, Intel GPUs without a ze-capable UCX;
or KV that should cross hosts through DRAM) and coalesced NIXL transfers of direct peers
(coalesce.py: many runs moved as one descriptor a chunk).

A pool is a KVCache of its own, registered with NIXL: host DRAM (host caches; host-staged device
caches, pinned for CUDA) or VRAM on the cache's device (coalesced device caches). Its unit is one
KV head of one block, the same on every side whatever its TP size, so a decode rank's head slice
is one contiguous run. A pull of blocks ``src`` into ``dst`` (the decode's side: staged.py):

    decode  -> prefill  stage    {request, src, deadline[, heads]}
    prefill             takes len(src) x heads consecutive pool units (waits for free ones,
                        never past the deadline), gathers ``src`` into them chunk by chunk (the
                        run is region-major: a range of its (region, block) rows is one range
                        of memory) and answers each chunk as it is in the pool
    prefill -> decode   staged   {request, start, count, rows, last}   or stage_failed
    decode              takes its own pool units at the first answer, READs each chunk into
                        them as its answer comes (NIXL, one descriptor; or, host-staged on the
                        same host, the same-node engine's reader threads), scatters each into
                        ``dst`` as it lands, frees its units when the last scatter has passed
    decode  -> prefill  unstage  {request}     the prefill frees its pool units and the request

Gather and scatter: between host memory, one C call per chunk (native.py; its copies without
the GIL, a decode's scatters on a thread of the pool's); between a device cache and a host pool,
through a ring of device bounce slots (bounce.py: the index op fills a slot at device speed
while the copy engine moves the previous one across PCIe); between a device cache and a device
pool, torch index ops on the pool's stream. Streams of the pool's own run after the caller's
stream and end in events: nothing waits for the whole device, and the decode's poll never
blocks on a copy. Pools never block forever: a request waits for pool units only until its
deadline, then fails with the numbers.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import replace

from ..errors import KVRuntimeError, StagingExhausted
from ..layout import CROSS_LAYER, KVLayout
from .bounce import SLOT_BYTES, BounceRing, pieces, streams
from .freeruns import FreeRuns, take_waiting
from .hostcopy import HostCopies
from .poolcopy import copy_rows
from .views import PoolViews

log = logging.getLogger("kvruntime")

KV_BUFFERS = ("device", "host_staged")


def resolve_kv_buffer(kv_buffer: str | None, device_kind: str = "cpu",
                      offered=lambda: None) -> str:
    """The mode asked for, else ``KVRUNTIME_KV_BUFFER`` (the installer's env.sh sets it from the
    platform recipe: tpu stages), else by device: Intel GPU memory goes direct only when this
    host's UCX offers a Level Zero transport (``offered()``: ucx_info's transports), else staged
    with a warning that says why; everything else direct."""
    from ..options import environment

    value = kv_buffer if kv_buffer is not None else environment("KVRUNTIME_KV_BUFFER")
    if value is None and device_kind == "xpu":
        transports = offered()
        if transports is not None and "ze_copy" in transports:
            return "device"
        why = ("this host's UCX offers no Level Zero transport (ze_copy)" if transports is not None
               else "no ucx_info on PATH tells whether this host's UCX has Level Zero support")
        log.warning("xpu KV caches go host-staged: %s; for direct transfers use a ze-capable "
                    "UCX (python -m installer --platform xpu) or pass kv_buffer='device'", why)
        return "host_staged"
    value = value or "device"
    if value not in KV_BUFFERS:
        source = "kv_buffer" if kv_buffer is not None else "KVRUNTIME_KV_BUFFER"
        raise KVRuntimeError(f"{source} must be one of {', '.join(KV_BUFFERS)}, got {value!r}")
    return value


def staging_layout(layout: KVLayout, units: int) -> KVLayout:
    """The pool's layout: ``units`` of one KV head of one block over all layers, K and V. Both
    sides count in these units whatever their TP size, so a run moves between pools of ranks
    with different head counts as one descriptor."""
    return KVLayout(CROSS_LAYER, layout.num_layers, units, layout.tokens_per_block, 1,
                    layout.head_dim, layout.dtype, 1)


POOL_MEMORY = ("host", "device")
# A run is answered (and READ) in pieces, at least this many bytes each (host, device pool) and
# at most MAX_CHUNKS of them: the gather of one overlaps the READ of the one before it, and its
# scatter the READ of the next; each costs a frame and a NIXL post (tens of µs). A device pool's
# chunk costs ~0.5 ms whatever its size (4 x H100 at 43f3fcb, one GPU: 64 MiB in 4 chunks of 16
# MiB 2038 µs, 1 GiB in 16 of 64 MiB 8170 µs, 510 µs a chunk both), more than its gather or
# scatter (~0.1 ms for 64 MiB) or its wire across NVLink (~0.19 ms): few large chunks there.
CHUNK_BYTES = {"host": 4 << 20, "device": 64 << 20}
MAX_CHUNKS = {"host": 16, "device": 4}


class StagingPool(PoolViews):
    """``blocks`` staging blocks for caches of ``layout``: a KVCache of its own (what gets
    registered with NIXL), an allocator of consecutive runs, and gather/scatter.

    ``memory``: "host" (DRAM: host caches, and the host-staged mode of device caches, whose
    copies cross PCIe through the bounce ring) or "device" (VRAM on the cache's own device:
    coalesced NIXL transfers of a device cache, gathered and scattered by index ops on the
    device itself). One allocator, one unit (one KV head of one block), one run layout."""

    def __init__(self, layout: KVLayout, blocks: int, device_cache,
                 bounce_bytes: int = SLOT_BYTES, memory: str = "host"):
        from ..memory import KVCache

        if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 1:
            raise KVRuntimeError(f"staging_blocks must be a positive integer, got {blocks!r}")
        if memory not in POOL_MEMORY:
            raise KVRuntimeError(f"a staging pool's memory must be one of "
                                 f"{', '.join(POOL_MEMORY)}, got {memory!r}")
        tensors = device_cache.tensors
        on_device = bool(tensors) and tensors[0].device.type != "cpu"
        if memory == "device" and not on_device:
            raise KVRuntimeError("a device staging pool needs a device cache (cuda or xpu "
                                 "tensors); a host cache stages in host memory")
        self.memory = memory
        self.layout = staging_layout(layout, blocks * layout.num_kv_heads)
        self.device_layout = layout
        self.device_cache = device_cache
        if memory == "device":
            dev = tensors[0].device
            self.cache = KVCache.allocate_device(self.layout, dev.type, dev.index or 0)
        else:
            self.cache = KVCache.allocate_host(self.layout)
        self._free = FreeRuns(self.layout.num_blocks)  # units: one head of one block
        self._cv = threading.Condition()
        self._pinned = False
        if memory == "host" and on_device and tensors[0].device.type == "cuda":
            self._pin()
        self._ring = None
        self._streams = None  # a device pool's stream and events (bounce.streams)
        # a device pool's launches, one thread at a time: the streams' caller event and their
        # pinned upload slots are shared (a prefill serves its decodes from several threads)
        self._launch = threading.Lock()
        self._host = None  # host memory both sides: its copies (hostcopy.py)
        self._region_views: dict = {}  # (h0, h1) -> the regions' views of those heads
        self._stacked_views: dict = {}  # (h0, h1) -> cross_layer: them all as one view
        if memory == "device":
            self._streams = streams(tensors[0].device)
        elif on_device:  # copies pipelined through device bounce slots (bounce.py)
            row = layout.tokens_per_block * layout.num_kv_heads * self._head_words
            self._ring = BounceRing(tensors[0].device, self._pool_words.dtype,
                                    max(row, bounce_bytes // self._pool_words.element_size()))
        else:  # host memory both sides: C copies of the pieces (native.py), no torch op (a
            # host prefill or decode never imports torch for its pool: 2-9 s of its start)
            self._host = HostCopies(device_cache, layout,
                                    run_base=self.cache.regions[0].address,
                                    unit_bytes=self.layout.block_bytes, row_bytes=self.row_bytes)

    def _pin(self) -> None:
        """Page-lock the pool for CUDA copies (without it a copy to pageable memory is staged
        by the driver through its own pinned buffer, at a fraction of the speed)."""
        import torch

        r = self.cache.regions[0]
        err = torch.cuda.cudart().cudaHostRegister(r.address, r.nbytes, 0)
        if int(err) != 0:
            raise KVRuntimeError(f"cudaHostRegister of the {r.nbytes}-byte staging pool failed "
                                 f"(error {int(err)}): this host cannot pin memory for staging")
        self._pinned = True

    @property
    def units(self) -> int:
        return self._free.units

    # -- allocation ----------------------------------------------------------------------------
    def largest_free_run(self) -> int:
        with self._cv:
            return self._free.largest

    def numbers(self, wanted: int) -> str:
        """The pool's numbers for an error: asked, free, largest free run, size."""
        with self._cv:
            return (f"{wanted} units asked, {self._free.free} free (largest free run "
                    f"{self._free.largest}) of {self.units}")

    def try_acquire(self, n: int) -> int | None:
        with self._cv:
            return self._free.take(n)

    def acquire(self, n: int, deadline: float) -> int:
        """``n`` consecutive blocks; waits for them until ``deadline`` (monotonic), never longer."""
        if n > self.units:
            raise StagingExhausted(f"a request of {n} units cannot fit a staging pool of "
                                   f"{self.units} units: size the pool for the largest request")
        return take_waiting(self._free, self._cv, n, deadline)

    def release(self, start: int, n: int) -> None:
        with self._cv:
            self._free.give(start, n)
            self._cv.notify_all()

    # -- copies ----------------------------------------------------------------------------------
    # A staged run of n blocks and hs heads holds [2 x layers][n][tokens][hs][head_dim] (K/V of
    # each layer, then blocks): the same on every side whatever its layout kind or TP size, so
    # a decode rank's heads arrive as one contiguous run and scatter into their place. Its
    # "rows" are its (region, block) pairs in that order, row r * n + b: a range of rows is one
    # contiguous range of the run, which is what a chunk is.
    def row_bytes(self, hs: int) -> int:
        """Bytes of one row (one region of one block, ``hs`` heads) of a run."""
        lay = self.device_layout
        return lay.tokens_per_block * hs * lay.head_dim * lay.element_bytes

    def chunks(self, n: int, hs: int, chunk_bytes: int | None = None) -> list[tuple[int, int]]:
        """The row ranges a run of ``n`` blocks and ``hs`` heads is gathered, answered, READ
        and scattered in: at least ``chunk_bytes`` each (CHUNK_BYTES of the pool's memory),
        at most MAX_CHUNKS of it; whole regions where the bounce ring copies (its pieces follow
        region order)."""
        regions = 2 * self.device_layout.num_layers
        total = regions * n
        if self._ring is not None:
            k = min(CHUNKS, regions)
            return [(i * regions // k * n, (i + 1) * regions // k * n) for i in range(k)]
        least = CHUNK_BYTES[self.memory] if chunk_bytes is None else chunk_bytes
        per = max(1, least // self.row_bytes(hs), -(-total // MAX_CHUNKS[self.memory]))
        return [(lo, min(total, lo + per)) for lo in range(0, total, per)]

    def warm(self) -> None:
        """A device pool: its gather's and scatter's kernels launched once now (CUDA loads a
        kernel at its first launch: on the H100 host a first coalesced request took 37 ms, 16
        of them its first scatter, then 17 ms, 13 of them the prefill's first gather, later
        ones 1.3 ms). torch's index_select picks its kernel by the number of ids (at most 16,
        or more) and by the cache's size (32- or 64-bit offsets), so the gathers read the
        cache itself, as requests do, at both counts (nothing of it is written); the scatters
        write a scratch cache of two blocks viewed as the cache is. Every piece kind of
        poolcopy.py runs (whole regions and partial ones)."""
        lay, h = self.device_layout, self.device_layout.num_kv_heads
        k = min(32, lay.num_blocks, self.units // h)
        if self._streams is None or k < 2:
            return
        import torch

        scratch_lay = replace(lay, num_blocks=2)
        device = self._device[0].device
        scratch = [torch.zeros(scratch_lay.region_bytes, dtype=torch.uint8, device=device)
                   for _ in range(scratch_lay.num_regions)]
        heads = (0, h)
        scratch_views, scratch_stacked = self._views_of(scratch, scratch_lay, heads)
        counts = sorted({2, k})
        # through the requests' own upload: reading blocks 0..n-1, writing scratch blocks 0, 1
        uploads = [(n, self.ids(list(range(n))), self.ids([i % 2 for i in range(n)]))
                   for n in counts]
        with self._cv:  # the pool's first units, while no request can hold them
            if not self._free.is_free(0, k * h):
                return
            st = self._streams
            with self._launch, st.compute_after_caller():
                for n, gather_ids, scatter_ids in uploads:
                    rows = 2 * lay.num_layers * n
                    run = self._run(0, n, h)
                    for part in ((0, rows), (1, rows - 1)):  # whole regions; partial ends
                        copy_rows(self._regions(heads), self._stacked(heads), run, gather_ids,
                                  part, True)
                        copy_rows(scratch_views, scratch_stacked, run, scatter_ids, part, False)
                event = st.event()
                st.record(event, st.compute)
            wait(event)

    def ids(self, blocks):
        """Block ids (a list or a numpy array; the roles pass the plan's validated arrays) as
        int64 numpy: the ring uploads them itself, once per call, on its compute stream. A
        device pool's are uploaded here, once for all the chunks of a request (16 uploads of
        a 4096-block request cost ~0.3 ms, a fifth of its GiB's READ on an H100), into a
        tensor of the request's own (its scatters may be queued long after, behind other
        requests' uploads): one cudaMemcpyAsync from a pinned slot on CUDA, where torch's
        stream context and pageable copy cost 120-150 µs (2 x H100)."""
        import numpy as np

        if self._streams is None:
            return np.asarray(blocks, dtype=np.int64)
        import torch

        # a tensor is already on the device (numpy 2's arrays have a ``device`` too: "cpu")
        if isinstance(blocks, torch.Tensor):
            return blocks
        ids = np.asarray(blocks, dtype=np.int64)
        with self._launch, self._streams.compute_after_caller():
            return self._streams.upload_owned(ids)

    def _device_copy(self, ids, start: int, heads: tuple[int, int], rows: tuple[int, int],
                     gather: bool):
        """Rows ``rows`` between a device cache and the run at ``start`` in a device pool:
        index ops on the pool's stream (after the caller's), at most three a chunk for a
        cross_layer cache (poolcopy.py). Returns an event after them."""
        n, hs = len(ids), heads[1] - heads[0]
        views, run = self._regions(heads), self._run(start, n, hs)
        st = self._streams
        with self._launch, st.compute_after_caller():
            # ``ids`` are on the device already: uploaded once a request (ids())
            copy_rows(views, self._stacked(heads), run, ids, rows, gather)
            event = st.event()
            st.record(event, st.compute)
        return event

    def gathers(self, ids, start: int, heads: tuple[int, int], chunks: list):
        """Gather ``chunks`` (row ranges) of the run at ``start`` from blocks ``ids`` (from
        ``ids()``), yielding each chunk's rows once it is in the pool, in order. Copies that
        run on a stream (a device pool, the bounce ring) are queued one chunk ahead of the
        one waited for: the device gathers the next while the caller answers this one (queued
        only after the wait, the device idled for the answer and the launch, 150-240 µs a
        64 MiB chunk on 2 x H100, where its gather takes ~60). A host pool's C copies run in
        the call, one chunk at a time. A launch that fails raises here, after the copies
        queued before it have passed (nothing writes into the run once its caller frees it)."""
        ahead = 1 if self._streams is not None or self._ring is not None else 0
        queued: list = []
        for rows in chunks:
            try:
                queued.append((rows, self._gather_async(ids, start, heads, rows)))
            except BaseException:
                for _, event in queued:
                    _quiet_wait(event)
                raise
            while len(queued) > ahead:
                done_rows, event = queued.pop(0)
                wait(event)
                yield done_rows
        for done_rows, event in queued:
            wait(event)
            yield done_rows

    def _gather_async(self, ids, start: int, heads: tuple[int, int], rows: tuple[int, int]):
        """Rows ``rows`` of blocks ``ids`` into the run at ``start``: queued (an event to wait
        for: a device pool, the bounce ring), or done in the call (a host pool: None)."""
        n, hs = len(ids), heads[1] - heads[0]
        if self._streams is not None:
            return self._device_copy(ids, start, heads, rows, True)
        if self._ring is None:
            self._host.copy(ids, start, heads, rows, True)
            return None
        shape = self._row_shape(hs)
        fills = pieces(range(rows[0] // n, -(-rows[1] // n)), n, math.prod(shape),
                       self._ring.slot_words)
        return self._ring.gather(fills, self._regions(heads), ids, self._run_flat(start, n, hs),
                                 shape)

    def gather(self, blocks, start: int, heads: tuple[int, int] | None = None,
               rows: tuple[int, int] | None = None) -> int:
        """Heads ``heads`` (all by default) of device cache ``blocks`` -> rows ``rows`` (all
        by default) of the run at ``start``; finished when this returns (waiting for the
        pool's own streams, never the device). Returns the units of the run."""
        h0, h1 = heads = heads or (0, self.device_layout.num_kv_heads)
        ids = self.ids(blocks)
        rows = rows or (0, 2 * self.device_layout.num_layers * len(ids))
        wait(self._gather_async(ids, start, heads, rows))
        return len(ids) * (h1 - h0)

    def scatter(self, start: int, blocks, heads: tuple[int, int] | None = None) -> None:
        """The run at ``start`` -> heads ``heads`` of device cache ``blocks``, finished when
        this returns."""
        wait(self.scatter_async(start, blocks, heads))

    def scatter_async(self, start: int, blocks, heads: tuple[int, int] | None = None,
                      rows: tuple[int, int] | None = None):
        """Queue rows ``rows`` (all by default) of the run at ``start`` into heads ``heads``
        of device cache ``blocks``. Returns what to poll (``done``/``wait``): a device
        event, or a host scatter's future (run on the pool's scatter thread, beside its
        caller's NIXL calls). The run must stay untouched until then."""
        g0, g1 = heads = heads or (0, self.device_layout.num_kv_heads)
        ids = self.ids(blocks)
        n, hs = len(ids), g1 - g0
        rows = rows or (0, 2 * self.device_layout.num_layers * n)
        if self._streams is not None:
            return self._device_copy(ids, start, heads, rows, False)
        if self._ring is None:
            return self._host.scatter(ids, start, heads, rows)
        shape = self._row_shape(hs)
        fills = pieces(range(rows[0] // n, -(-rows[1] // n)), n, math.prod(shape),
                       self._ring.slot_words)
        return self._ring.scatter(fills, self._run_flat(start, n, hs), self._regions(heads),
                                  ids, shape)

    def close(self) -> None:
        if self._pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.cache.regions[0].address)
            self._pinned = False
        if self._host is not None:
            self._host.close()
        self._pool = self._ring = self._streams = self._host = None
        self._device = []
        self.cache.close()


def wait(event) -> None:
    """Until a copy has passed: an event of the pool's stream (this stream's work only, never
    a device-wide synchronize), or a host scatter's future (its error raised here)."""
    if event is None:
        return
    if hasattr(event, "result"):
        event.result()
    else:
        event.synchronize()


def _quiet_wait(event) -> None:
    """``wait``, its error dropped: a copy that failed writes nothing more either."""
    try:
        wait(event)
    except Exception:
        pass


def done(event) -> bool:
    if event is None:
        return True
    return event.done() if hasattr(event, "result") else event.query()


# Where the bounce ring copies, a staged run is answered in this many pieces (whole regions
# each: the ring's fills follow region order).
CHUNKS = 4
