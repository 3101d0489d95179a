"""The few CUDA runtime calls kvruntime makes itself, through ctypes on the runtime torch loaded:
async copies and events on streams given by handle, block id uploads (IdUploads), torch's
current stream set cheaply with the caller's stream ordered first (StreamScope), and peer
access.

Each call costs ~1 µs. Through torch's Python layer an event, a stream switch or a small copy
costs 10-40 µs on a slow host (H100 VM: 20-35 µs a ``torch.cuda.stream()`` context), and a
staged gather of 1 GiB makes ~130 of them, the first ones before its first PCIe copy starts.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading

from ..errors import KVRuntimeError

MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction from the pointers (unified addressing)
EVENT_DISABLE_TIMING = 2
NOT_READY = 600  # cudaErrorNotReady
PEER_ALREADY_ENABLED = 704

_lib = None
_lock = threading.Lock()

_SIGNATURES = {
    "cudaMemcpyAsync": (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                        ctypes.c_void_p),
    "cudaEventCreateWithFlags": (ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint),
    "cudaEventRecord": (ctypes.c_void_p, ctypes.c_void_p),
    "cudaStreamWaitEvent": (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint),
    "cudaEventSynchronize": (ctypes.c_void_p,),
    "cudaEventQuery": (ctypes.c_void_p,),
    "cudaEventDestroy": (ctypes.c_void_p,),
    "cudaDeviceEnablePeerAccess": (ctypes.c_int, ctypes.c_uint),
    "cudaGetLastError": (),
    "cudaGetErrorName": (ctypes.c_int,),
}


def runtime():
    """libcudart, the copy torch already loaded (dlopen by soname returns it) else the wheel's;
    None when there is none."""
    global _lib
    with _lock:
        if _lib is None:
            import torch

            for name in _candidates(torch):
                try:
                    lib = ctypes.CDLL(name)
                except OSError:
                    continue
                for fn, args in _SIGNATURES.items():
                    getattr(lib, fn).argtypes = args
                lib.cudaGetErrorName.restype = ctypes.c_char_p
                _lib = lib
                break
        return _lib


def _candidates(torch):
    """The sonames first (torch's own copy, already loaded: no search), then the wheels' files
    beside torch, searched only if no soname loads (the search cost ~6 ms of a first connect)."""
    yield from ("libcudart.so.13", "libcudart.so.12", "libcudart.so")
    libdir = os.path.join(os.path.dirname(torch.__file__), "..", "nvidia")
    yield from glob.glob(os.path.join(libdir, "**", "libcudart.so*"), recursive=True)


def _check(err: int, what: str) -> None:
    if err:
        _lib.cudaGetLastError()  # cleared, as torch does: its next launch check would raise it
        name = _lib.cudaGetErrorName(err).decode(errors="replace")
        raise KVRuntimeError(f"{what} failed: {name} (CUDA error {err})")


def copy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """``nbytes`` from address ``src`` to ``dst`` (device or pinned host) queued on ``stream``."""
    _check(_lib.cudaMemcpyAsync(dst, src, nbytes, MEMCPY_DEFAULT, stream), "cudaMemcpyAsync")


def wait(stream: int, event: "Event") -> None:
    """Work queued on ``stream`` after this starts once ``event``'s last record has passed."""
    _check(_lib.cudaStreamWaitEvent(stream, event.handle, 0), "cudaStreamWaitEvent")


class Event:
    """A CUDA event without timing, created on the current device (that of the streams it is
    recorded on). Re-recording it is allowed: a wait queued earlier keeps the record it saw."""

    def __init__(self):
        if runtime() is None:
            raise KVRuntimeError("no CUDA runtime library found for kvruntime's copy streams")
        handle = ctypes.c_void_p()
        _check(_lib.cudaEventCreateWithFlags(ctypes.byref(handle), EVENT_DISABLE_TIMING),
               "cudaEventCreateWithFlags")
        self.handle = handle.value

    def record(self, stream: int) -> "Event":
        _check(_lib.cudaEventRecord(self.handle, stream), "cudaEventRecord")
        return self

    def synchronize(self) -> None:
        """Until the last record has passed (that stream's work only, never the device)."""
        _check(_lib.cudaEventSynchronize(self.handle), "cudaEventSynchronize")

    def query(self) -> bool:
        err = _lib.cudaEventQuery(self.handle)
        if err == NOT_READY:
            _lib.cudaGetLastError()  # not an error; cleared as torch's own query does
            return False
        _check(err, "cudaEventQuery")
        return True

    def __del__(self):
        if self.__dict__.get("handle") and _lib is not None:
            _lib.cudaEventDestroy(self.handle)


def enable_peer_access(device, peer) -> str | None:
    """cudaDeviceEnablePeerAccess(peer) from ``device``'s context; None when it is on, else why
    not."""
    import torch

    if not torch.cuda.can_device_access_peer(device.index, peer.index):
        return "the devices cannot access each other"
    lib = runtime()
    if lib is None:
        return "no CUDA runtime library found to enable it"
    with torch.cuda.device(device):
        torch.cuda.current_stream(device)  # the context exists
        err = lib.cudaDeviceEnablePeerAccess(peer.index, 0)
        lib.cudaGetLastError()  # clear it: torch's next check would raise "already enabled"
    if err in (0, PEER_ALREADY_ENABLED):
        return None
    return f"cudaDeviceEnablePeerAccess returned {err}"


def context_active(index: int) -> bool | None:
    """Whether this process holds the primary CUDA context of visible GPU ``index`` already
    (the driver's cuDevicePrimaryCtxGetState); None when the driver cannot say. Work there
    then costs no new context (hundreds of MiB of that GPU's memory, tens of ms)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    device, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    if lib.cuDeviceGet(ctypes.byref(device), ctypes.c_int(index)) != 0:
        return None
    if lib.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active)) != 0:
        return None
    return bool(active.value)


class IdUploads:
    """Block id arrays to the device with no allocation and no torch call per request, for
    the work of one stream (``stream``, a torch CUDA stream): ``SLOTS`` pinned host buffers
    (written through numpy) and a device buffer each. An upload is one cudaMemcpyAsync on that
    stream, so a device buffer is rewritten (``SLOTS`` uploads later) only after the work that
    read it; a host buffer once its upload has passed (an event). Each array starts 16-byte
    aligned (one Triton specialization whatever the lengths).

    torch's own upload of a numpy array (a pageable copy) is staged by the driver, which may
    first wait for the stream's queued work, and with its allocation and stream bookkeeping it
    cost 0.17-0.38 ms on the H100 VM."""

    SLOTS, CAPACITY = 8, 1 << 17

    def __init__(self, device, stream):
        import torch

        self.device = device
        self._stream = stream
        self._handle = stream.cuda_stream
        # one pinned allocation sliced into the slots: a pin_memory a slot cost ~5 ms each
        # (43 ms of a 54 ms same-node connect on the H100 host), one for all about one of them;
        # the process's first one 16 ms more, paid at a client's start (prepare_uploads)
        pinned = _take_pinned(self.SLOTS * self.CAPACITY)
        self._host = list(pinned.view(self.SLOTS, self.CAPACITY))
        self._host_np = [h.numpy() for h in self._host]
        self._dev = torch.empty(self.SLOTS, self.CAPACITY, dtype=torch.int64, device=device)
        self._dev_slots = list(self._dev)
        self._dev_ptrs = [t.data_ptr() for t in self._dev_slots]
        self._host_ptrs = [h.data_ptr() for h in self._host]
        with torch.cuda.device(device):
            self._sent = [Event() for _ in range(self.SLOTS)]
        self._used = [False] * self.SLOTS
        self._next = 0

    def upload(self, *arrays) -> tuple:
        """Int64 numpy arrays -> ``(buffer, offsets)``: a device tensor holding array k at
        ``offsets[k]``, for work queued on the stream after this (no slicing here: a torch
        slice costs 4-10 µs on a slow host, and a kernel takes the buffer and an offset). A
        set larger than a slot goes up through torch, on the stream."""
        import numpy as np
        import torch

        at, total = [], 0
        for a in arrays:
            at.append(total)
            total += (len(a) + 1) & ~1
        if total > self.CAPACITY:
            host = np.empty(total, dtype=np.int64)
            for a, o in zip(arrays, at):
                host[o:o + len(a)] = a
            with StreamScope(self._stream):
                return torch.from_numpy(host).to(self.device, non_blocking=True), at
        i = self._take()
        host = self._host_np[i]
        for a, o in zip(arrays, at):
            host[o:o + len(a)] = a
        self._send(i, self._dev_ptrs[i], total)
        return self._dev_slots[i], at

    def upload_owned(self, array):
        """An int64 numpy array -> a device tensor of its own, for work queued on the stream
        after this, however long after: torch's allocator gives it (on the stream, so it is
        reused only after the stream's work that reads it), one cudaMemcpyAsync from a pinned
        slot fills it. For ids a request keeps across many polls (a staging pool's), which a
        device slot, rewritten ``SLOTS`` uploads later, would not keep. Called with the stream
        current (a StreamScope of it: the tensor is allocated for the stream that reads it)."""
        import torch

        n = len(array)
        if n > self.CAPACITY:
            return torch.from_numpy(array).to(self.device, non_blocking=True)
        dev = torch.empty(n, dtype=torch.int64, device=self.device)
        i = self._take()
        self._host_np[i][:n] = array
        self._send(i, dev.data_ptr(), n)
        return dev

    def _take(self) -> int:
        """The next pinned slot, its last upload passed (it has left the host buffer)."""
        i, self._next = self._next, (self._next + 1) % self.SLOTS
        if self._used[i]:
            self._sent[i].synchronize()
        return i

    def _send(self, i: int, dst: int, words: int) -> None:
        copy_async(dst, self._host_ptrs[i], words * 8, self._handle)
        self._sent[i].record(self._handle)
        self._used[i] = True


_spare_pinned = None  # prepare_uploads' allocation, for the next IdUploads


def _take_pinned(words: int):
    global _spare_pinned
    import torch

    with _lock:
        spare, _spare_pinned = _spare_pinned, None
    if spare is not None and spare.numel() == words:
        return spare
    return torch.empty(words, dtype=torch.int64, pin_memory=True)


def prepare_uploads() -> None:
    """What the first IdUploads of this process would pay, paid now (a decode client's start):
    the CUDA runtime loaded here and the first pinned allocation (16 ms of a 46 ms first
    same-node connect on the H100 host), kept for that IdUploads."""
    global _spare_pinned
    import torch

    if runtime() is None:
        raise KVRuntimeError("no CUDA runtime library found for kvruntime's copy streams")
    with _lock:
        if _spare_pinned is not None:
            return
    pinned = torch.empty(IdUploads.SLOTS * IdUploads.CAPACITY, dtype=torch.int64,
                         pin_memory=True)
    with _lock:
        if _spare_pinned is None:
            _spare_pinned = pinned


_SETTERS = ("_cuda_getCurrentRawStream", "_cuda_getCurrentStream", "_cuda_setStream",
            "_cuda_getDevice", "_cuda_setDevice")
_fast_scope: bool | None = None  # this torch has all of _SETTERS (looked up once)


class StreamScope:
    """``with StreamScope(stream) as scope:`` torch's current CUDA stream (and device) is
    ``stream``, the previous ones restored after; ``scope.caller`` is the handle of the stream
    that was current on that device before. Through torch's own setters where this torch has
    them: ``torch.cuda.stream()`` resolves device indices in Python, 20-80 µs a use on the H100
    VM, where a request's whole GPU time can be 25 µs. Else through ``torch.cuda.stream``.
    ``caller_device``: the device whose current stream is the caller's, when that is not the
    stream's (work that runs on the GPU holding the memory it reads, for a caller on
    another). One use at a time per object."""

    __slots__ = ("_stream", "_ids", "_caller_device", "_prev", "_prev_device", "_ctx", "caller")

    def __init__(self, stream, caller_device: int | None = None):
        self._stream = stream
        self._ids = (stream.stream_id, stream.device_index, stream.device_type)
        self._caller_device = stream.device_index if caller_device is None else caller_device
        self._ctx = None

    def __enter__(self) -> "StreamScope":
        global _fast_scope
        import torch

        c = torch._C
        if _fast_scope is None:
            _fast_scope = all(hasattr(c, f) for f in _SETTERS)
        if not _fast_scope:
            self.caller = torch.cuda.current_stream(self._caller_device).cuda_stream
            self._ctx = torch.cuda.stream(self._stream)
            self._ctx.__enter__()
            return self
        device = self._ids[1]
        self.caller = c._cuda_getCurrentRawStream(self._caller_device)
        self._prev_device = c._cuda_getDevice()
        self._prev = c._cuda_getCurrentStream(device)
        c._cuda_setStream(*self._ids)  # sets the device to the stream's as well
        return self

    def __exit__(self, *exc):
        import torch

        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            return ctx.__exit__(*exc)
        c = torch._C
        c._cuda_setStream(*self._prev)
        if self._prev_device != self._ids[1]:
            c._cuda_setDevice(self._prev_device)
        return False

    def after_caller(self, event: Event, *streams: int) -> None:
        """Work queued next on ``streams`` (handles) starts after what ``caller`` had queued
        when the scope began (``event`` is re-recorded for it). Called inside the scope: its
        device is current there, and a caller handle of 0 (the legacy default stream) means
        the *current* device's default stream to the runtime (on 2 GPUs, recorded outside it,
        that was another device's: cudaErrorInvalidResourceHandle). With a ``caller_device``
        ``event`` is that device's, and recorded with it current."""
        if self._caller_device == self._ids[1]:
            event.record(self.caller)
        else:
            import torch

            with torch.cuda.device(self._caller_device):
                event.record(self.caller)
        for s in streams:
            wait(s, event)
