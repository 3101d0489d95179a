"""Reading another process's memory on this host: ``process_vm_readv`` through ctypes.

The kernel checks exactly what ``ptrace`` would (same user, or the capability, and the Yama
scope), so a read that succeeds proves the reader may read that process. The same-node engine
copies a prefill's host regions with ``read_remote`` (samenode.py); a decode polls a prefill's
ready ring with ``FewReads`` (mailbox.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import numpy as np

IOV_MAX = 1024  # iovecs one process_vm_readv takes at most (Linux's UIO_MAXIOV)


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_readv = getattr(_libc, "process_vm_readv", None)
if _readv is not None:
    _readv.restype = ctypes.c_ssize_t
    _readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                       ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.c_ulong]


def read_remote(pid: int, local, remote, lengths) -> int:
    """Copy ``lengths[i]`` bytes from address ``remote[i]`` of process ``pid`` to our address
    ``local[i]`` (uint64 arrays, or anything numpy reads as them). Returns the bytes copied;
    raises OSError with the kernel's reason."""
    if _readv is None:
        raise OSError("process_vm_readv is not available in this C library")
    n = len(lengths)
    # struct iovec {void *base; size_t len;} x n, written by numpy, not one Python step a piece
    iov = np.empty((2, n, 2), dtype=np.uint64)
    iov[0, :, 0], iov[1, :, 0] = local, remote
    iov[:, :, 1] = lengths
    base = iov.ctypes.data
    done = 0
    for i in range(0, n, IOV_MAX):
        k = min(IOV_MAX, n - i)
        want = int(iov[0, i:i + k, 1].sum())
        local_p = ctypes.cast(base + i * 16, ctypes.POINTER(_IOVec))
        remote_p = ctypes.cast(base + (n + i) * 16, ctypes.POINTER(_IOVec))
        got = _readv(pid, local_p, k, remote_p, k, 0)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)}")
        if got != want:  # a partial read: the kernel stops at the first bad remote range
            raise OSError(f"process_vm_readv from pid {pid} copied {got} of {want} bytes")
        done += got
    return done


class FewReads:
    """``process_vm_readv`` of at most ``n`` ranges of process ``pid``, its iovecs made once:
    one system call and no numpy, for a poll that reads a few bytes (a ring's head: mailbox.py),
    where ``read_remote``'s set-up alone costs ~10 µs."""

    def __init__(self, pid: int, n: int = 2):
        if _readv is None:
            raise OSError("process_vm_readv is not available in this C library")
        self.pid = pid
        self._local, self._remote = (_IOVec * n)(), (_IOVec * n)()

    def read(self, ranges) -> None:
        """``ranges``: (our address, its address, bytes) each; raises OSError unless all
        of them were copied whole."""
        want = 0
        for i, (local, remote, length) in enumerate(ranges):
            self._local[i].iov_base, self._local[i].iov_len = local, length
            self._remote[i].iov_base, self._remote[i].iov_len = remote, length
            want += length
        got = _readv(self.pid, self._local, len(ranges), self._remote, len(ranges), 0)
        if got != want:
            err = ctypes.get_errno() if got < 0 else 0
            raise OSError(err, f"process_vm_readv from pid {self.pid} copied {got} of {want} "
                               f"bytes{': ' + os.strerror(err) if err else ''}")
