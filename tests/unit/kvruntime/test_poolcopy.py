"""A device pool's gather and scatter (poolcopy.py through StagingPool._device_copy), run on
CPU tensors: the torch ops are the ones a GPU runs, on torch's CPU streams, which execute in
order at once (the speed is measured on the device: ci/gpu-coalesce.sh). Checked against the
straightforward loop of one op per (region, chunk) on random layouts of both kinds, head
slices, block lists and chunk ranges, and against the pool's own host copy (C copies by
address, native.py) for whole requests."""

import random

import numpy as np
import pytest

from kvruntime.layout import CROSS_LAYER, PER_LAYER, KVLayout
from kvruntime.memory import KVCache
from kvruntime.pools.bounce import _TorchStreams
from kvruntime.pools.poolcopy import copy_rows, pieces, spans
from kvruntime.pools.staging import StagingPool

torch = pytest.importorskip("torch")  # the ring and the pool's device path run on torch


def _pool(kind, seed, blocks=None):
    """A cache of ``kind`` of random bytes in CPU tensors and a pool whose copies go through
    the device path (_device_copy) on torch's CPU streams."""
    rng = random.Random(seed)
    lay = KVLayout(kind, rng.randint(1, 4), rng.randint(4, 12), rng.choice([1, 2, 3]),
                   rng.choice([1, 2, 4]), rng.choice([2, 4, 8]), rng.choice(["float16", "int8"]))
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randint(0, 256, (lay.region_bytes,), dtype=torch.uint8, generator=g)
               for _ in range(lay.num_regions)]
    cache = KVCache.from_tensors(lay, tensors)
    pool = StagingPool(lay, blocks or lay.num_blocks, cache)
    pool._streams = _TorchStreams(torch.device("cpu"))
    return lay, tensors, pool, rng


def _reference(pool, ids, start, heads, rows, gather):
    """One op per (region, chunk): what _device_copy did before poolcopy."""
    n, hs = len(ids), heads[1] - heads[0]
    views, run = pool._regions(heads), pool._run(start, n, hs)
    idx = torch.from_numpy(ids)
    for r, b0, b1 in spans(rows, n):
        if gather:
            run[r, b0:b1] = views[r][idx[b0:b1]]
        else:
            views[r].index_copy_(0, idx[b0:b1], run[r, b0:b1])


def _chunks(total, rng):
    cuts = sorted(rng.sample(range(1, total), min(total - 1, rng.randint(0, 4))))
    return list(zip([0] + cuts, cuts + [total]))


@pytest.mark.parametrize("kind", [CROSS_LAYER, PER_LAYER])
@pytest.mark.parametrize("seed", range(12))
def test_gather_and_scatter_match_the_per_region_loop(kind, seed):
    lay, tensors, pool, rng = _pool(kind, seed)
    h = lay.num_kv_heads
    h0 = rng.randrange(h)
    heads = rng.choice([(0, h), (h0, rng.randint(h0 + 1, h))])
    n = rng.randint(1, lay.num_blocks)
    ids = np.array(rng.sample(range(lay.num_blocks), n), dtype=np.int64)
    hs = heads[1] - heads[0]
    start = rng.randint(0, pool.units - n * hs)
    chunks = _chunks(2 * lay.num_layers * n, rng)
    pool_bytes = pool._pool

    pool_bytes.fill_(7)
    for rows in chunks:
        pool.gather(ids, start, heads, rows)
    got = pool_bytes.clone()
    pool_bytes.fill_(7)
    for rows in chunks:
        _reference(pool, ids, start, heads, rows, True)
    assert torch.equal(got, pool_bytes)  # and nothing outside the run written

    # scatter the run into other blocks (reversed order), chunk by chunk
    back = np.array(rng.sample(range(lay.num_blocks), n), dtype=np.int64)
    before = [t.clone() for t in tensors]
    for rows in chunks:
        pool.scatter_async(start, back, heads, rows).synchronize()
    got = [t.clone() for t in tensors]
    for t, b in zip(tensors, before):
        t.copy_(b)
    for rows in chunks:
        _reference(pool, back, start, heads, rows, False)
    for a, b in zip(got, tensors):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(got, before))


@pytest.mark.parametrize("kind", [CROSS_LAYER, PER_LAYER])
def test_a_whole_request_matches_the_host_copy(kind):
    """All heads, the run gathered in chunks by the device path, equal to the pool's C copy by
    addresses (an independent implementation), then scattered back bit-exact."""
    lay, tensors, pool, rng = _pool(kind, 99)
    n = lay.num_blocks // 2
    ids = np.array(rng.sample(range(lay.num_blocks), n), dtype=np.int64)
    heads = (0, lay.num_kv_heads)
    rows = (0, 2 * lay.num_layers * n)
    for chunk in _chunks(rows[1], rng):
        pool.gather(ids, 0, heads, chunk)
    device_path = pool._pool.clone()
    pool._pool.zero_()
    pool._host.copy(ids, 0, heads, rows, True)
    assert torch.equal(device_path, pool._pool)
    before = [t.clone() for t in tensors]
    for t in tensors:
        t.zero_()
    pool.scatter_async(0, ids, heads, rows).synchronize()
    idx = torch.from_numpy(ids)
    others = sorted(set(range(lay.num_blocks)) - set(ids.tolist()))
    for t, b in zip(tensors, before):
        assert torch.equal(t.view(lay.num_blocks, -1)[idx], b.view(lay.num_blocks, -1)[idx])
        assert not t.view(lay.num_blocks, -1)[others].any()


@pytest.mark.parametrize("rows,n,stacked,want", [
    ((0, 12), 4, True, [(0, 3, 0, 4)]),                              # whole regions: one op
    ((2, 14), 4, True, [(0, 1, 2, 4), (1, 3, 0, 4), (3, 4, 0, 2)]),  # partial ends
    ((2, 14), 4, False, [(0, 1, 2, 4), (1, 2, 0, 4), (2, 3, 0, 4), (3, 4, 0, 2)]),
    ((5, 7), 4, True, [(1, 2, 1, 3)]),
    ((3, 5), 4, True, [(0, 1, 3, 4), (1, 2, 0, 1)]),
])
def test_a_chunk_is_at_most_three_ops_where_one_view_spans_the_regions(rows, n, stacked, want):
    assert pieces(rows, n, stacked) == want


def test_counted_pieces_cover_exactly_the_rows_a_region_walk_finds():
    """The counted pieces (no loop over regions) against the plain walk of every region the
    rows touch (spans): the same rows, in order, whole regions merged, at most three ops."""
    rnd = random.Random(5)
    for _ in range(2000):
        n = rnd.randint(1, 9)
        total = n * rnd.randint(1, 12)
        lo = rnd.randrange(total)
        hi = rnd.randint(lo + 1, total)
        got = pieces((lo, hi), n, True)
        walked = [r * n + b for r, b0, b1 in spans((lo, hi), n) for b in range(b0, b1)]
        assert [r * n + b for r0, r1, b0, b1 in got for r in range(r0, r1)
                for b in range(b0, b1)] == walked
        assert len(got) <= 3 and all(b0 == 0 and b1 == n for r0, r1, b0, b1 in got
                                     if r1 - r0 > 1)


def test_ops_counted_and_ids_uploaded_once_a_request():
    """A chunk of many whole regions of a cross_layer cache is one op; the ids go up once for
    all of a request's chunks (and again when the blocks differ)."""
    lay = KVLayout(CROSS_LAYER, 16, 8, 2, 2, 4)
    tensors = [torch.arange(lay.region_bytes, dtype=torch.int64).to(torch.uint8)]
    pool = StagingPool(lay, 8, KVCache.from_tensors(lay, tensors))
    streams = pool._streams = _TorchStreams(torch.device("cpu"))
    uploads = []
    real = streams.upload
    streams.upload = lambda ids: uploads.append(1) or real(ids)
    ids = np.array([5, 1, 3], dtype=np.int64)
    views, stacked = pool._regions((0, 2)), pool._stacked((0, 2))
    run = pool._run(0, 3, 2)
    assert copy_rows(views, stacked, run, torch.from_numpy(ids), (0, 32 * 3), True) == 1
    assert copy_rows(views, None, run, torch.from_numpy(ids), (0, 32 * 3), True) == 32
    on_device = pool.ids(ids)  # once a request, as the prefill's gather and StagedPull do
    for chunk in ((0, 40), (40, 96)):
        pool.gather(on_device, 0, None, chunk)
    assert len(uploads) == 1
    pool.gather(np.array([5, 1, 2], dtype=np.int64), 0)  # host ids: uploaded for the call
    assert len(uploads) == 2
    got = pool._pool.clone()
    _reference(pool, np.array([5, 1, 2], dtype=np.int64), 0, (0, 2), (0, 96), True)
    assert torch.equal(got, pool._pool)
