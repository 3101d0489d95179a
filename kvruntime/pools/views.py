"""Torch's views of a staging pool and of its device cache (staging.py's ``StagingPool``):
made on first use (device pools, the bounce ring, and the index ops' tests on CPU tensors), once
each; the index ops (poolcopy.py) and the bounce ring (bounce.py) copy through them. Host memory
on both sides never uses them (hostcopy.py: no torch there)."""

from __future__ import annotations

import ctypes
from functools import cached_property

from ..layout import CROSS_LAYER


class PoolViews:
    """What ``StagingPool`` sees its run and the cache's regions as (a part of it, its methods
    moved here as they were): needs the pool's ``cache``, ``device_cache``, ``layout``,
    ``device_layout`` and its ``_region_views`` and ``_stacked_views`` dicts."""

    # torch's views of the pool and the cache, made on first use (device pools, the bounce
    # ring, and the index ops' tests on CPU tensors), once: a request's prologue
    @cached_property
    def _pool(self):
        return _byte_regions(self.cache)[0]

    @cached_property
    def _device(self):
        return _byte_regions(self.device_cache)

    @cached_property
    def _pool_words(self):
        return self._words(self._pool)

    @cached_property
    def _head_words(self) -> int:
        lay = self.device_layout
        return lay.head_dim * lay.element_bytes // self._pool_words.element_size()

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
            views, stacked = self._views_of(self._device, lay, heads)
            self._region_views[heads] = views
            if stacked is not None:
                self._stacked_views[heads] = stacked
        return views

    def _views_of(self, regions: list, lay, heads: tuple[int, int]) -> tuple[list, object]:
        """``regions`` (flat byte tensors of a cache of layout ``lay``) as the index ops see
        them: per region [block][token][head][words] of heads ``heads``, and for cross_layer
        all of them as one [region][block]... view (poolcopy.py), else None."""
        nb, t, h = lay.num_blocks, lay.tokens_per_block, lay.num_kv_heads
        h0, h1 = heads
        if lay.kind == CROSS_LAYER:
            whole = self._words(regions[0][:lay.region_bytes])
            whole = whole.view(nb, 2 * lay.num_layers, t, h, -1)
            views = [whole[:, r] for r in range(2 * lay.num_layers)]
            stacked = whole.permute(1, 0, 2, 3, 4)[:, :, :, h0:h1, :]
        else:
            views = [self._words(r[:lay.region_bytes]).view(nb, t, h, -1) for r in regions]
            stacked = None
        if heads != (0, h):
            views = [v[:, :, h0:h1, :] for v in views]
        return views, stacked

    def _stacked(self, heads: tuple[int, int]):
        """A cross_layer cache's regions of heads ``heads`` as one [region][block][token][head]
        [words] view (its blocks hold every region); None for per_layer."""
        self._regions(heads)
        return self._stacked_views.get(heads)

    def _words(self, flat):
        """A byte range as the widest integers that divide a head's bytes: index ops then move
        8 bytes an element instead of 1 (H100: index_select + pinned copy 0.92 of a pinned copy
        as int64, 0.82 as bytes)."""
        import torch

        de = self.device_layout.head_dim * self.device_layout.element_bytes
        for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
            aligned = all(t.data_ptr() % size == 0 for t in (self._pool, *self._device))
            if de % size == 0 and aligned:
                return flat.view(dtype)
        return flat


def _byte_regions(cache) -> list:
    """Each region of ``cache`` as a flat uint8 torch tensor (device tensors, or host memory
    wrapped without a copy)."""
    import torch

    if cache.tensors is not None:
        return cache._byte_views()
    n = cache.layout.region_bytes
    return [torch.frombuffer((ctypes.c_uint8 * n).from_address(r.address), dtype=torch.uint8)
            for r in cache.regions]
