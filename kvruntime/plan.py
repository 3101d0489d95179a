"""Transfer plans: which byte ranges move for a list of block ids.

Pure arithmetic. A request moves source blocks ``src[i]`` to destination blocks ``dst[i]``.
Consecutive pairs where both ids grow by one form a *run*; each run is one descriptor in the
``cross_layer`` layout and one descriptor per region in ``per_layer``. The same runs give the
NIXL descriptor indices: prepared lists hold one entry per (region, block), index
``region * num_blocks + block``, and NIXL merges consecutive indices of adjacent memory back into
one descriptor — so the number of descriptors NIXL posts equals the plan's count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .errors import PlanError
from .layout import KVLayout


@dataclass(frozen=True)
class Run:
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


def _check_ids(name: str, ids: Sequence[int], num_blocks: int) -> None:
    seen = set()
    for b in ids:
        if not isinstance(b, int) or isinstance(b, bool):
            raise PlanError(f"{name} block id {b!r} is not an integer")
        if not 0 <= b < num_blocks:
            raise PlanError(f"{name} block id {b} is outside 0..{num_blocks - 1}")
        if b in seen:
            raise PlanError(f"{name} block id {b} appears twice in one request")
        seen.add(b)


def coalesce(src: Sequence[int], dst: Sequence[int]) -> list[Run]:
    """Runs of consecutive (src, dst) pairs, in request order."""
    runs: list[Run] = []
    start_s = start_d = prev_s = prev_d = None
    count = 0
    for s, d in zip(src, dst):
        if count and s == prev_s + 1 and d == prev_d + 1:
            count += 1
        else:
            if count:
                runs.append(Run(start_s, start_d, count))
            start_s, start_d, count = s, d, 1
        prev_s, prev_d = s, d
    if count:
        runs.append(Run(start_s, start_d, count))
    return runs


@dataclass(frozen=True)
class TransferPlan:
    src_layout: KVLayout
    dst_layout: KVLayout
    runs: tuple[Run, ...]

    @property
    def num_blocks(self) -> int:
        return sum(r.count for r in self.runs)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.src_layout.block_bytes

    @property
    def descriptor_count(self) -> int:
        return len(self.runs) * self.src_layout.num_regions

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
    dst_blocks = list(src_blocks) if dst_blocks is None else list(dst_blocks)
    src_blocks = list(src_blocks)
    if (src_layout.kind, src_layout.chunk_bytes, src_layout.num_regions) != (
        dst_layout.kind, dst_layout.chunk_bytes, dst_layout.num_regions
    ):
        raise PlanError("source and destination layouts differ in kind or block geometry")
    if not src_blocks:
        raise PlanError("a request must name at least one block")
    if len(src_blocks) != len(dst_blocks):
        raise PlanError(
            f"{len(src_blocks)} source blocks but {len(dst_blocks)} destination blocks"
        )
    _check_ids("source", src_blocks, src_layout.num_blocks)
    _check_ids("destination", dst_blocks, dst_layout.num_blocks)
    return TransferPlan(src_layout, dst_layout, tuple(coalesce(src_blocks, dst_blocks)))
