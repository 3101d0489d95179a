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
from contextlib import contextmanager
from typing import Iterator, NamedTuple

from ..host import cudart

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


class _TorchStreams:
    """The ring's two streams, its events, its PCIe copies and its block id uploads through
    torch: cuda, xpu, and cpu (whose streams run in order at once: a CPU ring is correct, just
    not overlapped)."""

    def __init__(self, device):
        import torch

        self.device = device
        self._mod = getattr(torch, device.type)
        kwargs = {} if device.type == "cpu" else {"device": device}
        self.compute = self._mod.Stream(**kwargs)
        self.copy_stream = self._mod.Stream(**kwargs)

    @contextmanager
    def compute_after_caller(self):
        """A context in which torch's index ops run on the compute stream (the device is the
        ring's), and both streams start after what the caller's stream had queued (the
        engine's own writes into the cache, or its reads of blocks a scatter is about to
        overwrite)."""
        caller = self._mod.current_stream(self.device)
        with self._mod.stream(self.compute):
            self.compute.wait_stream(caller)
            self.copy_stream.wait_stream(caller)
            yield

    def events(self, n: int) -> list:
        return [self._mod.Event() for _ in range(n)]

    def event(self):
        """One event, inside compute_after_caller."""
        return self._mod.Event()

    def record(self, event, stream) -> None:
        event.record(stream)

    def wait(self, stream, event) -> None:
        stream.wait_event(event)

    def copy(self, dst, dst_at: int, src, src_at: int, n: int) -> None:
        """``n`` elements ``src[src_at:]`` -> ``dst[dst_at:]`` on the copy stream."""
        with self._mod.stream(self.copy_stream):
            dst[dst_at:dst_at + n].copy_(src[src_at:src_at + n], non_blocking=True)

    def upload(self, ids):
        """An int64 numpy array of block ids on the device, for the index ops queued on the
        compute stream after this (called with it current: the tensor is its)."""
        import torch

        return torch.from_numpy(ids).to(self.device, non_blocking=True)

    def upload_owned(self, ids):
        """The same, a tensor of its own however long the work reading it is queued after."""
        return self.upload(ids)


class _CudaStreams(_TorchStreams):
    """The same on CUDA, with the ring's own calls (events, waits, copies, block id uploads)
    made through the runtime directly (cudart.py): 1-5 µs each instead of torch's 5-40 on the
    H100 VM, and a gather makes four a slot. The ids go up on the compute stream that reads
    them (cudart.IdUploads)."""

    def __init__(self, device):
        super().__init__(device)
        self._ids = cudart.IdUploads(device, self.compute)
        self._handles = {id(s): s.cuda_stream for s in (self.compute, self.copy_stream)}
        (self._caller,) = self.events(1)

    @contextmanager
    def compute_after_caller(self):
        with cudart.StreamScope(self.compute) as scope:
            scope.after_caller(self._caller, *self._handles.values())
            yield

    def events(self, n: int) -> list:
        import torch

        with torch.cuda.device(self.device):  # events live on the device of the streams they mark
            return [cudart.Event() for _ in range(n)]

    def event(self):
        return cudart.Event()  # inside compute_after_caller: the ring's device is current

    def record(self, event, stream) -> None:
        event.record(self._handles[id(stream)])

    def wait(self, stream, event) -> None:
        cudart.wait(self._handles[id(stream)], event)

    def copy(self, dst, dst_at: int, src, src_at: int, n: int) -> None:
        item = dst.element_size()
        cudart.copy_async(dst.data_ptr() + dst_at * item, src.data_ptr() + src_at * item,
                          n * item, self._handles[id(self.copy_stream)])

    def upload(self, ids):
        buf, _ = self._ids.upload(ids)  # at offset 0
        return buf[:len(ids)]

    def upload_owned(self, ids):
        return self._ids.upload_owned(ids)


def streams(device) -> _TorchStreams:
    """A device's streams: through the CUDA runtime on CUDA (where it loads), else torch's."""
    return (_CudaStreams if device.type == "cuda" and cudart.runtime() is not None
            else _TorchStreams)(device)


class BounceRing:
    """``slots`` device buffers of ``slot_words`` words of ``dtype``, a compute stream for the
    index ops and a copy stream for the DMA copies (one: a second one, slots alternating,
    measured 0.01-0.02 slower on the H100 VM)."""

    def __init__(self, device, dtype, slot_words: int, slots: int = SLOTS):
        import torch

        self.slot_words = slot_words
        self.streams = streams(device)
        self._buf = torch.empty(slots, slot_words, dtype=dtype, device=device)
        self._filled = self.streams.events(slots)
        self._free = self.streams.events(slots)  # passed: slot s may be rewritten
        self._used = [False] * slots
        self._next = 0
        self._lock = threading.Lock()

    def _slot(self) -> int:
        s = self._next
        self._next = (s + 1) % len(self._free)
        return s

    def _pipeline(self, fills, copy_first: bool, stage_one, stage_two, ids) -> object:
        """Each fill in turn takes the next slot: ``stage_one(fill, slot, ids)`` once the slot
        is free, ``stage_two(...)`` once stage one has passed. A copy stage runs on the copy
        stream, an index stage on the compute stream; ``copy_first`` says
        which comes first (a scatter's). The block ids (int64 numpy) go up on the compute
        stream before the first index stage. Returns an event after the last stage two."""
        st = self.streams
        with self._lock, st.compute_after_caller():
            dev_ids = None if copy_first else st.upload(ids)
            first, then = ((st.copy_stream, st.compute) if copy_first else
                           (st.compute, st.copy_stream))
            for fill in fills:
                s = self._slot()
                if self._used[s]:
                    st.wait(first, self._free[s])
                stage_one(fill, self._buf[s], dev_ids)
                if dev_ids is None:  # a scatter's first copy is queued: now the ids
                    dev_ids = st.upload(ids)
                st.record(self._filled[s], first)
                st.wait(then, self._filled[s])
                stage_two(fill, self._buf[s], dev_ids)
                st.record(self._free[s], then)
                self._used[s] = True
            last = st.event()
            st.record(last, then)
            return last

    def gather(self, fills: list[list[Piece]], regions: list, ids, run, shape) -> object:
        """Queue ``fills``: region views ``regions[p.region]`` (``[blocks][...]``) at block ids
        ``ids`` (int64 numpy) -> the flat host ``run`` at each piece's offset. ``shape`` is a
        block row's shape. Returns the event after the last copy (the run is complete when it
        has passed)."""
        import torch

        def select(fill, buf, dev_ids):
            for p, part in _parts(fill, buf, shape):
                torch.index_select(regions[p.region], 0, dev_ids[p.b0:p.b1], out=part)

        def copy_out(fill, buf, dev_ids):
            self.streams.copy(run, fill[0].offset, buf, 0, _words(fill))

        return self._pipeline(fills, False, select, copy_out, ids)

    def scatter(self, fills: list[list[Piece]], run, regions: list, ids, shape) -> object:
        """Queue ``fills``: the flat host ``run`` at each piece's offset -> region views
        ``regions[p.region]`` at block ids ``ids`` (int64 numpy). Returns the event after the
        last index copy."""

        def copy_in(fill, buf, dev_ids):
            self.streams.copy(buf, 0, run, fill[0].offset, _words(fill))

        def place(fill, buf, dev_ids):
            for p, part in _parts(fill, buf, shape):
                regions[p.region].index_copy_(0, dev_ids[p.b0:p.b1], part)

        return self._pipeline(fills, True, copy_in, place, ids)


def _words(fill: list[Piece]) -> int:
    return sum(p.words for p in fill)


def _parts(fill: list[Piece], buf, shape):
    """Each piece of a fill with its place in the slot, shaped as its blocks' rows."""
    at = 0
    for p in fill:
        yield p, buf[at:at + p.words].view(p.b1 - p.b0, *shape)
        at += p.words
