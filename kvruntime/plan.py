"""Transfer plans: which byte ranges move for a list of block ids.

Pure arithmetic. A request moves source blocks ``src[i]`` to destination blocks ``dst[i]``.
Consecutive pairs where both ids grow by one form a *run*; each run is one descriptor in the
``cross_layer`` layout and one descriptor per region in ``per_layer``. The same runs give the
NIXL descriptor indices: prepared lists hold one entry per (region, block), index
``region * num_blocks + block``, and NIXL merges consecutive indices of adjacent memory back into
one descriptor — so the number of descriptors NIXL posts equals the plan's count.

Everything per request is one pass of C over the ids (native.py: the lists read, then the runs
split and the ranges and duplicates checked) and a handful of numpy operations on whole arrays,
never a Python step per id or per run; where the C helper cannot be built, numpy does the same
split (the reference tests hold both to one result). The host cost of a request is what bounds
many small requests in flight: 4096 scattered ids are planned in ~37 µs on a 2-core VM.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple, Sequence

import numpy as np

from . import native
from .errors import PlanError
from .layout import KVLayout


class Run(NamedTuple):  # a tuple: an engine's request of scattered blocks makes thousands
    src: int
    dst: int
    count: int


@dataclass(frozen=True)
class Descriptor:
    """One contiguous copy: ``length`` bytes from (src_region, src_offset) to (dst_region, ...)."""

    src_region: int
    src_offset: int
    dst_region: int
    dst_offset: int
    length: int


def _read_ids(name: str, ids) -> np.ndarray:
    """Block ids as a 1-D integer array (not copied yet). What numpy reads as an integer array
    is ids: lists of ints (numpy and torch integer scalars included), integer numpy arrays,
    CPU torch tensors. Bools, floats, strings and anything else are refused (a list mixing
    bools into ints is read as numpy reads it: as 0 and 1)."""
    if type(ids) is list and ids and type(ids[0]) is not bool:
        # a list of plain ints (what engines pass) in one C pass (native.py) where it could be
        # built, else through array's C loop, which takes only what has __index__ (numpy's
        # reading first discovers the type, a second pass): 4096 ids 206 -> 152 µs on the
        # 2-core VM. Bools after an int are 0 and 1 either way; a list that starts with one
        # goes to numpy, which refuses an all-bool list.
        scan = native.id_scan()
        if scan is not None:
            out = np.empty(len(ids), dtype=np.int64)
            if scan(ids, out) is not None:
                return out
        try:
            return np.frombuffer(array("q", ids), dtype=np.int64)
        except (TypeError, OverflowError):
            pass  # not all ints: numpy reads it below and says what it is
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
        raise PlanError(f"{name} block ids are not a list of integers: {exc}") from None
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    if arr.size and arr.dtype.kind not in "iu":
        what = "an array of" if isinstance(ids, np.ndarray) else "ids read as"
        raise PlanError(f"{name} block ids must be integers, got {what} {arr.dtype}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise PlanError(f"{name} block id {int(arr.max())} is outside the range of block ids")
    return arr


def check_range(name: str, ids: np.ndarray, num_blocks: int) -> None:
    """Every id in 0..num_blocks-1, or PlanError naming the first that is not."""
    if len(ids) and (ids.min() < 0 or ids.max() >= num_blocks):
        bad = ids[(ids < 0) | (ids >= num_blocks)]
        raise PlanError(f"{name} block id {int(bad[0])} is outside 0..{num_blocks - 1}")


def _check_ids(name: str, ids: np.ndarray, num_blocks: int) -> None:
    """Every id in 0..num_blocks-1 and none twice, or PlanError naming the first bad one."""
    check_range(name, ids, num_blocks)
    order = np.argsort(ids, kind="stable")
    again = order[1:][ids[order[1:]] == ids[order[:-1]]]  # later copies, by position
    if len(again):
        raise PlanError(f"{name} block id {int(ids[again.min()])} appears twice in one request")


def _run_arrays(ids: np.ndarray, cuts: np.ndarray | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(starts in src, starts in dst, counts) of the runs of consecutive (src, dst) pairs of
    ``ids`` (2 x n: source ids, destination ids); ``cuts``: positions where a run must start
    whatever the ids (the first pair of each request of a batch)."""
    n = ids.shape[1]
    # (step of src - 1) | (step of dst - 1) is zero exactly where a run goes on (in place:
    # a few numpy calls whatever the length)
    steps = ids[:, 1:] - ids[:, :-1]
    steps -= 1
    breaks = steps[0] | steps[1]
    if cuts is not None:
        breaks[cuts - 1] = 1
    starts = breaks.nonzero()[0]
    bounds = np.empty(len(starts) + 2, np.int64)
    bounds[0], bounds[-1] = 0, n
    np.add(starts, 1, out=bounds[1:-1])
    firsts = bounds[:-1]
    run = ids.take(firsts, axis=1)  # (ids[:, firsts] is ~10x slower for thousands of runs)
    return run[0], run[1], bounds[1:] - firsts


def spans_ids(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The ids of spans (first id, count: int64 arrays; counts at least one, and bounded by
    the caller) as int64, in order."""
    before = np.cumsum(counts)
    before -= counts
    out = np.repeat(starts - before, counts)
    out += np.arange(len(out))
    return out


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The concatenation of ``range(start, start + count)`` for every pair, as int32."""
    total = int(counts.sum())
    before = np.cumsum(counts)
    before -= counts
    out = np.repeat(starts - before, counts)
    out += np.arange(total)
    return out.astype(np.int32)


def coalesce(src: Sequence[int], dst: Sequence[int]) -> list[Run]:
    """Runs of consecutive (src, dst) pairs, in request order."""
    s, d = _read_ids("source", src), _read_ids("destination", dst)
    n = min(len(s), len(d))
    if n == 0:
        return []
    rs, rd, rc = _run_arrays(np.stack((s[:n], d[:n])).astype(np.int64))
    return list(map(Run, rs.tolist(), rd.tolist(), rc.tolist()))


@dataclass(eq=False)
class TransferPlan:
    """A request's block ids (``src_ids[i]`` moves to ``dst_ids[i]``, int64, request order) and
    its runs as three arrays (src start, dst start, count). ``runs`` makes the tuples on first
    use. Never changed once made, but not a frozen dataclass: its ``__init__`` (one
    ``object.__setattr__`` a field) took 0.9 µs against 0.2, and a batch of 32 makes 33."""

    src_layout: KVLayout
    dst_layout: KVLayout
    src_ids: np.ndarray = field(repr=False, compare=False)
    dst_ids: np.ndarray = field(repr=False, compare=False)
    run_src: np.ndarray = field(repr=False, compare=False)
    run_dst: np.ndarray = field(repr=False, compare=False)
    run_count: np.ndarray = field(repr=False, compare=False)

    @cached_property
    def runs(self) -> tuple[Run, ...]:
        return tuple(map(Run, self.run_src.tolist(), self.run_dst.tolist(),
                         self.run_count.tolist()))

    @property
    def num_runs(self) -> int:
        return len(self.run_count)

    @property
    def num_blocks(self) -> int:
        return len(self.src_ids)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.src_layout.block_bytes

    @property
    def descriptor_count(self) -> int:
        return self.num_runs * self.src_layout.num_regions

    def descriptors(self) -> list[Descriptor]:
        chunk = self.src_layout.chunk_bytes
        return [
            Descriptor(region, run.src * chunk, region, run.dst * chunk, run.count * chunk)
            for run in self.runs
            for region in range(self.src_layout.num_regions)
        ]

    def block_ids(self) -> tuple[np.ndarray, np.ndarray]:
        """The request's (source, destination) block ids, in request order."""
        return self.src_ids, self.dst_ids

    def nixl_indices(self, split: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """Indices (int32 arrays, as NIXL takes them) into per-(region, block) prepared lists,
        for the source and destination: run by run, and within a run region by region.

        ``split`` > 1 cuts every run of at least ``split`` blocks into ``split`` pieces and lists
        the pieces last-first, so NIXL cannot merge them back: that gives its multi-threaded UCX
        engine several descriptors to move in parallel.
        """
        regions = self.src_layout.num_regions
        if split == 1 and regions == 1:  # the indices are the block ids themselves
            return self.src_ids.astype(np.int32), self.dst_ids.astype(np.int32)
        region, offset, count, run = self._pieces(split)
        ns, nd = self.src_layout.num_blocks, self.dst_layout.num_blocks
        return (_ranges(region * ns + self.run_src[run] + offset, count),
                _ranges(region * nd + self.run_dst[run] + offset, count))

    def _pieces(self, split: int):
        """(region, offset in the run, block count, run) of every piece, in posting order:
        run by run, region by region, pieces of a run last-first."""
        regions = self.src_layout.num_regions
        parts = np.minimum(self.run_count, max(1, split))  # pieces of each run, per region
        per_run = parts * regions
        run = np.repeat(np.arange(self.num_runs), per_run)
        first = np.cumsum(per_run) - per_run
        k = np.arange(len(run)) - first[run]  # position among the run's pieces
        p = parts[run]
        region, i = k // p, p - 1 - k % p  # i: the piece's place in the run, listed reversed
        base, extra = np.divmod(self.run_count[run], p)
        offset = i * base + np.minimum(i, extra)
        return region, offset, base + (i < extra), run

    def piece_count(self, split: int = 1) -> int:
        """Descriptors posted for ``nixl_indices(split)``."""
        parts = self.num_runs if split == 1 else int(np.minimum(self.run_count, split).sum())
        return parts * self.src_layout.num_regions


class BatchPart(TransferPlan):
    """One request's plan within a batch's (``plan_many``): its arrays are the batch's, cut on
    first use, and its counts are known without them. A same-node gather moves the batch as
    one plan and never reads them; making five views a request was ~0.7 µs of it."""

    def __init__(self, whole: TransferPlan, a: int, b: int, r: int, q: int):
        self.src_layout, self.dst_layout = whole.src_layout, whole.dst_layout
        self._whole, self._pairs, self._runs = whole, slice(a, b), slice(r, q)
        self._num_blocks, self._num_runs = b - a, q - r

    src_ids = cached_property(lambda self: self._whole.src_ids[self._pairs])
    dst_ids = cached_property(lambda self: self._whole.dst_ids[self._pairs])
    run_src = cached_property(lambda self: self._whole.run_src[self._runs])
    run_dst = cached_property(lambda self: self._whole.run_dst[self._runs])
    run_count = cached_property(lambda self: self._whole.run_count[self._runs])

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_runs(self) -> int:
        return self._num_runs


class OneRun(TransferPlan):
    """A request of one run (a contiguous push named by one span, ``plan_runs``), known by its
    three numbers; its arrays are made on first use. A same-node copy of one run is one copy
    by the runtime and never reads them: making them was five numpy calls of a push's time."""

    def __init__(self, src_layout: KVLayout, dst_layout: KVLayout, src: int, dst: int,
                 count: int):
        self.src_layout, self.dst_layout = src_layout, dst_layout
        self._run = Run(src, dst, count)

    src_ids = cached_property(lambda self: np.arange(self._run.src, self._run.src + self._run.count,
                                                     dtype=np.int64))
    dst_ids = cached_property(lambda self: np.arange(self._run.dst, self._run.dst + self._run.count,
                                                     dtype=np.int64))
    run_src = cached_property(lambda self: np.array([self._run.src], dtype=np.int64))
    run_dst = cached_property(lambda self: np.array([self._run.dst], dtype=np.int64))
    run_count = cached_property(lambda self: np.array([self._run.count], dtype=np.int64))
    runs = cached_property(lambda self: (self._run,))

    @property
    def num_blocks(self) -> int:
        return self._run.count

    @property
    def num_runs(self) -> int:
        return 1


class Planner:
    """Plans requests from ``src_layout`` into ``dst_layout``. What does not change between
    requests — the geometry check, the bounds — is done once: a peer keeps one. ``plan``
    checks both sides at once (range, duplicates) in one pass over one 2 x n array (C, or a few
    numpy calls) and names the first bad id, source side first, only when something is
    wrong."""

    def __init__(self, src_layout: KVLayout, dst_layout: KVLayout | None = None):
        dst_layout = dst_layout or src_layout
        if (src_layout.kind, src_layout.chunk_bytes, src_layout.num_regions) != (
            dst_layout.kind, dst_layout.chunk_bytes, dst_layout.num_regions
        ):
            raise PlanError("source and destination layouts differ in kind or block geometry")
        self.src_layout, self.dst_layout = src_layout, dst_layout
        ns, nd = src_layout.num_blocks, dst_layout.num_blocks
        self._limits = np.array([[ns], [nd]], dtype=np.uint64)
        # the native split's marks (csrc/idscan.c): zero between calls, so made once
        self._seen = np.zeros(ns + nd, dtype=np.uint8)
        native.id_scan()  # built or loaded now (once a process), not in a request's time

    def plan(self, src_blocks, dst_blocks=None) -> TransferPlan:
        """Plan moving ``src_blocks`` into ``dst_blocks`` (lists of ints, integer numpy arrays
        or CPU tensors; the plan keeps its own copy). Refuses, before anything moves, an empty
        request, unequal lengths, and any id out of range or named twice on one side."""
        read = self._read_lists(src_blocks, dst_blocks)
        if read is not None:
            ids, one_run = read
            if one_run:  # consecutive on both sides: checked on its ends by _read_lists
                return self._one_run(ids)
        else:
            src = _read_ids("source", src_blocks)
            dst = src if dst_blocks is None else _read_ids("destination", dst_blocks)
            n = len(src)
            if not n:
                raise PlanError("a request must name at least one block")
            if len(dst) != n:
                raise PlanError(f"{n} source blocks but {len(dst)} destination blocks")
            ids = np.empty((2, n), dtype=np.int64)
            ids[0], ids[1] = src, dst
        parts = self._split(ids, np.array((0, ids.shape[1]), dtype=np.int64))
        if parts is None:
            self._refuse(ids)
        return TransferPlan(self.src_layout, self.dst_layout, ids[0], ids[1], *parts[:3])

    def _split(self, ids: np.ndarray, bounds: np.ndarray):
        """A batch's 2 x n ids (request k holding pairs ``bounds[k]..bounds[k+1]-1``) as runs:
        (run source starts, destination starts, counts, and each request's runs as a list:
        ``per[k]..per[k+1]-1``); a run never spans two requests. None when an id is out of
        range, a source id is named twice in one request or a destination id twice in the
        batch: the caller words the refusal. One C pass (native.py), else a few numpy calls."""
        n, k = ids.shape[1], len(bounds) - 1
        split = native.id_runs()
        if split is not None:
            out, per = np.empty((3, n), dtype=np.int64), np.empty(k + 1, dtype=np.int64)
            r = split(ids, bounds, self._seen, self.src_layout.num_blocks,
                      self.dst_layout.num_blocks, out, per)
            return (out[0, :r], out[1, :r], out[2, :r], per.tolist()) if r > 0 else None
        if not self._batch_ok(ids, bounds):
            return None
        rs, rd, rc = _run_arrays(ids, bounds[1:-1])
        firsts = np.cumsum(rc) - rc
        return rs, rd, rc, np.searchsorted(firsts, bounds).tolist()

    def _read_lists(self, src_blocks, dst_blocks):
        """Lists of plain ints read by the native scan (native.py), their ranges checked on
        the lowest and highest id it saw: (the 2 x n ids, whether both sides are consecutive,
        i.e. one run). None: not such lists, or no native scan; ``plan`` reads them its
        general way (and words any refusal)."""
        scan = native.id_scan()
        if scan is None or type(src_blocks) is not list or (
                dst_blocks is not None and type(dst_blocks) is not list):
            return None
        n = len(src_blocks)
        if not n or (dst_blocks is not None and len(dst_blocks) != n):
            return None
        ids = np.empty((2, n), dtype=np.int64)
        s = scan(src_blocks, ids[0])
        if s is None:
            return None
        if dst_blocks is None:
            ids[1] = ids[0]
            d = s
        else:
            d = scan(dst_blocks, ids[1])
            if d is None:
                return None
        if (s[0] < 0 or s[1] >= self.src_layout.num_blocks or d[0] < 0
                or d[1] >= self.dst_layout.num_blocks):
            self._refuse(ids)
        return ids, s[2] and d[2]

    def plan_runs(self, run_src, run_dst, run_count) -> TransferPlan:
        """A request named by its runs (a peer's plan, sent by a push): ``run_count[i]``
        blocks from ``run_src[i]`` on into ``run_dst[i]`` on (int64 arrays). The refusals of
        ``plan``, checked on the runs before any id list is made (a hostile count cannot make
        one large): no run, a count below one, a run reaching outside either cache, two runs
        naming one block on one side."""
        counts = np.asarray(run_count, dtype=np.int64)
        r = len(counts)
        if not r:
            raise PlanError("a request must name at least one block")
        if len(run_src) != r or len(run_dst) != r:
            raise PlanError(f"{r} run counts but {len(run_src)} source and {len(run_dst)} "
                            f"destination starts")
        if r == 1:  # one run (a contiguous push): the same checks on three Python ints
            return self._plan_one_run(int(run_src[0]), int(run_dst[0]), int(counts[0]))
        if counts.min() < 1:
            i = int(np.argmax(counts < 1))
            raise _short_run(i, int(counts[i]))
        sides = (("source", np.asarray(run_src, dtype=np.int64), self.src_layout.num_blocks),
                 ("destination", np.asarray(run_dst, dtype=np.int64), self.dst_layout.num_blocks))
        for side, starts, limit in sides:
            # starts and counts bounded first, so that start + count cannot overflow
            outside = (starts < 0) | (counts > limit) | (starts > limit - np.minimum(counts, limit))
            if outside.any():
                i = int(np.argmax(outside))
                raise _outside_run(side, int(counts[i]), int(starts[i]), limit)
            order = np.argsort(starts, kind="stable")
            first, ends = starts[order], (starts + counts)[order]
            overlap = first[1:] < ends[:-1]
            if overlap.any():
                raise PlanError(f"{side} block id {int(first[1:][overlap][0])} appears twice "
                                f"in one request")
        src, dst = sides[0][1], sides[1][1]
        ids = np.empty((2, int(counts.sum())), dtype=np.int64)
        ids[0], ids[1] = _ranges(src, counts), _ranges(dst, counts)
        # runs the peer split where both sides go on are one run here
        parts = self._split(ids, np.array((0, ids.shape[1]), dtype=np.int64))
        if parts is None:
            raise AssertionError("runs that passed their checks named a block twice")
        return TransferPlan(self.src_layout, self.dst_layout, ids[0], ids[1], *parts[:3])

    def plan_many(self, requests) -> tuple[list[TransferPlan], TransferPlan]:
        """Plans for a batch of requests (an engine step's worth: ``(src_blocks, dst_blocks or
        None)`` pairs) and one plan moving all of them, in batch order. The refusals of
        ``plan`` for every request, and a destination block named by two requests (two writes
        of one block), checked once over the whole batch (one C pass, or a few numpy calls); when
        a check fails, the requests are planned one by one so that the error is the one ``plan`` or
        ``merge_plans`` gives. A request's runs are its own: a run never spans two requests."""
        requests = list(requests)
        if not requests:
            raise PlanError("a batch must hold at least one request")
        ids, bounds = self._read_batch_lists(requests) or self._read_batch(requests)
        parts = self._split(ids, bounds)
        if parts is None:  # the first bad request's error
            merge_plans([self.plan(src, dst) for src, dst in requests])
            raise AssertionError("a bad batch passed the per-request checks")
        whole = TransferPlan(self.src_layout, self.dst_layout, ids[0], ids[1], *parts[:3])
        at, per = bounds.tolist(), parts[3]
        return [BatchPart(whole, a, b, r, q)
                for a, b, r, q in zip(at, at[1:], per, per[1:])], whole

    def _read_batch_lists(self, requests):
        """A batch of plain-int lists read by the native reader in one call into one 2 x n
        array: (ids, bounds: request k holds pairs bounds[k]..bounds[k+1]-1). A request
        without destinations gets its sources, copied, not read again. None: not such lists,
        an empty or uneven request, or no native reader; ``_read_batch`` reads them then (and
        words any refusal). Ranges and duplicates are the caller's checks. (A ``scan`` a
        request, each into its slice of the array, took ``plan_many`` of 32 x 128 ids from 51
        to 91 µs on the 2-core host.)"""
        scan_batch = native.id_scan_batch()
        if scan_batch is None:
            return None
        bounds = np.empty(len(requests) + 1, dtype=np.int64)
        raw = scan_batch(requests, bounds)
        if raw is None:
            return None
        return np.frombuffer(raw, dtype=np.int64).reshape(2, -1), bounds

    def _read_batch(self, requests):
        """Any batch ``plan`` accepts the requests of, read one id list at a time: (ids,
        bounds) as ``_read_batch_lists``; an empty or uneven request raises its own error."""
        read = []
        for src_blocks, dst_blocks in requests:
            src = _read_ids("source", src_blocks)
            dst = src if dst_blocks is None else _read_ids("destination", dst_blocks)
            if not len(src) or len(dst) != len(src):  # the first bad request's error
                for earlier in (*read, (src, dst)):
                    self.plan(*earlier)
            read.append((src, dst))
        bounds = np.zeros(len(read) + 1, dtype=np.int64)
        np.cumsum([len(src) for src, _ in read], out=bounds[1:])
        ids = np.empty((2, int(bounds[-1])), dtype=np.int64)
        # into int64 directly: numpy would join uint64 and int64 arrays as float64 (uint64 ids
        # above the int64 range were refused by _read_ids)
        np.concatenate([src for src, _ in read], out=ids[0])
        np.concatenate([dst for _, dst in read], out=ids[1])
        return ids, bounds

    def _batch_ok(self, ids: np.ndarray, bounds: np.ndarray) -> bool:
        """Every id in range, no destination block twice in the batch, no source block twice
        in one request (a block may be read by two requests)."""
        if np.count_nonzero(ids.view(np.uint64) >= self._limits):
            return False
        nd, ns, n = self.dst_layout.num_blocks, self.src_layout.num_blocks, ids.shape[1]
        seen = np.zeros(nd, dtype=np.bool_)
        seen[ids[1]] = True
        if np.count_nonzero(seen) != n:
            return False
        k = len(bounds) - 1
        if k == 1:
            keys = ids[0]
        else:  # (request, source id) as one number: equal only within one request
            keys = np.repeat(np.arange(k, dtype=np.int64) * ns, np.diff(bounds)) + ids[0]
        if k * ns <= 1 << 24:
            seen = np.zeros(k * ns, dtype=np.bool_)
            seen[keys] = True
            return np.count_nonzero(seen) == n
        return len(np.unique(keys)) == n

    def _plan_one_run(self, src: int, dst: int, count: int) -> TransferPlan:
        if count < 1:
            raise _short_run(0, count)
        for side, start, limit in (("source", src, self.src_layout.num_blocks),
                                   ("destination", dst, self.dst_layout.num_blocks)):
            if start < 0 or start + count > limit:  # Python ints: no overflow
                raise _outside_run(side, count, start, limit)
        return OneRun(self.src_layout, self.dst_layout, src, dst, count)

    def _one_run(self, ids: np.ndarray) -> TransferPlan:
        """The plan of checked 2 x n ids consecutive on both sides: one run from their first."""
        return TransferPlan(self.src_layout, self.dst_layout, ids[0], ids[1], ids[0, :1],
                            ids[1, :1], np.full(1, ids.shape[1], dtype=np.int64))

    def _refuse(self, ids: np.ndarray) -> None:
        """Raise PlanError naming the first bad id, source side first, in request order."""
        _check_ids("source", ids[0], self.src_layout.num_blocks)
        _check_ids("destination", ids[1], self.dst_layout.num_blocks)
        raise AssertionError("a bad request passed the per-side checks")


def _short_run(i: int, count: int) -> PlanError:
    return PlanError(f"run {i} names {count} blocks; a run names at least one")


def _outside_run(side: str, count: int, start: int, limit: int) -> PlanError:
    return PlanError(f"{side} run of {count} blocks at {start} reaches outside 0..{limit - 1}")


def make_plan(
    src_layout: KVLayout,
    src_blocks,
    dst_layout: KVLayout | None = None,
    dst_blocks=None,
) -> TransferPlan:
    """Plan moving ``src_blocks`` of ``src_layout`` into ``dst_blocks`` of ``dst_layout`` (a
    one-off ``Planner``; see ``Planner.plan``)."""
    return Planner(src_layout, dst_layout).plan(src_blocks, dst_blocks)


def merge_plans(plans: Sequence[TransferPlan]) -> TransferPlan:
    """One plan moving every block of ``plans`` (same layouts), for a single gather; refuses a
    destination block named by two of them (two requests writing one block)."""
    first = plans[0]
    for p in plans[1:]:
        if (p.src_layout, p.dst_layout) != (first.src_layout, first.dst_layout):
            raise PlanError("requests of one batch must share their layouts")
    ids = np.concatenate([np.stack(p.block_ids()) for p in plans], axis=1)
    seen = np.zeros(first.dst_layout.num_blocks, dtype=np.bool_)
    seen[ids[1]] = True
    if np.count_nonzero(seen) != ids.shape[1]:
        _check_ids("destination", ids[1], first.dst_layout.num_blocks)
    return TransferPlan(first.src_layout, first.dst_layout, ids[0], ids[1], *_run_arrays(ids))
