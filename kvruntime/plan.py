"""Transfer plans: which byte ranges move for a list of block ids.

Pure arithmetic. A request moves source blocks ``src[i]`` to destination blocks ``dst[i]``.
Consecutive pairs where both ids grow by one form a *run*; each run is one descriptor in the
``cross_layer`` layout and one descriptor per region in ``per_layer``. The same runs give the
NIXL descriptor indices: prepared lists hold one entry per (region, block), index
``region * num_blocks + block``, and NIXL merges consecutive indices of adjacent memory back into
one descriptor — so the number of descriptors NIXL posts equals the plan's count.
"""

from __future__ import annotations

import operator
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


def _as_ids(name: str, ids: Sequence[int]) -> np.ndarray:
    """Block ids as an int64 array; ints, numpy and torch integers are ids, bools and floats
    are not."""
    if isinstance(ids, np.ndarray) or type(ids).__module__.startswith("torch"):
        arr = np.asarray(ids)
        if arr.dtype.kind not in "iu":
            raise PlanError(f"{name} block ids must be integers, got an array of {arr.dtype}")
        return arr.reshape(-1).astype(np.int64, copy=False)
    ids = list(ids)
    if not set(map(type, ids)) <= {int}:  # (C-level: a generator costs ~0.5 ms per 4096 ids)
        ids = [_one_id(name, b) for b in ids]
    return np.asarray(ids, dtype=np.int64).reshape(-1)


def _one_id(name: str, b) -> int:
    """An int from anything integer-like (numpy and torch integer scalars); never a bool."""
    if isinstance(b, (bool, np.bool_, float)) or "bool" in str(getattr(b, "dtype", "")):
        raise PlanError(f"{name} block id {b!r} is not an integer")
    try:
        return operator.index(b)
    except TypeError:
        raise PlanError(f"{name} block id {b!r} is not an integer") from None


def _check_ids(name: str, ids: np.ndarray, num_blocks: int) -> None:
    if not len(ids):
        return
    bad = ids[(ids < 0) | (ids >= num_blocks)]
    if len(bad):
        raise PlanError(f"{name} block id {int(bad[0])} is outside 0..{num_blocks - 1}")
    seen = np.zeros(num_blocks, dtype=np.bool_)
    seen[ids] = True
    if int(np.count_nonzero(seen)) != len(ids):
        seen = set()
        for b in ids.tolist():
            if b in seen:
                raise PlanError(f"{name} block id {b} appears twice in one request")
            seen.add(b)


def _run_arrays(src, dst) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(starts in src, starts in dst, counts) of the runs of consecutive (src, dst) pairs."""
    s = np.asarray(src, dtype=np.int64).reshape(-1)
    d = np.asarray(dst, dtype=np.int64).reshape(-1)
    n = min(len(s), len(d))
    if n == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    s, d = s[:n], d[:n]
    breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [n])))
    return s[starts], d[starts], counts


def coalesce(src: Sequence[int], dst: Sequence[int]) -> list[Run]:
    """Runs of consecutive (src, dst) pairs, in request order."""
    rs, rd, rc = _run_arrays(src, dst)
    return list(map(Run, rs.tolist(), rd.tolist(), rc.tolist()))


@dataclass(frozen=True)
class TransferPlan:
    """Runs are kept as three arrays (src start, dst start, count): a request of thousands of
    scattered blocks is planned without a Python object per run. ``runs`` makes the tuples on
    first use."""

    src_layout: KVLayout
    dst_layout: KVLayout
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
        return int(self.run_count.sum())

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

    def nixl_indices(self, split: int = 1) -> tuple[list[int], list[int]]:
        """Indices into per-(region, block) prepared lists, for the source and destination.

        ``split`` > 1 cuts every run of at least ``split`` blocks into ``split`` pieces and lists
        the pieces last-first, so NIXL cannot merge them back: that gives its multi-threaded UCX
        engine several descriptors to move in parallel.
        """
        ns, nd = self.src_layout.num_blocks, self.dst_layout.num_blocks
        if split == 1:
            return self._indices_unsplit(ns, nd)
        src_idx: list[int] = []
        dst_idx: list[int] = []
        for run in self.runs:
            pieces = _split(run.count, split)
            for region in range(self.src_layout.num_regions):
                for off, cnt in reversed(pieces):
                    s0 = region * ns + run.src + off
                    d0 = region * nd + run.dst + off
                    src_idx.extend(range(s0, s0 + cnt))
                    dst_idx.extend(range(d0, d0 + cnt))
        return src_idx, dst_idx

    def block_ids(self) -> tuple[np.ndarray, np.ndarray]:
        """The request's (source, destination) block ids, run by run."""
        src, dst, counts = self.run_src, self.run_dst, self.run_count
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        return np.repeat(src, counts) + within, np.repeat(dst, counts) + within

    def _indices_unsplit(self, ns: int, nd: int) -> tuple[list[int], list[int]]:
        """nixl_indices(1), vectorized: run by run, and within a run region by region."""
        s, d = self.block_ids()
        regions = self.src_layout.num_regions
        if regions == 1:
            return s.tolist(), d.tolist()
        run_of = np.repeat(np.arange(self.num_runs), self.run_count)
        r = np.arange(regions)
        order = np.lexsort((np.tile(np.arange(len(s)), regions), np.repeat(r, len(s)),
                            np.tile(run_of, regions)))
        src_all = (np.repeat(r, len(s)) * ns + np.tile(s, regions))[order]
        dst_all = (np.repeat(r, len(d)) * nd + np.tile(d, regions))[order]
        return src_all.tolist(), dst_all.tolist()

    def piece_count(self, split: int = 1) -> int:
        """Descriptors posted for ``nixl_indices(split)``."""
        return sum(len(_split(r.count, split)) for r in self.runs) * self.src_layout.num_regions


def _split(count: int, parts: int) -> list[tuple[int, int]]:
    parts = max(1, min(parts, count))
    base, extra = divmod(count, parts)
    out, off = [], 0
    for i in range(parts):
        n = base + (1 if i < extra else 0)
        out.append((off, n))
        off += n
    return out


def make_plan(
    src_layout: KVLayout,
    src_blocks: Sequence[int],
    dst_layout: KVLayout | None = None,
    dst_blocks: Sequence[int] | None = None,
) -> TransferPlan:
    """Plan moving ``src_blocks`` of ``src_layout`` into ``dst_blocks`` of ``dst_layout``."""
    dst_layout = dst_layout or src_layout
    src_blocks = _as_ids("source", src_blocks)
    dst_blocks = src_blocks if dst_blocks is None else _as_ids("destination", dst_blocks)
    if (src_layout.kind, src_layout.chunk_bytes, src_layout.num_regions) != (
        dst_layout.kind, dst_layout.chunk_bytes, dst_layout.num_regions
    ):
        raise PlanError("source and destination layouts differ in kind or block geometry")
    if not len(src_blocks):
        raise PlanError("a request must name at least one block")
    if len(src_blocks) != len(dst_blocks):
        raise PlanError(
            f"{len(src_blocks)} source blocks but {len(dst_blocks)} destination blocks"
        )
    _check_ids("source", src_blocks, src_layout.num_blocks)
    _check_ids("destination", dst_blocks, dst_layout.num_blocks)
    return TransferPlan(src_layout, dst_layout, *_run_arrays(src_blocks, dst_blocks))


def merge_plans(plans: Sequence[TransferPlan]) -> TransferPlan:
    """One plan moving every block of ``plans`` (same layouts), for a single gather; refuses a
    destination block named by two of them (two requests writing one block)."""
    first = plans[0]
    for p in plans[1:]:
        if (p.src_layout, p.dst_layout) != (first.src_layout, first.dst_layout):
            raise PlanError("requests of one batch must share their layouts")
    merged = TransferPlan(first.src_layout, first.dst_layout,
                          np.concatenate([p.run_src for p in plans]),
                          np.concatenate([p.run_dst for p in plans]),
                          np.concatenate([p.run_count for p in plans]))
    _src, dst = merged.block_ids()
    _check_ids("destination", dst, first.dst_layout.num_blocks)
    return merged
