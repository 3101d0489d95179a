"""The vectorized planner against a plain Python reference of the same rules, and its
refusals: every bad request fails with one clear line before anything moves."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvruntime import native
from kvruntime.errors import PlanError
from kvruntime.layout import CROSS_LAYER, PER_LAYER, KVLayout
from kvruntime.plan import Planner, make_plan, merge_plans


# -- the reference: one Python step per id, the rules as DESIGN §4 states them ---------------
def reference_check(name, ids, num_blocks):
    seen = set()
    for b in ids:
        if not 0 <= b < num_blocks:
            return f"{name} block id {b} is outside 0..{num_blocks - 1}"
    for b in ids:
        if b in seen:
            return f"{name} block id {b} appears twice in one request"
        seen.add(b)
    return None


def reference_runs(src, dst):
    runs = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


def reference_split(count, parts):
    parts = max(1, min(parts, count))
    base, extra = divmod(count, parts)
    out, off = [], 0
    for i in range(parts):
        n = base + (1 if i < extra else 0)
        out.append((off, n))
        off += n
    return out


def reference_indices(runs, regions, ns, nd, split):
    src_idx, dst_idx = [], []
    for rs, rd, count in runs:
        pieces = reference_split(count, split)
        for region in range(regions):
            for off, cnt in reversed(pieces):
                src_idx.extend(range(region * ns + rs + off, region * ns + rs + off + cnt))
                dst_idx.extend(range(region * nd + rd + off, region * nd + rd + off + cnt))
    return src_idx, dst_idx


@pytest.fixture(scope="module", autouse=True, params=["native", "array"])
def id_reader(request):
    """Every test here twice: lists read and split into runs natively (native.py), and by
    array('q') and numpy as on a host without a C compiler; the plans and the refusals must be
    the same."""
    if request.param == "native" and native.id_scan() is None:
        pytest.skip(f"native id reader: {native.status()}")
    with pytest.MonkeyPatch.context() as mp:
        if request.param == "array":
            mp.setattr(native, "_state", {**dict.fromkeys(native.FUNCTIONS), "how": "off (test)"})
        yield request.param


def lay(kind, blocks, layers=2):
    return KVLayout(kind, layers, blocks, 4, 1, 8)


@st.composite
def requests(draw):
    """Ids that may be out of range, negative or repeated (about half the requests are bad)."""
    kind = draw(st.sampled_from([CROSS_LAYER, PER_LAYER]))
    ns, nd = draw(st.integers(1, 48)), draw(st.integers(1, 48))
    n = draw(st.integers(1, 40))
    ids = st.integers(-3, 52)
    if draw(st.booleans()):  # mostly valid: distinct in-range ids, some runs
        n = min(n, ns, nd)
        src = draw(st.permutations(range(ns)))[:n]
        dst = draw(st.permutations(range(nd)))[:n]
        if draw(st.booleans()):
            src, dst = sorted(src), sorted(dst)
    else:
        src = draw(st.lists(ids, min_size=n, max_size=n))
        dst = draw(st.lists(ids, min_size=n, max_size=n))
    return kind, ns, nd, src, dst


@settings(max_examples=400, deadline=None)
@given(requests(), st.integers(1, 5), st.sampled_from(["list", "numpy", "int32"]))
def test_matches_the_reference(req, split, form):
    kind, ns, nd, src, dst = req
    src_l, dst_l = lay(kind, ns), lay(kind, nd)
    as_form = {"list": list, "numpy": np.array,
               "int32": lambda v: np.array(v, dtype=np.int32)}[form]
    want_error = reference_check("source", src, ns) or reference_check("destination", dst, nd)
    if want_error:
        with pytest.raises(PlanError) as info:
            make_plan(src_l, as_form(src), dst_l, as_form(dst))
        assert str(info.value) == want_error
        return
    plan = make_plan(src_l, as_form(src), dst_l, as_form(dst))
    runs = reference_runs(src, dst)
    assert list(plan.runs) == runs
    assert plan.num_blocks == len(src) and plan.nbytes == len(src) * src_l.block_bytes
    assert [a.tolist() for a in plan.block_ids()] == [src, dst]
    s_idx, d_idx = plan.nixl_indices(split)
    assert s_idx.dtype == d_idx.dtype == np.int32
    want = reference_indices(runs, src_l.num_regions, ns, nd, split)
    assert (s_idx.tolist(), d_idx.tolist()) == want
    assert plan.piece_count(split) == sum(
        len(reference_split(c, split)) for _s, _d, c in runs) * src_l.num_regions


def test_large_requests_match_the_reference():
    rng = np.random.default_rng(3)
    layout = lay(PER_LAYER, 8192, layers=3)
    for ids in (rng.permutation(8192)[:4096], np.arange(100, 4196),
                np.concatenate([np.arange(0, 2000), rng.permutation(np.arange(4000, 8192))])):
        dst = rng.permutation(8192)[:len(ids)] if ids[1] != ids[0] + 1 else ids
        plan = make_plan(layout, ids, layout, dst)
        runs = reference_runs(ids.tolist(), dst.tolist())
        assert list(plan.runs) == runs
        got = [a.tolist() for a in plan.nixl_indices(4)]
        assert tuple(got) == reference_indices(runs, layout.num_regions, 8192, 8192, 4)


LAYOUT = KVLayout(CROSS_LAYER, 2, 10, 16, 4, 32, "float16")


@pytest.mark.parametrize("src,dst,line", [
    (np.array([3, 10]), None, "source block id 10 is outside 0..9"),
    (np.array([-1, 2]), None, "source block id -1 is outside 0..9"),
    (np.array([4, 7, 4, 7]), None, "source block id 4 appears twice in one request"),
    ([1, 2], np.array([5, 5]), "destination block id 5 appears twice in one request"),
    ([1, 2], np.array([0, 11], np.uint8), "destination block id 11 is outside 0..9"),
    (np.array([2 ** 64 - 1], np.uint64), None,
     "source block id 18446744073709551615 is outside the range of block ids"),
    (np.array([1.0, 2.0]), None, "source block ids must be integers, got an array of float64"),
    (np.array([True]), None, "source block ids must be integers, got an array of bool"),
    ([1, "2"], None, "source block ids must be integers, got ids read as <U21"),
    ([1, None], None, "source block ids must be integers, got ids read as object"),
    (np.zeros(0, np.int64), None, "a request must name at least one block"),
    ([1, 2, 3], [4, 5], "3 source blocks but 2 destination blocks"),
    # lists of plain ints, consecutive or not (the native reader's one-run and general paths)
    (list(range(8, 11)), None, "source block id 10 is outside 0..9"),
    ([-1, 0], None, "source block id -1 is outside 0..9"),
    ([1, 2], [9, 10], "destination block id 10 is outside 0..9"),
    ([5, 3, 5], [0, 1, 2], "source block id 5 appears twice in one request"),
    ([1, 2], [2 ** 63 - 1, 0], "destination block id 9223372036854775807 is outside 0..9"),
    ([1, 2.5], None, "source block ids must be integers, got ids read as float64"),
    ([], [], "a request must name at least one block"),
])
def test_bad_ids_refused_with_one_line(src, dst, line):
    with pytest.raises(PlanError) as info:
        make_plan(LAYOUT, src, None, dst)
    assert str(info.value) == line
    assert "\n" not in str(info.value)


def test_consecutive_lists_are_one_run_and_keep_their_ids():
    plan = make_plan(LAYOUT, [2, 3, 4], None, [7, 8, 9])
    assert plan.runs == ((2, 7, 3),) and plan.num_runs == 1
    assert [a.tolist() for a in plan.block_ids()] == [[2, 3, 4], [7, 8, 9]]
    same = make_plan(LAYOUT, [4, 5])
    assert same.runs == ((4, 4, 2),) and same.block_ids()[1].tolist() == [4, 5]
    bools = make_plan(LAYOUT, [3, True])  # read as numpy reads it: 3, 1
    assert bools.block_ids()[0].tolist() == [3, 1]


def test_torch_tensors_are_ids():
    torch = pytest.importorskip("torch")
    plan = make_plan(
        LAYOUT, torch.tensor([7, 8, 9]), LAYOUT, torch.tensor([0, 1, 2], dtype=torch.int32)
    )
    assert plan.runs == ((7, 0, 3),)
    with pytest.raises(PlanError, match="must be integers"):
        make_plan(LAYOUT, torch.tensor([1.0]))


def test_the_plan_keeps_its_own_ids():
    ids = np.array([1, 2, 3])
    plan = make_plan(LAYOUT, ids)
    ids[:] = 0  # an engine reusing its buffer while the request runs
    assert plan.block_ids()[0].tolist() == [1, 2, 3]


def test_merge_refuses_a_destination_named_twice():
    a, b = make_plan(LAYOUT, [1, 2], LAYOUT, [3, 4]), make_plan(LAYOUT, [5], LAYOUT, [4])
    with pytest.raises(PlanError, match="destination block id 4 appears twice"):
        merge_plans([a, b])
    merged = merge_plans([a, make_plan(LAYOUT, [3], LAYOUT, [5])])
    assert [x.tolist() for x in merged.block_ids()] == [[1, 2, 3], [3, 4, 5]]


# -- a batch planned at once (start_pulls) ---------------------------------------------------
@st.composite
def batches(draw):
    """A few requests on one pair of caches: mostly good, some with a bad id, a block read or
    written twice within a request, a destination shared by two requests, an empty or uneven
    one; the destination sometimes left out (the same ids on both sides)."""
    kind = draw(st.sampled_from([CROSS_LAYER, PER_LAYER]))
    ns, nd = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    free = draw(st.permutations(range(nd)))
    out = []
    for _ in range(draw(st.integers(1, 5))):
        n = draw(st.integers(1, 8))
        unique = draw(st.booleans())
        src = draw(st.lists(st.integers(0, ns - 1), min_size=min(n, ns) if unique else n,
                            max_size=min(n, ns) if unique else n, unique=unique))
        if draw(st.booleans()) and len(free) >= n:  # distinct destinations, batch-wide
            dst, free = list(free[:n]), free[n:]
        else:
            dst = draw(st.lists(st.integers(-2, nd + 1), min_size=0, max_size=n + 1))
        if draw(st.integers(0, 5)) == 0:
            dst = None
        out.append((src, dst))
    return kind, ns, nd, out


@settings(max_examples=400, deadline=None)
@given(batches())
def test_a_batch_is_planned_as_its_requests_one_by_one(batch):
    """plan_many gives each request the plan ``plan`` gives it, and one plan of them all, or
    the error that planning them one by one and merging gives."""
    kind, ns, nd, reqs = batch
    planner = Planner(lay(kind, ns), lay(kind, nd))
    try:
        want = [planner.plan(src, dst) for src, dst in reqs]
        merge_plans(want)
    except PlanError as exc:
        with pytest.raises(PlanError) as got:
            planner.plan_many(reqs)
        assert str(got.value) == str(exc)
        return
    plans, merged = planner.plan_many(reqs)
    assert len(plans) == len(want)
    for got, w in zip(plans, want):
        assert [a.tolist() for a in got.block_ids()] == [a.tolist() for a in w.block_ids()]
        assert got.runs == w.runs and got.descriptor_count == w.descriptor_count
        assert (got.num_blocks, got.num_runs, got.nbytes) == (w.num_blocks, w.num_runs, w.nbytes)
    assert [a.tolist() for a in merged.block_ids()] == [
        np.concatenate([p.block_ids()[i] for p in want]).tolist() for i in (0, 1)]
    assert merged.runs == tuple(r for p in want for r in p.runs)  # no run spans two requests


def test_a_batch_mixing_integer_arrays_keeps_its_ids_exact():
    big = 2**53 + 1  # not a float64; refused as out of range, by its own value
    _plans, merged = Planner(LAYOUT).plan_many([
        (np.array([1, 2], np.uint64), np.array([3, 4], np.int32)),
        ([7], np.array([9], np.int16))])
    assert merged.block_ids()[0].dtype == np.int64
    assert [a.tolist() for a in merged.block_ids()] == [[1, 2, 7], [3, 4, 9]]
    with pytest.raises(PlanError, match=f"source block id {big} is outside"):
        Planner(LAYOUT).plan_many(
            [(np.array([big], np.uint64), [1]), (np.array([2], np.int64), [3])]
        )


def test_a_batch_whose_later_list_is_not_all_ints_is_refused_as_plan_refuses_it():
    """The native reader fills one array request by request and gives up at the first item
    that is not a plain int: the batch is then read again its general way."""
    reqs = [([1, 2], [3, 4]), ([5, 6.0], [7, 8])]
    with pytest.raises(PlanError) as want:
        Planner(LAYOUT).plan(*reqs[1])
    with pytest.raises(PlanError) as got:
        Planner(LAYOUT).plan_many(reqs)
    assert str(got.value) == str(want.value)
    plans, _ = Planner(LAYOUT).plan_many([([1, 2], [3, 4]), ([np.int64(5), 6], None)])
    assert [p.block_ids()[1].tolist() for p in plans] == [[3, 4], [5, 6]]


def test_two_requests_may_read_one_block_but_not_write_one():
    planner = Planner(LAYOUT)
    plans, merged = planner.plan_many([([1, 2], [3, 4]), ([2], [5])])
    assert [p.runs for p in plans] == [((1, 3, 2),), ((2, 5, 1),)]
    with pytest.raises(PlanError, match="destination block id 4 appears twice"):
        planner.plan_many([([1, 2], [3, 4]), ([5], [4])])
    with pytest.raises(PlanError, match="a batch must hold at least one request"):
        planner.plan_many([])


# -- a request named by its runs (what a push sends when that is shorter than its ids) -------
@settings(max_examples=300, deadline=None)
@given(requests())
def test_a_plan_from_its_runs_is_the_plan_from_its_ids(req):
    """Good requests give the same ids and runs either way; what ``plan`` refuses, the runs
    of it (where they can be formed) are refused too."""
    kind, ns, nd, src, dst = req
    planner = Planner(lay(kind, ns), lay(kind, nd))
    try:
        want = planner.plan(src, dst)
    except PlanError:
        runs = np.array(reference_runs(src, dst), dtype=np.int64).reshape(-1, 3).T
        if len(src) == len(dst) and len(runs[0]):
            with pytest.raises(PlanError):
                planner.plan_runs(*runs)
        return
    got = planner.plan_runs(want.run_src, want.run_dst, want.run_count)
    assert [a.tolist() for a in got.block_ids()] == [a.tolist() for a in want.block_ids()]
    assert got.runs == want.runs
    # one run comes back as a OneRun, its arrays made when read: every view of it agrees
    assert [a.tolist() for a in (got.run_src, got.run_dst, got.run_count)] == \
        [a.tolist() for a in (want.run_src, want.run_dst, want.run_count)]
    assert (got.num_blocks, got.num_runs, got.nbytes, got.descriptors()) == \
        (want.num_blocks, want.num_runs, want.nbytes, want.descriptors())
    for split in (1, 3):
        assert [a.tolist() for a in got.nixl_indices(split)] == \
            [a.tolist() for a in want.nixl_indices(split)]


def test_runs_split_where_both_sides_go_on_are_one_run():
    got = Planner(LAYOUT).plan_runs(np.array([2, 4]), np.array([5, 7]), np.array([2, 1]))
    assert got.runs == ((2, 5, 3),)


@pytest.mark.parametrize(
    "runs,line",
    [
        (([], [], []), "a request must name at least one block"),
        (([1], [1, 2], [1]), "1 run counts but 1 source and 2 destination starts"),
        (([1], [1], [0]), "run 0 names 0 blocks; a run names at least one"),
        (([1, 2], [3, 4], [1, -5]), "run 1 names -5 blocks; a run names at least one"),
        (([8], [0], [3]), "source run of 3 blocks at 8 reaches outside 0..9"),
        (([-1], [0], [1]), "source run of 1 blocks at -1 reaches outside 0..9"),
        (
            ([0], [2**62], [1]),
            "destination run of 1 blocks at 4611686018427387904 reaches outside 0..9",
        ),
        (([0], [0], [2**62]), "source run of 4611686018427387904 blocks at 0 reaches outside 0..9"),
        (([0, 3], [0, 5], [4, 1]), "source block id 3 appears twice in one request"),
        (([0, 6], [2, 0], [3, 3]), "destination block id 2 appears twice in one request"),
    ],
)
def test_bad_runs_refused_with_one_line_before_any_ids_are_made(runs, line):
    with pytest.raises(PlanError) as info:
        Planner(LAYOUT).plan_runs(*(np.array(a, dtype=np.int64) for a in runs))
    assert str(info.value) == line
