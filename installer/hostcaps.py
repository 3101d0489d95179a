"""What this host lets a process do that verification depends on, asked of the kernel directly."""
from __future__ import annotations

import ctypes
import os


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def cross_memory_denied() -> str | None:
    """None when process_vm_writev works here (UCX's own test before it offers its cma transport),
    else why not. Docker's default seccomp profile refuses it without CAP_SYS_PTRACE."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.process_vm_writev
    except (OSError, AttributeError):
        return "this C library has no process_vm_writev"
    fn.restype = ctypes.c_ssize_t
    src, dst = ctypes.create_string_buffer(b"kvstack!", 8), ctypes.create_string_buffer(8)
    local, remote = _IOVec(ctypes.addressof(src), 8), _IOVec(ctypes.addressof(dst), 8)
    n = fn(
        os.getpid(),
        ctypes.byref(local),
        ctypes.c_ulong(1),
        ctypes.byref(remote),
        ctypes.c_ulong(1),
        ctypes.c_ulong(0),
    )
    if n == 8 and dst.raw == b"kvstack!":
        return None
    err = ctypes.get_errno()
    return (
        f"process_vm_writev is refused here ({os.strerror(err) if err else 'short write'}): in a "
        "container, the default seccomp profile allows it only with CAP_SYS_PTRACE (docker run "
        "--cap-add SYS_PTRACE)"
    )
