"""Transfer plans: which byte ranges move for a list of block ids.

Pure arithmetic. A request moves source blocks ``src[i]`` to destination blocks ``dst[i]``.
Consecutive pairs where both ids grow by one form a *run*; each run is one descriptor in the
``cross_layer`` layout and one descriptor per region in ``per_layer``. The same runs give the
NIXL descriptor indices: prepared lists hold one entry per (region, block), index
``region * num_blocks + block``, and NIXL merges consecutive indices of adjacent memory back into
one descriptor — so the number of descriptors NIXL posts equals the plan's count.

Everything per request is a handful of numpy operations on the whole id array, never a Python
step per id or per run: a request of 4096 scattered blocks is planned, checked (range,
duplicates) and turned into NIXL indices in about the time of 4 ids (the host cost of a request
is what bounds many small requests in flight).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple, Sequence

import numpy as np

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


def _as_ids(name: str, ids) -> np.ndarray:
    """Block ids as a 1-D int64 array. What numpy reads as an integer array is ids: lists of
    ints (numpy and torch integer scalars included), integer numpy arrays, CPU torch tensors.
    Bools, floats, strings and anything else are refused (a list mixing bools into ints is
    read as numpy reads it: as 0 and 1)."""
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
        raise PlanError(f"{name} block ids are not a list of integers: {exc}") from None
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.dtype.kind not in "iu":
        what = "an array of" if isinstance(ids, np.ndarray) else "ids read as"
        raise PlanError(f"{name} block ids must be integers, got {what} {arr.dtype}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise PlanError(f"{name} block id {int(arr.max())} is outside the range of block ids")
    # the plan keeps its own copy: a caller may reuse its array while the request runs
    return arr.reshape(-1).astype(np.int64, copy=not isinstance(ids, (list, tuple)))


def _check_ids(name: str, ids: np.ndarray, num_blocks: int) -> None:
    """Every id in 0..num_blocks-1 and none twice, or PlanError naming the first bad one."""
    # one comparison for both ends: a negative id, seen unsigned, is larger than any count
    if np.count_nonzero(ids.view(np.uint64) >= num_blocks):
        bad = ids[(ids < 0) | (ids >= num_blocks)]
        raise PlanError(f"{name} block id {int(bad[0])} is outside 0..{num_blocks - 1}")
    seen = np.zeros(num_blocks, dtype=np.bool_)
    seen[ids] = True
    if np.count_nonzero(seen) != len(ids):
        order = np.argsort(ids, kind="stable")
        again = order[1:][ids[order[1:]] == ids[order[:-1]]]  # later copies, by position
        raise PlanError(f"{name} block id {int(ids[again.min()])} appears twice in one request")


def _run_arrays(s: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(starts in src, starts in dst, counts) of the runs of consecutive (src, dst) pairs."""
    n = len(s)
    if n == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    # (step of src - 1) | (step of dst - 1) is zero exactly where a run goes on (in-place
    # operations: a few numpy calls whatever the length, each ~1 µs even for 4 ids)
    breaks = s[1:] - s[:-1]
    breaks -= 1
    step = d[1:] - d[:-1]
    step -= 1
    breaks |= step
    starts = breaks.nonzero()[0]
    bounds = np.empty(len(starts) + 2, np.int64)
    bounds[0], bounds[-1] = 0, n
    np.add(starts, 1, out=bounds[1:-1])
    firsts = bounds[:-1]
    return s[firsts], d[firsts], bounds[1:] - firsts


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
    s, d = _as_ids("source", src), _as_ids("destination", dst)
    n = min(len(s), len(d))
    rs, rd, rc = _run_arrays(s[:n], d[:n])
    return list(map(Run, rs.tolist(), rd.tolist(), rc.tolist()))


@dataclass(frozen=True)
class TransferPlan:
    """A request's block ids (``src_ids[i]`` moves to ``dst_ids[i]``, int64, request order) and
    its runs as three arrays (src start, dst start, count). ``runs`` makes the tuples on first
    use."""

    src_layout: KVLayout
    dst_layout: KVLayout
    src_ids: np.ndarray = field(repr=False, compare=False)
    dst_ids: np.ndarray = field(repr=False, compare=False)
    run_src: np.ndarray = field(repr=False, compare=False)
    run_dst: np.ndarray = field(repr=False, compare=False)
    run_count: np.ndarray = field(repr=False, compare=False)

    @classmethod
    def of(cls, src_layout: KVLayout, dst_layout: KVLayout, src_ids: np.ndarray,
           dst_ids: np.ndarray) -> "TransferPlan":
        return cls(src_layout, dst_layout, src_ids, dst_ids, *_run_arrays(src_ids, dst_ids))

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


def make_plan(
    src_layout: KVLayout,
    src_blocks,
    dst_layout: KVLayout | None = None,
    dst_blocks=None,
) -> TransferPlan:
    """Plan moving ``src_blocks`` of ``src_layout`` into ``dst_blocks`` of ``dst_layout``
    (lists of ints, integer numpy arrays or CPU tensors). Refuses, before anything moves, an
    empty request, unequal lengths, and any id out of range or named twice on one side."""
    dst_layout = dst_layout or src_layout
    src = _as_ids("source", src_blocks)
    dst = src if dst_blocks is None else _as_ids("destination", dst_blocks)
    if (src_layout.kind, src_layout.chunk_bytes, src_layout.num_regions) != (
        dst_layout.kind, dst_layout.chunk_bytes, dst_layout.num_regions
    ):
        raise PlanError("source and destination layouts differ in kind or block geometry")
    if not len(src):
        raise PlanError("a request must name at least one block")
    if len(src) != len(dst):
        raise PlanError(f"{len(src)} source blocks but {len(dst)} destination blocks")
    _check_ids("source", src, src_layout.num_blocks)
    if dst is not src or dst_layout.num_blocks < src_layout.num_blocks:
        _check_ids("destination", dst, dst_layout.num_blocks)
    return TransferPlan.of(src_layout, dst_layout, src, dst)


def merge_plans(plans: Sequence[TransferPlan]) -> TransferPlan:
    """One plan moving every block of ``plans`` (same layouts), for a single gather; refuses a
    destination block named by two of them (two requests writing one block)."""
    first = plans[0]
    for p in plans[1:]:
        if (p.src_layout, p.dst_layout) != (first.src_layout, first.dst_layout):
            raise PlanError("requests of one batch must share their layouts")
    src = np.concatenate([p.src_ids for p in plans])
    dst = np.concatenate([p.dst_ids for p in plans])
    _check_ids("destination", dst, first.dst_layout.num_blocks)
    return TransferPlan.of(first.src_layout, first.dst_layout, src, dst)
