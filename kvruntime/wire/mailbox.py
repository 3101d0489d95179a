"""A same-node prefill's "ready" records, read by its decode straight out of its memory.

A push the prefill starts to a same-node decode that copies it (protocol 8) reaches the decode
as a "ready" frame on the side channel. On the H100 hosts sending that small frame took the
prefill 40-80 µs (loopback TCP, the receiver's wake-up) and reading it the decode another ~25,
while the decode was polling anyway: most of what a one-GPU push lost to a pull. So the prefill
also writes each ready's payload into a ring in its own memory, before it sends the frame, and
a decode that opened our memory reads the ring with ``process_vm_readv`` as it polls (the same
proof and permission as the same-node engine: it already reads this process's memory).

The ring is a convenience, never the only carrier: every record is sent as a frame as well,
and the decode drops the frame of a request it already took from the ring. A ring the decode
fell behind on (overwritten before it read it), or one holding anything but whole records, is
given up and the frames carry on alone. Its records are parsed as frames' payloads are, with
the same bounds.

Layout: a little-endian u64 count of bytes ever written (the head), then ``size`` bytes of
records, each a u32 length and the payload, padded to 8 bytes; a zero length says the rest up
to the ring's end is skipped. The head is written after the record it covers.
"""

from __future__ import annotations

import ctypes
import struct
import threading

from ..errors import FrameError
from ..host.procmem import FewReads
from . import frames

RING_BYTES = 1 << 20
MAX_RING_BYTES = 16 << 20  # what a decode accepts from an offer
_HEAD = struct.Struct("<Q")
_LEN = struct.Struct("<I")


def _padded(n: int) -> int:
    return (n + 7) & ~7


class Mailbox:
    """Prefill side: one ring for one decode, written by ``post``."""

    def __init__(self, size: int = RING_BYTES):
        self.size = size
        self._buf = ctypes.create_string_buffer(_HEAD.size + size)
        self._base = ctypes.addressof(self._buf)
        self._head = 0
        self._lock = threading.Lock()

    def offer(self) -> dict:
        return {"mailbox": [self._base, self.size]}

    def post(self, payload: bytes) -> bool:
        """Write one record; False (nothing written) when it would take over half the ring:
        its frame alone carries it."""
        n = _padded(_LEN.size + len(payload))
        if n > self.size // 2:
            return False
        with self._lock:
            at = self._head % self.size
            if at + n > self.size:  # the end's rest (8 bytes or more) is skipped
                ctypes.memmove(self._base + _HEAD.size + at, _LEN.pack(0), _LEN.size)
                self._head += self.size - at
                at = 0
            ctypes.memmove(self._base + _HEAD.size + at, _LEN.pack(len(payload)) + payload,
                           _LEN.size + len(payload))
            self._head += n
            ctypes.memmove(self._base, _HEAD.pack(self._head), _HEAD.size)  # after the record
        return True


class MailboxReader:
    """Decode side: the records a same-node prefill wrote since the last ``read``."""

    def __init__(self, pid: int, address: int, size: int):
        self.pid, self.address, self.size = pid, address, size
        self.tail = 0
        self._head = ctypes.create_string_buffer(_HEAD.size)
        self._ring = ctypes.create_string_buffer(size)
        self._reads = FewReads(pid)
        self._view = memoryview(self._ring).cast("B")  # records are cut from it, never all of it

    @classmethod
    def from_offer(cls, pid: int, offer: dict) -> "MailboxReader | None":
        """The reader of the ring an offer names, or None when it names none or a bad one."""
        ref = offer.get("mailbox")
        if not (isinstance(ref, list) and len(ref) == 2 and
                all(type(v) is int and v > 0 for v in ref)):
            return None
        address, size = ref
        if size > MAX_RING_BYTES or size % 8:
            return None
        return cls(pid, address, size)

    def _read_head(self) -> int:
        self._reads.read(((ctypes.addressof(self._head), self.address, _HEAD.size),))
        return _HEAD.unpack(self._head.raw)[0]

    def read(self) -> list:
        """The messages written since the last call (parsed as frames' payloads), in order.
        Raises FrameError when the ring cannot be trusted any more: the writer lapped us, or
        it holds something other than whole records; OSError when it cannot be read."""
        head = self._read_head()
        if head == self.tail:
            return []
        if head < self.tail or head - self.tail > self.size:
            raise FrameError(f"the ring's head moved from {self.tail} to {head}: it was "
                             f"overwritten before it was read, or is not a ring")
        start, end = self.tail % self.size, head % self.size or self.size
        pieces = ([(start, end - start)] if start < end else
                  [(start, self.size - start), (0, end)])
        base = ctypes.addressof(self._ring)
        self._reads.read([(base + at, self.address + _HEAD.size + at, n) for at, n in pieces])
        if self._read_head() - self.tail > self.size:  # lapped while we read: torn records
            raise FrameError("the ring was overwritten while it was read")
        ring, messages, at = self._view, [], self.tail
        while at < head:
            off = at % self.size
            if self.size - off < _LEN.size:
                raise FrameError(f"a record starts {self.size - off} bytes before the ring's end")
            (n,) = _LEN.unpack_from(ring, off)
            if n == 0:  # the rest of the ring is skipped
                at += self.size - off
                continue
            whole = _padded(_LEN.size + n)
            if off + whole > self.size or at + whole > head:
                raise FrameError(f"a record of {n} bytes runs past what was written")
            messages.append(frames.parse_payload(bytes(ring[off + _LEN.size:off + _LEN.size + n])))
            at += whole
        self.tail = head
        return messages
