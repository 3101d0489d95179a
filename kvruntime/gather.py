"""Copying a request's blocks between two device caches with as few launches as possible.

Each region is a flat byte tensor of ``num_blocks`` chunks. A request is a list of runs
(plan.py). Few runs: one ``copy_`` (cudaMemcpy) per run and region, which moves contiguous
bytes at full speed. Many runs: one gather kernel per region over the expanded block lists —
Triton where present (each program copies one tile of one block, reading the source block and
writing the destination block once), else torch's ``index_select``+``index_copy_`` (twice the
traffic, but still one launch pair instead of one copy per block).
"""

from __future__ import annotations

import logging

import numpy as np

from .cudart import enable_peer_access

log = logging.getLogger("kvruntime")

# Up to this many runs, per-run copy_ beats building index lists.
RUN_COPY_MAX = 8

try:  # Triton is optional: CUDA builds of torch carry it
    import triton
    import triton.language as tl

    @triton.jit
    def _gather_blocks(src, dst, src_ids, dst_ids, words, TILE: tl.constexpr):
        i = tl.program_id(0)
        tile = tl.program_id(1)
        s = tl.load(src_ids + i).to(tl.int64)
        d = tl.load(dst_ids + i).to(tl.int64)
        offs = tile * TILE + tl.arange(0, TILE)
        mask = offs < words
        v = tl.load(src + s * words + offs, mask=mask)
        tl.store(dst + d * words + offs, v, mask=mask)
except Exception:  # ImportError, or a Triton that cannot compile here
    triton = None


def _word_view(flat, chunk_bytes: int):
    """The widest integer view of a flat byte tensor whose element divides a chunk."""
    import torch

    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if chunk_bytes % size == 0 and flat.data_ptr() % size == 0:
            return flat.view(dtype), chunk_bytes // size
    return flat, chunk_bytes


class _IdUploads:
    """Block id lists to the device with no allocation per request (cudaHostAlloc costs
    ~0.3 ms, and each torch allocation and event a few µs: with 32 small requests in flight
    those were the whole cost): a ring of slots, each a pinned host buffer (written through its
    numpy view) and a device buffer, with two events — the host side is rewritten once its
    upload is done, the device side once the gathers that read it are. Uploads run on a stream
    of their own so that they never queue behind the gathers they feed. Both id lists start
    16-byte aligned whatever the request's length (one kernel specialization)."""

    SLOTS, CAPACITY = 8, 1 << 16

    def __init__(self, device):
        import torch

        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        n = 2 * self.CAPACITY
        self.host = [torch.empty(n, dtype=torch.int64).pin_memory() for _ in range(self.SLOTS)]
        self.host_np = [h.numpy() for h in self.host]
        self.dev = [torch.empty(n, dtype=torch.int64, device=device) for _ in range(self.SLOTS)]
        self.uploaded = [torch.cuda.Event() for _ in range(self.SLOTS)]
        self.read = [torch.cuda.Event() for _ in range(self.SLOTS)]  # its gathers are queued
        self.used = [False] * self.SLOTS
        self.next = 0

    def upload(self, src_ids, dst_ids, consumer):
        """(src ids, dst ids, slot) on the device, ready for work queued on ``consumer``; call
        ``consumed(slot, stream)`` once the work reading them is queued."""
        import torch

        n, cap = len(src_ids), self.CAPACITY
        if n > cap:  # one-off: a request larger than a slot gets buffers of its own
            host = torch.from_numpy(np.concatenate((src_ids, dst_ids))).pin_memory()
            with torch.cuda.stream(self.stream):
                dev = host.to(self.device, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            consumer.wait_event(event)
            dev.record_stream(consumer)  # freed only once the consumer's gathers are done
            return dev[:n], dev[n:], None
        i, self.next = self.next, (self.next + 1) % self.SLOTS
        if self.used[i]:
            self.uploaded[i].synchronize()  # its last upload has left the host buffer
        off = (n + 1) & ~1  # destination ids 16-byte aligned, like the source ids
        host = self.host_np[i]
        host[:n] = src_ids
        host[off:off + n] = dst_ids
        dev = self.dev[i]
        with torch.cuda.stream(self.stream):
            if self.used[i]:
                self.stream.wait_event(self.read[i])  # the gathers reading it are done
            dev[:off + n].copy_(self.host[i][:off + n], non_blocking=True)
            self.uploaded[i].record(self.stream)
        self.used[i] = True
        consumer.wait_event(self.uploaded[i])
        return dev[:n], dev[off:off + n], i

    def consumed(self, slot, stream) -> None:
        """The work reading ``slot`` is queued on ``stream``: the slot's next upload waits
        for it."""
        if slot is not None:
            self.read[slot].record(stream)


class BlockGather:
    def __init__(self, src_regions: list, dst_regions: list, chunk_bytes: int,
                 src_blocks: int, dst_blocks: int):
        self.src = src_regions
        self.dst = dst_regions
        self.chunk = chunk_bytes
        self.same_device = all(s.device == d.device for s, d in zip(src_regions, dst_regions))
        self.use_triton = triton is not None
        if not self.same_device and self.use_triton:
            # A kernel on the decode's GPU reads the peer's memory over NVLink only once peer
            # access is enabled from its context (torch's peer copies do not need it; without
            # it Triton refuses the pointer: "cannot be accessed from Triton").
            for s, d in {(s.device, d.device) for s, d in zip(src_regions, dst_regions)}:
                why = enable_peer_access(d, s)
                if why:
                    log.info("no peer access %s -> %s (%s): gathers take torch's two steps",
                             d, s, why)
                    self.use_triton = False
        self._uploads = None
        # what each request's launches need, made once: per region the word views, the words
        # of a block, the tile and the tiles per block (the grid's second axis)
        self._launches = []
        for s, d in zip(src_regions, dst_regions):
            (sw, words), (dw, _) = (_word_view(s[: src_blocks * chunk_bytes], chunk_bytes),
                                    _word_view(d[: dst_blocks * chunk_bytes], chunk_bytes))
            tile = 2048 if words >= 2048 else _next_power_of_2(words)
            self._launches.append((sw, dw, words, tile, -(-words // tile)))
        # the torch fallback's [block][bytes] views
        self._rows = [(s[: src_blocks * chunk_bytes].view(src_blocks, chunk_bytes),
                       d[: dst_blocks * chunk_bytes].view(dst_blocks, chunk_bytes))
                      for s, d in zip(src_regions, dst_regions)]

    def copy(self, plan) -> str:
        """Enqueue the copy of ``plan``'s blocks on the current stream; returns the method."""
        c = self.chunk
        if plan.num_runs <= RUN_COPY_MAX:
            runs = plan.runs
            for src, dst in zip(self.src, self.dst):
                for r in runs:
                    dst[r.dst * c:(r.dst + r.count) * c].copy_(src[r.src * c:(r.src + r.count) * c],
                                                              non_blocking=True)
            return "copy"
        import torch

        device = self.dst[0].device
        if self._uploads is None:
            self._uploads = _IdUploads(device)
        stream = torch.cuda.current_stream(device)
        s_ids, d_ids, slot = self._uploads.upload(*plan.block_ids(), stream)
        try:
            return self._launch(s_ids, d_ids, device)
        finally:
            self._uploads.consumed(slot, stream)  # the slot is rewritten after these gathers

    def _launch(self, s_ids, d_ids, device) -> str:
        n = len(s_ids)
        if self.use_triton:
            try:
                for sw, dw, words, tile, tiles in self._launches:
                    _gather_blocks[(n, tiles)](sw, dw, s_ids, d_ids, words, TILE=tile,
                                               num_warps=8)
                return "triton"
            except Exception as exc:  # e.g. a source on another device Triton refuses
                log.warning("Triton gather unavailable (%s); using torch index ops", exc)
                self.use_triton = False
        for src_rows, dst_rows in self._rows:
            rows = src_rows.index_select(0, s_ids.to(src_rows.device))
            dst_rows.index_copy_(0, d_ids, rows.to(device, non_blocking=True))
        return "torch"


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()
