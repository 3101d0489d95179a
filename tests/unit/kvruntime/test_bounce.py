"""The bounce ring's cutting of a staged run into slot fills, and its gather/scatter moving real
bytes. The ring runs here on torch's CPU streams, which execute in order at once: the bytes and
the slot bookkeeping are the same code a GPU runs (the overlap itself is measured on the device,
BENCHMARKS.md); tests/integration/kvruntime/test_gpu.py runs the staged modes through it on CUDA."""

import random

import numpy as np
import pytest

from kvruntime.pools.bounce import BounceRing, Piece, pieces

torch = pytest.importorskip("torch")  # the ring and the pool's device path run on torch


@pytest.mark.parametrize("regions,blocks,row,slot", [
    (range(0, 8), 5, 4, 64),     # several whole regions per fill
    (range(2, 6), 7, 4, 12),     # regions split by blocks: 3 blocks a piece
    (range(0, 3), 4, 16, 8),     # a block row larger than a slot: one block a piece
    (range(0, 1), 1, 4, 4),
])
def test_fills_cover_the_run_in_order_and_fit_a_slot(regions, blocks, row, slot):
    fills = list(pieces(regions, blocks, row, slot))
    flat = [p for fill in fills for p in fill]
    assert flat[0].offset == regions.start * blocks * row
    for a, b in zip(flat, flat[1:]):
        assert b.offset == a.offset + a.words  # one contiguous range of the run, in order
    assert sum(p.words for p in flat) == len(regions) * blocks * row
    for fill in fills:
        assert sum(p.words for p in fill) <= max(slot, row)
    covered = {(p.region, b) for p in flat for b in range(p.b0, p.b1)}
    assert covered == {(r, b) for r in regions for b in range(blocks)}


def _cache(nb=9, regions=4, t=3, h=4, w=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    whole = torch.randint(-2**62, 2**62, (nb, regions, t, h, w), dtype=torch.int64, generator=g)
    return whole, [whole[:, r] for r in range(regions)]


@pytest.mark.parametrize("heads", [(0, 4), (1, 3)])
@pytest.mark.parametrize("slot_rows", [1, 2, 5, 40])
def test_gather_then_scatter_round_trips(heads, slot_rows):
    whole, regions = _cache()
    h0, h1 = heads
    views = [v[:, :, h0:h1, :] for v in regions]
    row = 3 * (h1 - h0) * 2
    ring = BounceRing(torch.device("cpu"), torch.int64, slot_rows * row)
    blocks = random.Random(slot_rows).sample(range(9), 6)
    ids = np.array(blocks, dtype=np.int64)
    run = torch.zeros(4, 6, 3, h1 - h0, 2, dtype=torch.int64)
    fills = list(pieces(range(4), 6, row, ring.slot_words))
    ring.gather(fills, views, ids, run.view(-1), run.shape[2:]).synchronize()
    for r in range(4):  # region-major: region r's blocks in request order
        assert torch.equal(run[r], whole[blocks, r][:, :, h0:h1])

    target, tviews = _cache(seed=1)
    before = target.clone()
    dst = [v[:, :, h0:h1, :] for v in tviews]
    back = list(reversed(blocks))
    ring.scatter(
        fills[len(fills) // 2 :], run.view(-1), dst, np.array(back, dtype=np.int64), run.shape[2:]
    ).synchronize()
    done = {p.region for fill in fills[len(fills) // 2:] for p in fill}
    for r in range(4):
        for i, b in enumerate(back):
            p_regions = [
                p
                for fill in fills[len(fills) // 2 :]
                for p in fill
                if p.region == r and p.b0 <= i < p.b1
            ]
            want = run[r, i] if p_regions else before[b, r][:, h0:h1]
            assert torch.equal(target[b, r][:, h0:h1], want)
        assert torch.equal(target[:, r][:, :, :h0], before[:, r][:, :, :h0])  # other heads kept
        assert torch.equal(target[:, r][:, :, h1:], before[:, r][:, :, h1:])
    untouched = sorted(set(range(9)) - set(back))
    assert torch.equal(target[untouched], before[untouched])
    assert done  # the scattered fills named at least one region


def test_fills_are_cut_as_the_ring_takes_them():
    """The ring queues a slot's copies before the next fill is cut (a generator, not a list
    made up front): on a GPU the host's cutting overlaps the device's copies."""
    fills = pieces(range(0, 4), 8, 4, 16)
    assert next(fills) == [Piece(0, 0, 4, 0, 16)]
    assert next(fills) == [Piece(0, 4, 8, 16, 16)]
