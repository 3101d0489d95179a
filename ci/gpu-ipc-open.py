"""What opening another process's CUDA memory costs, by the allocation's size and by the GPU
that opens it: the bound of a NIXL connect's first READs across GPUs. UCX's cuda_ipc maps a
peer's memory inside the post of the first transfer that touches it (kvruntime/prefill/warm.py);
on 2 x H200 a connect to a 1.25 GiB cache showed that READ at ~10 ms and the 256 MiB pool's
first READ at ~9.4 ms (`python3 -m kvruntime.tools.timeline --device cuda --mib 1024
--device-ids 0 1`). Two processes, no UCX, no NIXL: the exporter allocates with cudaMalloc on
GPU 0 (a fresh allocation for each open, so no driver cache answers) and sends each one's
cudaIpcMemHandle; this process opens it (cudaIpcOpenMemHandle with lazy peer access, as UCX
does) on each GPU of ``--open-on``, timed, then copies one byte out of it (the first access),
timed, and closes it. Prints one JSON object: milliseconds, medians of ``--iters``. CI has no
GPU: BENCHMARKS.md takes the figures.

    python3 ci/gpu-ipc-open.py [--mib 80 256 1280] [--open-on 0 1] [--iters 3]
"""
import argparse
import ctypes
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvruntime.host import cudart  # noqa: E402

LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
D2H = 2  # cudaMemcpyDeviceToHost


class Handle(ctypes.Structure):  # cudaIpcMemHandle_t
    _fields_ = [("reserved", ctypes.c_char * 64)]


def check(err: int, what: str) -> None:
    if err:
        raise SystemExit(f"{what} failed: CUDA error {err}")


def exporter(sizes, count: int, handles, done) -> None:
    """Allocate ``count`` buffers of each size on GPU 0, send their handles, hold them until
    ``done`` says so."""
    lib = cudart.runtime()
    check(lib.cudaSetDevice(0), "cudaSetDevice")
    held = []
    for mib in sizes:
        for _ in range(count):
            ptr, handle = ctypes.c_void_p(), Handle()
            check(lib.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(mib << 20)), "cudaMalloc")
            check(lib.cudaIpcGetMemHandle(ctypes.byref(handle), ptr), "cudaIpcGetMemHandle")
            held.append(ptr)
            handles.put((mib, bytes(handle)))  # all 64 bytes (a field would stop at a NUL)
    handles.put(None)
    done.get()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, nargs="+", default=[80, 256, 1280])
    ap.add_argument("--open-on", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    handles, done = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=exporter, daemon=True,
                       args=(args.mib, args.iters * len(args.open_on), handles, done))
    proc.start()
    lib = cudart.runtime()
    received = []
    while (item := handles.get(timeout=120)) is not None:
        received.append(item)
    one = ctypes.create_string_buffer(1)
    times: dict = {}
    for n, (mib, raw) in enumerate(received):
        device = args.open_on[n % len(args.open_on)]
        check(lib.cudaSetDevice(device), "cudaSetDevice")
        check(lib.cudaFree(None), "cudaFree (the context made)")  # not timed below
        handle, ptr = Handle.from_buffer_copy(raw), ctypes.c_void_p()
        t0 = time.perf_counter()
        check(lib.cudaIpcOpenMemHandle(ctypes.byref(ptr), handle, LAZY_PEER_ACCESS),
              "cudaIpcOpenMemHandle")
        t1 = time.perf_counter()
        check(lib.cudaMemcpy(one, ptr, ctypes.c_size_t(1), D2H), "cudaMemcpy")
        t2 = time.perf_counter()
        check(lib.cudaIpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle")
        t3 = time.perf_counter()
        row = times.setdefault((mib, device), {"open": [], "first_access": [], "close": []})
        row["open"].append((t1 - t0) * 1e3)
        row["first_access"].append((t2 - t1) * 1e3)
        row["close"].append((t3 - t2) * 1e3)
    done.put(True)
    proc.join(30)
    out = {"tool": "gpu-ipc-open", "exported_on": 0, "iters": args.iters, "rows": [
        {"mib": mib, "opened_on": device,
         **{k: round(statistics.median(v), 3) for k, v in row.items()},
         "open_all": [round(x, 3) for x in row["open"]]}
        for (mib, device), row in sorted(times.items())]}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
