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


class BlockGather:
    def __init__(self, src_regions: list, dst_regions: list, chunk_bytes: int,
                 src_blocks: int, dst_blocks: int):
        self.src = src_regions
        self.dst = dst_regions
        self.chunk = chunk_bytes
        self.same_device = all(s.device == d.device for s, d in zip(src_regions, dst_regions))
        self.use_triton = triton is not None
        self.src_words = [_word_view(s[: src_blocks * chunk_bytes], chunk_bytes) for s in src_regions]
        self.dst_words = [_word_view(d[: dst_blocks * chunk_bytes], chunk_bytes) for d in dst_regions]

    def copy(self, runs) -> str:
        """Enqueue the copy of ``runs`` on the current stream; returns the method used."""
        c = self.chunk
        if len(runs) <= RUN_COPY_MAX:
            for src, dst in zip(self.src, self.dst):
                for r in runs:
                    dst[r.dst * c:(r.dst + r.count) * c].copy_(src[r.src * c:(r.src + r.count) * c],
                                                              non_blocking=True)
            return "copy"
        import torch

        device = self.dst[0].device
        s_ids = torch.tensor([r.src + k for r in runs for k in range(r.count)], dtype=torch.int64)
        d_ids = torch.tensor([r.dst + k for r in runs for k in range(r.count)], dtype=torch.int64)
        s_ids = s_ids.pin_memory().to(device, non_blocking=True)
        d_ids = d_ids.pin_memory().to(device, non_blocking=True)
        if self.use_triton:
            try:
                for (sw, words), (dw, _) in zip(self.src_words, self.dst_words):
                    tile = 2048 if words >= 2048 else triton.next_power_of_2(words)
                    grid = (len(s_ids), triton.cdiv(words, tile))
                    _gather_blocks[grid](sw, dw, s_ids, d_ids, words, TILE=tile, num_warps=8)
                return "triton"
            except Exception as exc:  # e.g. a source on another device Triton refuses
                log.warning("Triton gather unavailable (%s); using torch index ops", exc)
                self.use_triton = False
        for src, dst in zip(self.src, self.dst):
            n_src = src.numel() // c
            rows = src[: n_src * c].view(n_src, c).index_select(0, s_ids.to(src.device))
            n_dst = dst.numel() // c
            dst[: n_dst * c].view(n_dst, c).index_copy_(0, d_ids, rows.to(device, non_blocking=True))
        return "torch"
