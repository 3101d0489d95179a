"""A device staging pool's gather and scatter: rows of a region-major run copied from or into a
device cache with a few torch index ops a chunk, whatever the number of regions.

A run of ``n`` blocks is ``[regions][n][row]`` (staging.py): row ``r * n + b`` is region ``r``
(K or V of one layer) of the request's ``b``-th block, and a chunk is a range of rows. One op
per (region, chunk) launches ``2 x layers`` small strided copies for a request whose chunks
hold few blocks each (a model of 64 layers: 128 a request), each ~10-40 µs of host time on the
H100 VM. Here a chunk is at most three ops:

* the regions it holds whole, as one ``index_select`` (gather) or ``index_copy_`` (scatter)
  along the block dimension of the cache's ``[regions][blocks][row]`` view (``stacked``):
  the cross_layer layout, whose blocks hold every region, one strided view over all of them;
* the partial region at each end, one op each (the blocks of one region).

A per_layer cache has one allocation per region, which no single view spans: there each region
a chunk touches is one op, ``regions + chunks - 1`` a request in all (a chunk of whole regions
costs one op a region: few blocks a chunk there means more launches, not more bytes).

Pure torch: the same code runs on CUDA, XPU and CPU tensors (the unit tests run it on CPU
against the straightforward per-region loop).
"""

from __future__ import annotations


def spans(rows: tuple[int, int], n: int):
    """(region, first block, end block) of each region that rows ``rows`` of a run of ``n``
    blocks touch (row r * n + b)."""
    lo, hi = rows
    for r in range(lo // n, -(-hi // n)):
        yield r, max(lo - r * n, 0), min(hi - r * n, n)


def pieces(rows: tuple[int, int], n: int, stacked: bool):
    """The ops of a chunk: (first region, end region, first block, end block) each, whole
    regions merged into one piece when ``stacked`` (one view spans them). Counted, not
    walked region by region where they merge: a 64 MiB chunk of 2 MiB blocks spans 32
    regions, and a Python loop over them cost ~100 µs of each chunk's launch (2 x H100)."""
    if not stacked:
        return [(r, r + 1, b0, b1) for r, b0, b1 in spans(rows, n)]
    (r0, b0), (r1, b1) = divmod(rows[0], n), divmod(rows[1], n)
    if r0 == r1:  # within one region
        return [(r0, r0 + 1, b0, b1)] if b0 < b1 else []
    out = []
    if b0:  # the partial region it starts in
        out.append((r0, r0 + 1, b0, n))
        r0 += 1
    if r1 > r0:  # the whole ones: one op
        out.append((r0, r1, 0, n))
    if b1:  # the partial region it ends in
        out.append((r1, r1 + 1, 0, b1))
    return out


def copy_rows(regions: list, stacked, run, ids, rows: tuple[int, int], gather: bool) -> int:
    """Rows ``rows`` between the cache and ``run`` (``[regions][n][...]``, contiguous):
    ``gather`` True copies cache blocks ``ids`` into the run, False the run into them.
    ``regions``: each region's ``[blocks][...]`` view; ``stacked``: all of them as one
    ``[regions][blocks][...]`` view, or None (per_layer). ``ids``: the blocks, an int64 tensor
    on the cache's device. Ops are queued on the current stream; returns how many."""
    import torch

    n = run.shape[1]
    ops = 0
    for r0, r1, b0, b1 in pieces(rows, n, stacked is not None):
        if r1 - r0 > 1:  # whole regions: one op along the block dimension of all of them
            cache, part, idx, dim = stacked[r0:r1], run[r0:r1], ids, 1
        else:
            cache, part, idx, dim = regions[r0], run[r0, b0:b1], ids[b0:b1], 0
        if gather:
            torch.index_select(cache, dim, idx, out=part)
        else:
            cache.index_copy_(dim, idx, part)
        ops += 1
    return ops
