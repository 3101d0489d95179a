"""Host-staged copies: for device memory NIXL cannot register (TPU-style hosts; Intel GPUs
without a ze-capable UCX), or when the operator wants KV to cross hosts through DRAM.

Each side keeps its KV cache where the engine has it (device tensors, or plain process memory
on a CPU host, *not* registered with NIXL) and a staging pool of host blocks registered once as
DRAM. A pull of blocks ``src`` into ``dst``:

    decode  -> prefill  stage    {request, src, deadline}
    prefill             takes len(src) consecutive pool blocks (waits for free ones, never past
                        the deadline), gathers ``src`` into them (region-major: each region's blocks
                        in order, so a range of regions is one range of the run), answers
    prefill -> decode   staged   {request, start, count}       or stage_failed {request, error}
    decode              takes its own pool blocks, READs the prefill's run into them with NIXL
                        (proved on the same host: process_vm_readv over the same-node engine's
                        threads) in CHUNKS pieces of whole regions posted at once, scatters each
                        piece into ``dst`` as it lands (overlapping the READs still running), frees
                        its blocks when the last scatter has passed
    decode  -> prefill  unstage  {request}     the prefill frees its pool blocks and the request

Gather and scatter are torch index ops (cuda, xpu and cpu tensors alike). On a device they run
through a ring of device bounce slots (bounce.py): the index op fills a slot at device speed
while the copy engine moves the previous one across PCIe, on streams of the pool's own after
the caller's stream, followed by events: nothing waits for the whole device, and the decode's
poll never blocks on a copy. A CUDA pool is pinned (cudaHostRegister)
so the copies to and from it run at PCIe speed. Pools never block forever:
a request waits for pool blocks only until its deadline, then fails with the numbers.
"""

from __future__ import annotations

import ctypes
import logging
import math
import threading
import time
from dataclasses import dataclass

from . import frames
from .bounce import SLOT_BYTES, BounceRing, pieces
from .errors import KVRuntimeError, TransferError
from .layout import CROSS_LAYER, KVLayout
from .plan import TransferPlan, make_plan
from .samenode import CopyJob

log = logging.getLogger("kvruntime")

KV_BUFFERS = ("device", "host_staged")


def resolve_kv_buffer(kv_buffer: str | None, device_kind: str = "cpu",
                      offered=lambda: None) -> str:
    """The mode asked for, else ``KVRUNTIME_KV_BUFFER`` (the installer's env.sh sets it from the
    platform recipe: tpu stages), else by device: Intel GPU memory goes direct only when this
    host's UCX offers a Level Zero transport (``offered()``: ucx_info's transports), else staged
    with a warning that says why; everything else direct."""
    from .options import environment

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


class StagingExhausted(TransferError):
    """No run of free staging blocks large enough came free before the deadline."""


def staging_layout(layout: KVLayout, units: int) -> KVLayout:
    """The pool's layout: ``units`` of one KV head of one block over all layers, K and V. Both
    sides count in these units whatever their TP size, so a run moves between pools of ranks
    with different head counts as one descriptor."""
    return KVLayout(CROSS_LAYER, layout.num_layers, units, layout.tokens_per_block, 1,
                    layout.head_dim, layout.dtype, 1)


def _byte_regions(cache) -> list:
    """Each region of ``cache`` as a flat uint8 torch tensor (device tensors, or host memory
    wrapped without a copy)."""
    import torch

    if cache.tensors is not None:
        return cache._byte_views()
    n = cache.layout.region_bytes
    return [torch.frombuffer((ctypes.c_uint8 * n).from_address(r.address), dtype=torch.uint8)
            for r in cache.regions]


class StagingPool:
    """``blocks`` host staging blocks for caches of ``layout``: a KVCache of its own (what gets
    registered with NIXL), an allocator of consecutive runs, and gather/scatter."""

    def __init__(self, layout: KVLayout, blocks: int, device_cache,
                 bounce_bytes: int = SLOT_BYTES):
        from .memory import KVCache

        if not isinstance(blocks, int) or blocks < 1:
            raise KVRuntimeError(f"staging_blocks must be a positive integer, got {blocks!r}")
        self.layout = staging_layout(layout, blocks * layout.num_kv_heads)
        self.device_layout = layout
        self.device_cache = device_cache
        self.cache = KVCache.allocate_host(self.layout)
        self._free = [True] * self.layout.num_blocks  # in units (one head of one block)
        self._cv = threading.Condition()
        self._pinned = False
        tensors = device_cache.tensors
        if tensors and tensors[0].device.type == "cuda":
            self._pin()
        self._pool = _byte_regions(self.cache)[0]
        self._device = _byte_regions(device_cache)
        self._ring = None
        self._region_views: dict = {}  # (h0, h1) -> the regions' views of those heads
        self._pool_words = self._words(self._pool)  # views made once: a request's prologue
        self._head_words = layout.head_dim * layout.element_bytes // self._pool_words.element_size()
        dev = self._device[0].device
        if dev.type != "cpu":  # copies pipelined through device bounce slots (bounce.py)
            row = layout.tokens_per_block * layout.num_kv_heads * self._head_words
            self._ring = BounceRing(dev, self._pool_words.dtype,
                                    max(row, bounce_bytes // self._pool_words.element_size()))

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
        return len(self._free)

    # -- allocation ----------------------------------------------------------------------------
    def _find(self, n: int) -> int | None:
        run = 0
        for i, free in enumerate(self._free):
            run = run + 1 if free else 0
            if run == n:
                return i - n + 1
        return None

    def largest_free_run(self) -> int:
        with self._cv:
            return self._largest_free_run()

    def numbers(self, wanted: int) -> str:
        """The pool's numbers for an error: asked, free, largest free run, size."""
        with self._cv:
            return (f"{wanted} units asked, {sum(self._free)} free (largest free run "
                    f"{self._largest_free_run()}) of {self.units}")

    def _largest_free_run(self) -> int:
        best = run = 0
        for free in self._free:
            run = run + 1 if free else 0
            best = max(best, run)
        return best

    def try_acquire(self, n: int) -> int | None:
        with self._cv:
            start = self._find(n)
            if start is not None:
                self._free[start:start + n] = [False] * n
            return start

    def acquire(self, n: int, deadline: float) -> int:
        """``n`` consecutive blocks; waits for them until ``deadline`` (monotonic), never longer."""
        if n > self.units:
            raise StagingExhausted(f"a request of {n} units cannot fit a staging pool of "
                                   f"{self.units} units: size the pool for the largest request")
        t0 = time.monotonic()
        with self._cv:
            while True:
                start = self._find(n)
                if start is not None:
                    self._free[start:start + n] = [False] * n
                    return start
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StagingExhausted(
                        f"staging pool exhausted: {n} units wanted, largest free run "
                        f"{self._largest_free_run()} of {self.units}, waited "
                        f"{time.monotonic() - t0:.3f}s until the request's deadline")
                self._cv.wait(left)

    def release(self, start: int, n: int) -> None:
        with self._cv:
            self._free[start:start + n] = [True] * n
            self._cv.notify_all()

    # -- copies ----------------------------------------------------------------------------------
    # A staged run of n blocks and hs heads holds [2 x layers][n][tokens][hs][head_dim] (K/V of
    # each layer, then blocks): the same on every side whatever its layout kind or TP size, so
    # a decode rank's heads arrive as one contiguous run and scatter into their place.
    def _run(self, start: int, n: int, hs: int):
        lay = self.device_layout
        return self._run_flat(start, n, hs).view(2 * lay.num_layers, n, lay.tokens_per_block,
                                                 hs, self._head_words)

    def _run_flat(self, start: int, n: int, hs: int):
        """The run at ``start`` of ``n`` blocks of ``hs`` heads as flat words (one op)."""
        u = self.layout.block_bytes // self._pool_words.element_size()
        return self._pool_words[start * u:(start + n * hs) * u]

    def _row_shape(self, hs: int) -> tuple:
        """A block row of one region in a run: [tokens][hs][words of a head]."""
        return (self.device_layout.tokens_per_block, hs, self._head_words)

    def _regions(self, heads: tuple[int, int] | None = None) -> list:
        """The device cache's regions (K or V of one layer) as [block][token][head][words of a
        head] views, of heads ``heads`` (all by default); a cross_layer cache's are strided
        views of its one region. Made once per head range (mixed TP has one or two)."""
        lay = self.device_layout
        heads = heads or (0, lay.num_kv_heads)
        views = self._region_views.get(heads)
        if views is None:
            nb, t, h = lay.num_blocks, lay.tokens_per_block, lay.num_kv_heads
            if lay.kind == CROSS_LAYER:
                whole = self._words(self._device[0][:lay.region_bytes]).view(
                    nb, 2 * lay.num_layers, t, h, -1)
                views = [whole[:, r] for r in range(2 * lay.num_layers)]
            else:
                views = [self._words(r[:lay.region_bytes]).view(nb, t, h, -1)
                         for r in self._device]
            h0, h1 = heads
            if heads != (0, h):
                views = [v[:, :, h0:h1, :] for v in views]
            views = self._region_views[heads] = views
        return views

    def _words(self, flat):
        """A byte range as the widest integers that divide a head's bytes: index ops then move
        8 bytes an element instead of 1 (H100: index_select + pinned copy 0.92 of a pinned copy
        as int64, 0.82 as bytes)."""
        import torch

        de = self.device_layout.head_dim * self.device_layout.element_bytes
        for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
            if de % size == 0 and all(t.data_ptr() % size == 0 for t in (self._pool, *self._device)):
                return flat.view(dtype)
        return flat

    @staticmethod
    def ids(blocks):
        """Block ids (a list or a numpy array; the roles pass the plan's validated arrays) as
        int64 numpy: the ring uploads them itself, once per call, on its compute stream."""
        import numpy as np

        return np.asarray(blocks, dtype=np.int64)

    def gather(self, blocks, start: int, heads: tuple[int, int] | None = None) -> int:
        """Heads ``heads`` (all by default) of device cache ``blocks`` -> the run at ``start``;
        finished when this returns (waiting for the pool's own streams, never the device).
        Returns the units used."""
        import torch

        h0, h1 = heads = heads or (0, self.device_layout.num_kv_heads)
        ids = self.ids(blocks)
        n, hs = len(ids), h1 - h0
        regions = self._regions(heads)
        if self._ring is None:  # a CPU cache: straight into the run, one pass
            run = self._run(start, n, hs)  # [regions][n][t][hs][words]
            for r, view in enumerate(regions):
                torch.index_select(view, 0, torch.from_numpy(ids), out=run[r])
            return n * hs
        shape = self._row_shape(hs)
        fills = pieces(range(len(regions)), n, math.prod(shape), self._ring.slot_words)
        wait(self._ring.gather(fills, regions, ids, self._run_flat(start, n, hs), shape))
        return n * hs

    def scatter(self, start: int, blocks, heads: tuple[int, int] | None = None) -> None:
        """The run at ``start`` -> heads ``heads`` of device cache ``blocks``, finished when
        this returns."""
        wait(self.scatter_async(start, blocks, heads))

    def scatter_async(self, start: int, blocks, heads: tuple[int, int] | None = None,
                      regions: tuple[int, int] | None = None):
        """Queue regions ``regions`` (all by default: a run is region-major, so a range of them
        is one contiguous piece of it) of the run at ``start`` into heads ``heads`` of device
        cache ``blocks``. Returns an event to poll (None: already done, a CPU cache). The run
        must stay untouched until then."""
        g0, g1 = heads = heads or (0, self.device_layout.num_kv_heads)
        r0, r1 = regions or (0, 2 * self.device_layout.num_layers)
        n, hs = len(blocks), g1 - g0
        views = self._regions(heads)
        if self._ring is None:  # numpy copies whole rows; torch's CPU index ops element by element
            src = self._run(start, n, hs)
            ids = self.ids(blocks)
            for r in range(r0, r1):
                views[r].numpy()[ids] = src[r].numpy()
            return None
        shape = self._row_shape(hs)
        fills = pieces(range(r0, r1), n, math.prod(shape), self._ring.slot_words)
        return self._ring.scatter(fills, self._run_flat(start, n, hs), views, self.ids(blocks),
                                  shape)

    def close(self) -> None:
        if self._pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.cache.regions[0].address)
            self._pinned = False
        self._pool = self._ring = None
        self._device = []
        self.cache.close()


def wait(event) -> None:
    """Until an event of the pool's stream has passed (this stream's work only, never a
    device-wide synchronize)."""
    if event is not None:
        event.synchronize()


def done(event) -> bool:
    return event is None or event.query()


def pool_plan(src_layout: KVLayout, src_start: int, dst_layout: KVLayout, dst_start: int,
              n: int) -> TransferPlan:
    """The one-run plan moving pool blocks ``src_start..`` to ``dst_start..``."""
    return make_plan(src_layout, list(range(src_start, src_start + n)), dst_layout,
                     list(range(dst_start, dst_start + n)))


# A staged run is READ in this many pieces (whole regions each), so that the scatter of one
# overlaps the READ of the next.
CHUNKS = 4


@dataclass
class _Chunk:
    regions: tuple[int, int]
    xfer: object  # PostedTransfer
    event: object = None  # its scatter's, on the pool's stream
    scattered: bool = False


class StagedPull(CopyJob):
    """Decode side of one staged request, polled like a PostedTransfer (see module doc)."""

    engine = "host_staged"

    def release(self, peer, request_id: str) -> None:
        """Nothing to say: the request's "unstage" frees the prefill's pool blocks."""

    def give_back(self, peer, request_id: str) -> None:
        """Nothing to say: a failed request's cleanup sends its "unstage" too."""

    def __init__(self, peer, plan: TransferPlan, request_id: str, deadline_wall: float):
        super().__init__("READ", plan)
        self.peer = peer
        tp = peer.head_slice  # which of the prefill's heads, to which of ours
        self._src_heads = tp.src if tp else None
        self._dst_heads = tp.dst if tp else None
        self._units = plan.num_blocks * (tp.count if tp else
                                         peer.client.cache.layout.num_kv_heads)
        self.request_id = request_id
        # what it waits for, for the deadline's error: the prefill's run, then our pool blocks
        self.waiting = "the prefill had not staged it (its pool busy, or it stalled or died)"
        self._remote: tuple[int, int] | None = None
        self._local: int | None = None
        self._chunks: list[_Chunk] = []
        self._unstaged = False
        src, self._dst = plan.block_ids()
        self._message = {"type": "stage", "request": request_id, "src": frames.pack_ids(src),
                         "deadline": deadline_wall}
        if self._src_heads is not None:
            self._message["heads"] = list(self._src_heads)

    @property
    def units(self) -> int:
        """Pool units the request takes (a block's heads of ours, each one unit)."""
        return self._units

    def send(self) -> None:
        """Ask the prefill to stage (once the handle holds this job: another thread's poll may
        hand it the answer at once)."""
        self.peer.send(self._message)

    def on_reply(self, message: dict) -> None:
        if message.get("type") == "staged":
            start, count = message.get("start"), message.get("count")
            if (isinstance(start, int) and isinstance(count, int)
                    and count == self._units and start >= 0):
                self._remote = (start, count)
                return
            self._fail("the prefill answered with a malformed staged run")
        else:
            self._fail(f"the prefill could not stage it: {message.get('error')}")

    def poll(self) -> str:
        if self.state != "PROC":
            return self.state
        pool = self.peer.client.staging
        if self._remote is not None and not self._chunks:
            self._local = pool.try_acquire(self._remote[1])
            if self._local is None:
                self.waiting = f"the decode's staging pool is exhausted: {pool.numbers(self._units)}"
                return self.state  # waits for pool blocks until the handle's deadline
            self.waiting = "its READ of the staged run had not ended (peer dead or stalled)"
            try:
                self._post_chunks(pool)
            except KVRuntimeError as exc:
                self._fail(str(exc))
                return self.state
        for chunk in self._chunks:
            if chunk.scattered:
                continue
            st = chunk.xfer.poll()
            if st == "DONE":  # its regions land while the next chunks are still read
                chunk.xfer.finish()
                chunk.event = pool.scatter_async(self._local, self._dst, self._dst_heads,
                                                 chunk.regions)
                chunk.scattered = True
            elif st == "ERR":
                chunk.xfer.finish()
                self._fail(f"the READ of the staged blocks failed (prefill gone?): "
                           f"{getattr(chunk.xfer, 'error', None) or 'NIXL state ERR'}")
                return self.state
        if self._chunks and all(c.scattered and done(c.event) for c in self._chunks):
            self._done("DONE")
        return self.state

    def _post_chunks(self, pool) -> None:
        """READ the prefill's run into ours as CHUNKS pieces of whole regions (a run is
        region-major, so each is one descriptor), all posted at once: the scatter of a piece
        that has landed overlaps the READs of the next ones."""
        import numpy as np

        from .transfer import PostedTransfer, Rows

        regions = 2 * pool.device_layout.num_layers
        unit, units = pool.layout.block_bytes, self._remote[1]
        per_region = units * unit // regions
        local = pool.cache.regions[0]
        remote = self.peer.info.regions[0]
        local_base = local.address + self._local * unit
        remote_base = remote[0] + self._remote[0] * unit
        plan = pool_plan(self.peer.info.layout, self._remote[0], pool.layout, self._local, units)
        k = min(CHUNKS, regions)
        self._dst = pool.ids(self._dst)  # once for all the chunks' scatters
        bounds = [i * regions // k for i in range(k + 1)]
        engine = self.peer.pool_engine  # same host: our reader threads instead of NIXL
        for a, b in zip(bounds, bounds[1:]):
            off, length = a * per_region, (b - a) * per_region
            if engine is not None:
                xfer = engine.read("READ", plan, np.array([local_base + off], dtype=np.uint64),
                                   np.array([remote_base + off], dtype=np.uint64),
                                   np.array([length], dtype=np.uint64))
                self._chunks.append(_Chunk((a, b), xfer))
                continue
            rows = Rows(np.array([[local_base + off, length, local.device_id]], dtype=np.uint64),
                        np.array([[remote_base + off, length, remote[2]]], dtype=np.uint64),
                        self.peer.agent, local.mem_type, self.peer.info.mem_type)
            xfer = PostedTransfer(self.peer.client.agent, "READ", plan, None, None, True, b"", 1,
                                  rows)
            self._chunks.append(_Chunk((a, b), xfer))

    def _fail(self, why: str) -> None:
        self.error = why
        self._done("ERR")

    def _done(self, state: str) -> None:
        self.state = state
        self.end = time.perf_counter()
        self._cleanup()

    def _cleanup(self) -> None:
        """Stop what has ended, then free our pool blocks and tell the prefill to free its
        own. A READ still in flight (a posted READ cannot be stopped, transfer.py) keeps our
        pool blocks taken until it ends (the client drains it): it may still write into them.
        The cache's blocks are ours alone to write (the scatter)."""
        reading = [c.xfer for c in self._chunks if not c.scattered and not c.xfer.released]
        running = [xfer for xfer in reading if not xfer.abort()]
        for chunk in self._chunks:
            wait(chunk.event)  # a scatter still reading our blocks (the pool's stream only)
        if self._local is not None:
            local, units, pool = self._local, self._remote[1], self.peer.client.staging
            self._local = None
            if not running:
                pool.release(local, units)
            else:
                left = [len(running)]

                def ended():  # the last READ into them has ended: the units are free again
                    left[0] -= 1
                    if not left[0]:
                        pool.release(local, units)

                for xfer in running:
                    self.peer.client.draining.add(xfer, ended, self.peer.agent)
        if not self._unstaged and not self.peer.broken:  # gone: the prefill frees ours
            self._unstaged = True
            try:
                self.peer.send({"type": "unstage", "request": self.request_id})
            except KVRuntimeError:
                pass  # the connection is gone: the prefill frees everything of ours

    def abort(self) -> bool:
        """True: the cache's blocks are written only by our scatter, which stops here (a READ
        still running lands in our pool blocks, kept taken until it ends)."""
        if self.state != "PROC":
            return True
        self.state = "ERR"
        self._cleanup()
        return True

    def result(self):
        from .transfer import TransferResult

        nbytes = self._units * self.peer.client.staging.layout.block_bytes  # our heads only
        return TransferResult("READ", nbytes, self.seconds, self.plan.num_runs,
                              len(self._chunks), None, engine=self.engine)
