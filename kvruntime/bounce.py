"""Pipelined copies between a device KV cache and a pinned host run, through a small ring of
device bounce buffers.

A staged run is region-major (``[regions][blocks][tokens][heads][words]``), so any range of it
that follows region order is one contiguous piece of host memory. A gather fills one bounce
slot on the device (one ``index_select`` per region piece, on the compute stream: device
bandwidth, ~25x PCIe's), then the copy engine moves the whole slot to the pinned run in one
DMA copy (on the copy stream) while the next slot is being filled. A scatter is the mirror:
DMA a piece of the run into a slot, then ``index_copy_`` it into the cache while the next
piece crosses. The PCIe copy is the only thing left exposed, plus one slot's gather or scatter
at the edge: the same bytes move at nearly the speed of one contiguous pinned copy.

Slots are reused in turn; an event per slot says when it may be overwritten, so consecutive
calls pipeline into each other and nothing ever waits for the whole device.
"""

from __future__ import annotations

import threading
from typing import Iterator, NamedTuple

SLOTS = 3
SLOT_BYTES = 32 << 20  # ~0.6 ms of PCIe Gen5 a slot, far above the ~60 µs of queueing one


class Piece(NamedTuple):
    """Blocks ``b0:b1`` of one region of a request: ``words`` words at ``offset`` of the run."""

    region: int
    b0: int
    b1: int
    offset: int
    words: int


def pieces(regions: range, blocks: int, row_words: int,
           slot_words: int) -> Iterator[list[Piece]]:
    """The regions ``regions`` of a run of ``blocks`` blocks (``row_words`` a block of one
    region) cut into slot fills: each fill is consecutive pieces, at most ``slot_words`` long,
    so it is one contiguous range of the run; a region larger than a slot is split by blocks.
    Yielded one at a time: the first slot's copies are queued before the rest are cut (the
    device works while the host cuts; cut up front they cost ~0.15 ms before any copy)."""
    per = max(1, slot_words // row_words)
    current: list[Piece] = []
    used = 0
    for r in regions:
        for b0 in range(0, blocks, per):
            b1 = min(blocks, b0 + per)
            words = (b1 - b0) * row_words
            if current and used + words > slot_words:
                yield current
                current, used = [], 0
            current.append(Piece(r, b0, b1, (r * blocks + b0) * row_words, words))
            used += words
    if current:
        yield current


class BounceRing:
    """``SLOTS`` device buffers of ``slot_words`` words of ``dtype``, a compute stream for the
    index ops and a copy stream for the DMA copies."""

    def __init__(self, device, dtype, slot_words: int, slots: int = SLOTS):
        import torch

        self.slot_words = slot_words
        self._mod = getattr(torch, device.type)
        self._device = device
        self._buf = torch.empty(slots, slot_words, dtype=dtype, device=device)
        # torch.cpu's streams run in order at once (a CPU ring is correct, just not overlapped)
        kwargs = {} if device.type == "cpu" else {"device": device}
        self._compute = self._mod.Stream(**kwargs)
        self._copy = self._mod.Stream(**kwargs)
        self._free: list = [None] * slots  # the event after which slot s may be overwritten
        self._next = 0
        self._lock = threading.Lock()

    def _slot(self):
        s = self._next
        self._next = (s + 1) % len(self._free)
        return s, self._buf[s]

    def _after_caller(self) -> None:
        """Both streams start after what the caller's stream queued so far (the engine's own
        writes into the cache, or its reads of blocks a scatter is about to overwrite)."""
        caller = self._mod.current_stream(self._device)
        self._compute.wait_stream(caller)
        self._copy.wait_stream(caller)

    def _record(self, stream):
        event = self._mod.Event()
        event.record(stream)
        return event

    def _pipeline(self, fills, first, stage_one, then, stage_two) -> object:
        """Each fill in turn takes the next slot: ``stage_one(fill, slot)`` on stream ``first``
        once the slot is free, ``stage_two(fill, slot)`` on stream ``then`` once stage one has
        passed. Returns the event after the last stage two."""
        with self._lock:
            self._after_caller()
            last = None
            for fill in fills:
                s, buf = self._slot()
                if self._free[s] is not None:
                    first.wait_event(self._free[s])
                with self._mod.stream(first):
                    stage_one(fill, buf)
                then.wait_event(self._record(first))
                with self._mod.stream(then):
                    stage_two(fill, buf)
                last = self._free[s] = self._record(then)
            return last

    def gather(self, fills: list[list[Piece]], regions: list, ids, run, shape) -> object:
        """Queue ``fills``: region views ``regions[p.region]`` (``[blocks][...]``) at ``ids``
        -> the flat host ``run`` at each piece's offset. ``shape`` is a block row's shape.
        Returns the event after the last copy (the run is complete when it has passed)."""
        import torch

        def select(fill, buf):
            for p, part in _parts(fill, buf, shape):
                torch.index_select(regions[p.region], 0, ids[p.b0:p.b1], out=part)

        def copy_out(fill, buf):
            n = _words(fill)
            run[fill[0].offset:fill[0].offset + n].copy_(buf[:n], non_blocking=True)

        return self._pipeline(fills, self._compute, select, self._copy, copy_out)

    def scatter(self, fills: list[list[Piece]], run, regions: list, ids, shape) -> object:
        """Queue ``fills``: the flat host ``run`` at each piece's offset -> region views
        ``regions[p.region]`` at ``ids``. Returns the event after the last index copy."""

        def copy_in(fill, buf):
            n = _words(fill)
            buf[:n].copy_(run[fill[0].offset:fill[0].offset + n], non_blocking=True)

        def place(fill, buf):
            for p, part in _parts(fill, buf, shape):
                regions[p.region].index_copy_(0, ids[p.b0:p.b1], part)

        return self._pipeline(fills, self._copy, copy_in, self._compute, place)


def _words(fill: list[Piece]) -> int:
    return sum(p.words for p in fill)


def _parts(fill: list[Piece], buf, shape):
    """Each piece of a fill with its place in the slot, shaped as its blocks' rows."""
    at = 0
    for p in fill:
        yield p, buf[at:at + p.words].view(p.b1 - p.b0, *shape)
        at += p.words
