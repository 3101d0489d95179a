"""A staging pool's copies where the cache and the pool are both host memory (staging.py): the
addresses of a run's rows in the cache, copied by one C call (native.py) or piece by piece;
gathers in the caller's call, scatters on a thread of their own unless short."""

from __future__ import annotations

import ctypes

from .. import native
from ..layout import CROSS_LAYER

# A host scatter of at most this many bytes runs in the poll that sees its chunk land instead
# of on the pool's scatter thread: the hand-off and the wake-up cost ~200 µs on the 2-core host
# under load (a 1-block coalesced pull: 1060 µs, of which 230 from the READ's end to the
# scatter's), more than copying this much (~60 µs at the ~4 GB/s of a scattered host copy).
INLINE_SCATTER_BYTES = 256 << 10


class HostCopies:
    """Rows of runs between a host cache ``device_cache`` of ``layout`` and a host pool whose
    run at unit ``start`` begins at ``run_base + start * unit_bytes``; ``row_bytes(hs)``: bytes
    of one row of a run of ``hs`` heads (the pool's)."""

    def __init__(self, device_cache, layout, *, run_base: int, unit_bytes: int, row_bytes):
        self.layout = layout
        self._bases, self._strides = _region_bases(device_cache)
        self._run_base = run_base
        self._unit_bytes = unit_bytes
        self._row_bytes = row_bytes
        self._scatters = None  # the scatter thread, started by the first long scatter

    def pieces(self, ids, heads: tuple[int, int], rows: tuple[int, int]):
        """A host cache's addresses of rows ``rows`` of a run of blocks ``ids``, heads
        ``heads``: one piece a row (all heads: a region of a block is contiguous), else one a
        token row of it. Returns (uint64 addresses, bytes a piece)."""
        import numpy as np

        lay = self.layout
        head = lay.head_dim * lay.element_bytes
        r, b = np.divmod(np.arange(rows[0], rows[1], dtype=np.int64), len(ids))
        at = (self._bases[r] + ids[b].astype(np.uint64) * self._strides[r]
              + np.uint64(heads[0] * head))
        hs = heads[1] - heads[0]
        if hs == lay.num_kv_heads:
            return at, lay.page_bytes
        row = np.uint64(lay.num_kv_heads * head)
        within = np.arange(lay.tokens_per_block, dtype=np.uint64) * row
        return (at[:, None] + within[None, :]).reshape(-1), hs * head

    def copy(self, ids, start: int, heads: tuple[int, int], rows: tuple[int, int],
             gather: bool) -> None:
        """Rows ``rows`` between a host cache and the run at ``start``: one C call (its
        copies without the GIL), or piece by piece through ctypes where native.py is off."""
        addresses, length = self.pieces(ids, heads, rows)
        hs = heads[1] - heads[0]
        run = self._run_base + start * self._unit_bytes + rows[0] * self._row_bytes(hs)
        copy = native.piece_copy()
        if copy is not None:
            copy(run, addresses, length) if gather else copy(addresses, run, length)
            return
        for i, at in enumerate(addresses.tolist()):
            there = run + i * length
            ctypes.memmove(there, at, length) if gather else ctypes.memmove(at, there, length)

    def scatter(self, ids, start: int, heads: tuple[int, int], rows: tuple[int, int]):
        """Queue rows ``rows`` of the run at ``start`` into the cache: a future (of the
        scatter thread, beside its caller's NIXL calls; or done in this call when short)."""
        if (rows[1] - rows[0]) * self._row_bytes(heads[1] - heads[0]) <= INLINE_SCATTER_BYTES:
            return self._scatter_now(ids, start, heads, rows)
        if self._scatters is None:
            from concurrent.futures import ThreadPoolExecutor

            self._scatters = ThreadPoolExecutor(1, thread_name_prefix="kvr-scatter")
        return self._scatters.submit(self.copy, ids, start, heads, rows, False)

    def _scatter_now(self, ids, start: int, heads: tuple[int, int], rows: tuple[int, int]):
        """A host scatter shorter than handing it to the scatter thread, done in this call;
        returned as that thread's would be (a future, its error kept for ``wait``)."""
        from concurrent.futures import Future

        future = Future()
        try:
            self.copy(ids, start, heads, rows, False)
        except Exception as exc:
            future.set_exception(exc)
        else:
            future.set_result(None)
        return future

    def close(self) -> None:
        if self._scatters is not None:
            self._scatters.shutdown(wait=True)
            self._scatters = None


def _region_bases(cache):
    """A host cache's per-region (address of block 0, bytes from one block to the next), as
    uint64 arrays indexed by region (K or V of one layer)."""
    import numpy as np

    lay = cache.layout
    regions = 2 * lay.num_layers
    if lay.kind == CROSS_LAYER:
        bases = [cache.regions[0].address + r * lay.page_bytes for r in range(regions)]
        stride = lay.block_bytes
    else:
        bases = [region.address for region in cache.regions]
        stride = lay.page_bytes
    return (np.array(bases, dtype=np.uint64), np.full(regions, stride, dtype=np.uint64))
