"""Layouts and plans: exact bytes, no overlap, one descriptor per contiguous run."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvruntime.errors import LayoutError, PlanError
from kvruntime.layout import CROSS_LAYER, PER_LAYER, KVLayout, layout_differences
from kvruntime.plan import coalesce, make_plan


def lay(kind, blocks=32, layers=3):
    return KVLayout(kind, layers, blocks, 16, 2, 8, "float16")


def test_sizes_per_layer_and_cross_layer():
    pl, cl = lay(PER_LAYER), lay(CROSS_LAYER)
    assert pl.page_bytes == 16 * 2 * 8 * 2 == 512
    assert pl.num_regions == 6 and cl.num_regions == 1
    assert pl.region_bytes == 32 * 512 and cl.region_bytes == 32 * 6 * 512
    assert pl.total_bytes == cl.total_bytes
    assert cl.block_extents(3) == [(0, 3 * 3072, 3072)]
    assert pl.block_extents(3)[5] == (5, 3 * 512, 512)


@pytest.mark.parametrize("bad", [dict(kind="paged"), dict(dtype="float64"), dict(num_layers=0),
                                 dict(head_dim=-1), dict(num_blocks=True)])
def test_bad_layout_refused(bad):
    args = dict(kind=CROSS_LAYER, num_layers=2, num_blocks=4, tokens_per_block=16,
                num_kv_heads=2, head_dim=8)
    args.update(bad)
    with pytest.raises(LayoutError):
        KVLayout(**args)


def test_from_dict_refuses_unknown_and_missing():
    d = lay(CROSS_LAYER).to_dict()
    assert KVLayout.from_dict(d) == lay(CROSS_LAYER)
    with pytest.raises(LayoutError, match="unknown layout field"):
        KVLayout.from_dict({**d, "evil": 1})
    d.pop("head_dim")
    with pytest.raises(LayoutError, match="incomplete"):
        KVLayout.from_dict(d)


def test_differences_name_every_field():
    a = KVLayout(CROSS_LAYER, 2, 8, 16, 2, 8, "float16", tp_size=1)
    b = KVLayout(PER_LAYER, 3, 99, 32, 4, 16, "bfloat16", tp_size=2)
    fields = [d.split(":")[0] for d in layout_differences(a, b)]
    assert fields == ["kind", "dtype", "tokens_per_block", "num_kv_heads", "head_dim",
                      "num_layers", "tp_size"]  # num_blocks may differ


def test_coalesce_exact_runs():
    runs = coalesce([1, 2, 3, 7, 8, 4], [10, 11, 12, 13, 14, 0])
    assert [(r.src, r.dst, r.count) for r in runs] == [(1, 10, 3), (7, 13, 2), (4, 0, 1)]


def test_plan_descriptor_counts():
    src = [0, 1, 2, 5, 9, 10]
    assert make_plan(lay(CROSS_LAYER), src).descriptor_count == 3
    assert make_plan(lay(PER_LAYER), src).descriptor_count == 3 * 6


@pytest.mark.parametrize("src,dst,msg", [
    ([0, 32], None, "outside 0..31"), ([-1], None, "outside"), ([1, 1], None, "twice"),
    ([1, 2], [3], "2 source blocks but 1"), ([], None, "at least one"), ([1.0], None, "integer"),
])
def test_bad_block_ids(src, dst, msg):
    with pytest.raises(PlanError, match=msg):
        make_plan(lay(CROSS_LAYER), src, None, dst)


def test_split_pieces_do_not_merge():
    plan = make_plan(lay(CROSS_LAYER), list(range(8)))
    s, d = (i.tolist() for i in plan.nixl_indices(split=3))
    assert sorted(s) == list(range(8)) and s == d
    merged = sum(1 for i in range(len(s)) if i == 0 or s[i] != s[i - 1] + 1)
    assert merged == plan.piece_count(3) == 3


@st.composite
def requests(draw):
    kind = draw(st.sampled_from([CROSS_LAYER, PER_LAYER]))
    src_blocks = draw(st.integers(1, 64))
    dst_blocks = draw(st.integers(1, 64))
    n = draw(st.integers(1, min(src_blocks, dst_blocks)))
    src = draw(st.permutations(range(src_blocks)))[:n]
    dst = draw(st.permutations(range(dst_blocks)))[:n]
    if draw(st.booleans()):
        src = sorted(src)
        dst = sorted(dst)
    layers = draw(st.integers(1, 4))
    return (KVLayout(kind, layers, src_blocks, 4, 1, 8), src,
            KVLayout(kind, layers, dst_blocks, 4, 1, 8), dst)


@settings(max_examples=300, deadline=None)
@given(requests(), st.integers(1, 4))
def test_plan_properties(req, split):
    src_l, src, dst_l, dst = req
    plan = make_plan(src_l, src, dst_l, dst)
    descs = plan.descriptors()
    # exactly the requested bytes
    assert sum(d.length for d in descs) == len(src) * src_l.block_bytes == plan.nbytes
    # the byte ranges cover exactly the requested blocks, on both sides, with no overlap
    for side, layout, ids in (("src", src_l, src), ("dst", dst_l, dst)):
        covered = []
        for d in descs:
            region, off = getattr(d, f"{side}_region"), getattr(d, f"{side}_offset")
            covered.append((region, off, off + d.length))
        covered.sort()
        for a, b in zip(covered, covered[1:]):
            assert a[0] != b[0] or a[2] <= b[1], "overlap"
        want = sorted((r, o, o + n) for b in ids for (r, o, n) in layout.block_extents(b))
        got_bytes = sum(e - s for _, s, e in covered)
        assert got_bytes == sum(e - s for _, s, e in want)
        for r, s, e in want:
            assert any(cr == r and cs <= s and e <= ce for cr, cs, ce in covered)
    # run count: one run per break in (src, dst) contiguity
    breaks = sum(1 for i in range(1, len(src))
                 if not (src[i] == src[i - 1] + 1 and dst[i] == dst[i - 1] + 1))
    assert len(plan.runs) == breaks + 1
    assert plan.descriptor_count == len(plan.runs) * src_l.num_regions
    # NIXL indices name exactly the requested blocks, pairwise, in every region
    s_idx, d_idx = (i.tolist() for i in plan.nixl_indices(split))
    assert len(s_idx) == len(src) * src_l.num_regions
    pairs = {(i % src_l.num_blocks, j % dst_l.num_blocks) for i, j in zip(s_idx, d_idx)}
    assert pairs == set(zip(src, dst))
    assert all(i // src_l.num_blocks == j // dst_l.num_blocks for i, j in zip(s_idx, d_idx))


def test_integer_like_ids_are_ids_and_bools_or_floats_are_not():
    import numpy as np

    layout = KVLayout("cross_layer", 2, 10, 16, 4, 32, "float16")
    assert make_plan(layout, [np.int64(1), np.int32(2), 3]).runs == ((1, 1, 3),)
    assert make_plan(layout, np.array([4, 5]), layout, np.array([0, 1], np.uint16)).runs == \
        ((4, 0, 2),)
    for bad in ([True], [1.0], np.array([1.5]), ["1"], np.array([True])):
        with pytest.raises(PlanError, match="integer"):
            make_plan(layout, bad)


def test_block_ids_and_vectorized_indices_follow_the_request_order():
    layout = KVLayout("per_layer", 2, 20, 16, 4, 32, "float16")
    plan = make_plan(layout, [5, 6, 2, 9], layout, [0, 1, 7, 3])
    src, dst = plan.block_ids()
    assert src.tolist() == [5, 6, 2, 9] and dst.tolist() == [0, 1, 7, 3]
    s_idx, d_idx = (i.tolist() for i in plan.nixl_indices())
    # run by run, region by region within a run (4 regions of 20 blocks)
    assert s_idx[:8] == [5, 6, 25, 26, 45, 46, 65, 66]
    assert d_idx[:8] == [0, 1, 20, 21, 40, 41, 60, 61]
    assert len(s_idx) == 4 * 4
