"""Mixed tensor-parallel sizes: which KV heads a decode rank reads from which prefill rank.

Pure arithmetic. A layout's ``num_kv_heads`` are the heads one rank holds and ``tp_size`` the
ranks, so the model has ``num_kv_heads * tp_size`` KV heads; rank r holds heads
``[r * num_kv_heads, (r + 1) * num_kv_heads)``. With prefill TP p and decode TP d, decode rank j
owns the global heads ``[j*H/d, (j+1)*H/d)`` and reads them from every prefill rank whose heads
overlap: p > d gathers from several prefill ranks, p < d takes a slice of one.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import IncompatiblePeerError
from .layout import KVLayout

# Fields two peers must agree on when their TP sizes may differ (heads are compared in total).
TP_FIELDS = ("dtype", "tokens_per_block", "head_dim", "num_layers")
# Layout fields that may differ between two ranks of different TP sizes.
TP_ONLY = ("num_kv_heads", "tp_size")


@dataclass(frozen=True)
class HeadSlice:
    """Heads ``src`` (local to ``prefill_rank``) land at heads ``dst`` (local to the decode)."""

    prefill_rank: int
    src: tuple[int, int]
    dst: tuple[int, int]

    @property
    def count(self) -> int:
        return self.src[1] - self.src[0]


def total_heads(layout: KVLayout) -> int:
    return layout.num_kv_heads * layout.tp_size


def head_slices(prefill: KVLayout, decode: KVLayout, decode_rank: int) -> list[HeadSlice]:
    """Every prefill rank's contribution to ``decode_rank``, in head order."""
    check_tp_pair(prefill, decode)
    if not 0 <= decode_rank < decode.tp_size:
        raise IncompatiblePeerError(f"decode rank {decode_rank} is outside 0..{decode.tp_size - 1}"
                                    f" (tp_size {decode.tp_size})", ["tp_rank"])
    hp, hd = prefill.num_kv_heads, decode.num_kv_heads
    lo, hi = decode_rank * hd, (decode_rank + 1) * hd
    out = []
    for i in range(prefill.tp_size):
        a, b = max(lo, i * hp), min(hi, (i + 1) * hp)
        if a < b:
            out.append(HeadSlice(i, (a - i * hp, b - i * hp), (a - lo, b - lo)))
    return out


def slice_from(prefill: KVLayout, prefill_rank: int, decode: KVLayout,
               decode_rank: int) -> HeadSlice:
    """What ``decode_rank`` reads from ``prefill_rank``; an error names the ranks when nothing."""
    for s in head_slices(prefill, decode, decode_rank):
        if s.prefill_rank == prefill_rank:
            return s
    raise IncompatiblePeerError(
        f"prefill rank {prefill_rank} of {prefill.tp_size} holds none of the heads of decode rank "
        f"{decode_rank} of {decode.tp_size}: connect this decode rank to prefill ranks "
        f"{[s.prefill_rank for s in head_slices(prefill, decode, decode_rank)]}", ["tp_rank"])


def direct_slice(prefill: KVLayout, prefill_rank: int, decode: KVLayout,
                 decode_rank: int) -> HeadSlice | None:
    """What a direct (unstaged) transfer between these ranks moves: None when it is whole blocks
    (same heads on both sides: the prepared per-block lists serve it), else the head slice."""
    s = slice_from(prefill, prefill_rank, decode, decode_rank)
    if s.src == (0, prefill.num_kv_heads) and s.dst == (0, decode.num_kv_heads):
        return None
    return s


def tp_differences(ours: KVLayout, theirs: KVLayout) -> list[str]:
    """What keeps two TP layouts from pairing, as 'field: ours=X peer=Y' (empty: they pair)."""
    out = [f"{n}: ours={getattr(ours, n)!r} peer={getattr(theirs, n)!r}"
           for n in TP_FIELDS if getattr(ours, n) != getattr(theirs, n)]
    if total_heads(ours) != total_heads(theirs):
        out.append(f"num_kv_heads x tp_size: ours={ours.num_kv_heads}x{ours.tp_size}"
                   f"={total_heads(ours)} peer={theirs.num_kv_heads}x{theirs.tp_size}"
                   f"={total_heads(theirs)} (the model's KV heads must be the same)")
    return out


def check_tp_pair(a: KVLayout, b: KVLayout) -> None:
    diffs = tp_differences(a, b)
    if diffs:
        raise IncompatiblePeerError("TP layouts cannot pair: " + "; ".join(diffs),
                                    [d.split(":", 1)[0] for d in diffs])


def rows_per_chunk(layout: KVLayout) -> int:
    """Token rows (all heads of one token of one layer's K or V) in one block of one region."""
    return layout.chunk_bytes // row_bytes(layout)


def row_bytes(layout: KVLayout) -> int:
    return layout.num_kv_heads * layout.head_dim * layout.element_bytes


def head_rows(layout: KVLayout, regions, blocks, heads: tuple[int, int]):
    """Nx3 (address, length, device id) of heads ``heads`` of every token row of ``blocks``,
    ordered (region, block, row): the descriptors of a direct mixed-TP transfer.

    A block's heads are innermost but one (``[token][head][head_dim]`` per layer's K or V), so
    a head slice of a block is one short range per token row: two sides built with the same
    block order pair row by row. ``regions``: (address, length, device id) per region."""
    import numpy as np

    blocks = np.asarray(blocks, dtype=np.uint64)
    rows = rows_per_chunk(layout)
    head = layout.head_dim * layout.element_bytes
    within = (np.arange(rows, dtype=np.uint64) * np.uint64(row_bytes(layout))
              + np.uint64(heads[0] * head))
    per_block = (blocks * np.uint64(layout.chunk_bytes))[:, None] + within[None, :]
    out = np.empty((len(regions), blocks.size * rows, 3), dtype=np.uint64)
    for i, (address, _length, device) in enumerate(regions):
        out[i, :, 0] = np.uint64(address) + per_block.reshape(-1)
        out[i, :, 1] = (heads[1] - heads[0]) * head
        out[i, :, 2] = device
    return out.reshape(-1, 3)
