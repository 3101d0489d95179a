"""Host-staged copies: for device memory NIXL cannot register (TPU-style hosts; Intel GPUs
without a ze-capable UCX), or when the operator wants KV to cross hosts through DRAM.

Each side keeps its KV cache where the engine has it (device tensors, or plain process memory
on a CPU host, *not* registered with NIXL) and a staging pool of host blocks registered once as
DRAM. A pull of blocks ``src`` into ``dst``:

    decode  -> prefill  stage    {request, src, deadline}
    prefill             takes len(src) consecutive pool blocks (waits for free ones, never past
                        the deadline), gathers ``src`` into them (block-major: each staging block
                        holds one KV block, regions in order), answers
    prefill -> decode   staged   {request, start, count}       or stage_failed {request, error}
    decode              takes its own pool blocks, READs the prefill's run into them with NIXL
                        (one descriptor), scatters them into ``dst``, frees its blocks
    decode  -> prefill  unstage  {request}     the prefill frees its pool blocks and the request

Gather and scatter are torch index ops (cuda, xpu and cpu tensors alike); a CUDA pool is pinned
(cudaHostRegister) so the copies to and from it run at PCIe speed. Pools never block forever:
a request waits for pool blocks only until its deadline, then fails with the numbers.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time

from .errors import KVRuntimeError, TransferError
from .layout import CROSS_LAYER, KVLayout
from .plan import TransferPlan, make_plan

log = logging.getLogger("kvruntime")

KV_BUFFERS = ("device", "host_staged")


class StagingExhausted(TransferError):
    """No run of free staging blocks large enough came free before the deadline."""


def staging_layout(layout: KVLayout, blocks: int) -> KVLayout:
    """The pool's layout: ``blocks`` whole KV blocks of ``layout`` (one region, block-major)."""
    return KVLayout(CROSS_LAYER, layout.num_layers, blocks, layout.tokens_per_block,
                    layout.num_kv_heads, layout.head_dim, layout.dtype, layout.tp_size)


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

    def __init__(self, layout: KVLayout, blocks: int, device_cache):
        from .memory import KVCache

        if not isinstance(blocks, int) or blocks < 1:
            raise KVRuntimeError(f"staging_blocks must be a positive integer, got {blocks!r}")
        self.layout = staging_layout(layout, blocks)
        self.device_layout = layout
        self.device_cache = device_cache
        self.cache = KVCache.allocate_host(self.layout)
        self._free = [True] * blocks
        self._cv = threading.Condition()
        self._pinned = False
        tensors = device_cache.tensors
        if tensors and tensors[0].device.type == "cuda":
            self._pin()
        self._pool = _byte_regions(self.cache)[0]
        self._device = _byte_regions(device_cache)

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
    def blocks(self) -> int:
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
        if n > self.blocks:
            raise StagingExhausted(f"a request of {n} blocks cannot fit a staging pool of "
                                   f"{self.blocks} blocks: size the pool for the largest request")
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
                        f"staging pool exhausted: {n} blocks wanted, largest free run "
                        f"{self._largest_free_run()} of {self.blocks}, waited "
                        f"{time.monotonic() - t0:.3f}s until the request's deadline")
                self._cv.wait(left)

    def release(self, start: int, n: int) -> None:
        with self._cv:
            self._free[start:start + n] = [True] * n
            self._cv.notify_all()

    # -- copies ----------------------------------------------------------------------------------
    def _ids(self, blocks):
        import torch

        device = self._device[0].device
        return torch.as_tensor(list(blocks), dtype=torch.int64, device=device)

    # Within a staged run of n blocks the pool holds region by region: [region][block][chunk]
    # (for per_layer: layer-major, each region's n chunks one contiguous range). Each region is
    # then gathered straight into its slice and scattered straight out of it, with no temporary.
    def _run_slices(self, start: int, n: int) -> list:
        chunk, bb = self.device_layout.chunk_bytes, self.layout.block_bytes
        base = start * bb
        return [self._pool[base + r * n * chunk: base + (r + 1) * n * chunk].view(n, chunk)
                for r in range(len(self._device))]

    def gather(self, blocks, start: int) -> None:
        """Device cache ``blocks`` -> the pool run at ``start``, finished when this returns."""
        ids, nb, chunk = self._ids(blocks), self.device_layout.num_blocks, \
            self.device_layout.chunk_bytes
        for region, out in zip(self._device, self._run_slices(start, len(blocks))):
            src = region[:nb * chunk].view(nb, chunk)
            if src.device.type == "cpu":
                torch_index_select(src, ids, out)
            else:  # gather on the device, then one copy into the pinned run
                out.copy_(src.index_select(0, ids), non_blocking=self._pinned)
        self._sync()

    def scatter(self, start: int, blocks) -> None:
        """The pool run at ``start`` -> device cache ``blocks``, finished when this returns."""
        ids, nb, chunk = self._ids(blocks), self.device_layout.num_blocks, \
            self.device_layout.chunk_bytes
        for region, src in zip(self._device, self._run_slices(start, len(blocks))):
            dst = region[:nb * chunk].view(nb, chunk)
            if region.device.type == "cpu":
                # numpy's row assignment copies whole rows (memcpy each); torch's index_copy_
                # on CPU went element by element: 7 ms against 0.9 for 16 MiB here
                dst.numpy()[ids.numpy()] = src.numpy()
            else:
                dst.index_copy_(0, ids, src.to(region.device, non_blocking=self._pinned))
        self._sync()

    def _sync(self) -> None:
        dev = self._device[0].device
        if dev.type != "cpu":
            import torch

            getattr(torch, dev.type).synchronize(dev)

    def close(self) -> None:
        if self._pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.cache.regions[0].address)
            self._pinned = False
        self._pool = None
        self._device = []
        self.cache.close()


def torch_index_select(src, ids, out) -> None:
    import torch

    torch.index_select(src, 0, ids, out=out)


def pool_plan(src_layout: KVLayout, src_start: int, dst_layout: KVLayout, dst_start: int,
              n: int) -> TransferPlan:
    """The one-run plan moving pool blocks ``src_start..`` to ``dst_start..``."""
    return make_plan(src_layout, list(range(src_start, src_start + n)), dst_layout,
                     list(range(dst_start, dst_start + n)))


class StagedPull:
    """Decode side of one staged request, polled like a PostedTransfer (see module doc)."""

    engine = "host_staged"
    releases_itself = True  # it sends "unstage"; the handle sends no "release"

    def __init__(self, peer, plan: TransferPlan, request_id: str, deadline_wall: float):
        self.peer = peer
        self.plan = plan
        self.request_id = request_id
        self.state = "PROC"
        self.error: str | None = None
        self.start = time.perf_counter()
        self.end: float | None = None
        self._remote: tuple[int, int] | None = None
        self._local: int | None = None
        self._xfer = None
        self._unstaged = False
        src, self._dst = (ids.tolist() for ids in plan.block_ids())
        peer._send({"type": "stage", "request": request_id, "src": src,
                    "deadline": deadline_wall})

    def on_reply(self, message: dict) -> None:
        if message.get("type") == "staged":
            start, count = message.get("start"), message.get("count")
            if (isinstance(start, int) and isinstance(count, int)
                    and count == self.plan.num_blocks and start >= 0):
                self._remote = (start, count)
                return
            self._fail("the prefill answered with a malformed staged run")
        else:
            self._fail(f"the prefill could not stage it: {message.get('error')}")

    def poll(self) -> str:
        if self.state != "PROC":
            return self.state
        pool = self.peer.client.staging
        if self._remote is not None and self._xfer is None:
            self._local = pool.try_acquire(self._remote[1])
            if self._local is None:
                return self.state  # waits for pool blocks until the handle's deadline
            from .transfer import PostedTransfer

            reg = self.peer.client.registration
            plan = pool_plan(self.peer.info.layout, self._remote[0], pool.layout, self._local,
                             self._remote[1])
            try:
                self._xfer = PostedTransfer(self.peer.client.agent, "READ", plan,
                                            reg.local_dlist, reg.peer_dlist(self.peer.agent),
                                            True, b"")
            except KVRuntimeError as exc:
                self._fail(str(exc))
                return self.state
        if self._xfer is not None:
            st = self._xfer.poll()
            if st == "DONE":
                self._xfer.finish()
                pool.scatter(self._local, self._dst)
                self._done("DONE")
            elif st == "ERR":
                self._xfer.finish()
                self._fail("the NIXL READ of the staged blocks failed (prefill gone?)")
        return self.state

    def _fail(self, why: str) -> None:
        self.error = why
        self._done("ERR")

    def _done(self, state: str) -> None:
        self.state = state
        self.end = time.perf_counter()
        self._cleanup()

    def _cleanup(self) -> None:
        if self._local is not None:
            self.peer.client.staging.release(self._local, self._remote[1])
            self._local = None
        if not self._unstaged:
            self._unstaged = True
            try:
                self.peer._send({"type": "unstage", "request": self.request_id})
            except KVRuntimeError:
                pass  # the connection is gone: the prefill frees everything of ours

    @property
    def seconds(self) -> float:
        return (self.end or time.perf_counter()) - self.start

    def finish(self) -> None:
        pass

    def abort(self) -> bool:
        if self.state != "PROC":
            return True
        aborted = self._xfer.abort() if self._xfer is not None else True
        if aborted:
            self._cleanup()
        self.state = "ERR"
        return aborted

    def result(self):
        from .transfer import TransferResult

        return TransferResult("READ", self.plan.nbytes, self.seconds, self.plan.num_runs,
                              1, None, engine=self.engine)
