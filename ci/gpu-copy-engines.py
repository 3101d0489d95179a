"""Scattered blocks across two GPUs (or within one: ``--devices 0 0``): the copy engines (one
``cudaMemcpyBatchAsync`` of every block, CUDA 12.8+) against kvruntime's gather kernel
(engines/gather.py, the SMs of the source's GPU storing over NVLink), beside one peer copy of
the same bytes in the same run (within one GPU, a device copy). The question it answers: can
the same-node engine's random-block requests (4096 random 256 KiB blocks: 0.90 of the peer
copy with the kernel) reach 0.95 on the copy engines, and from what block size down do the
copy engines lose to the kernel. No NIXL, no side channel, no second process: the bound of
the copy itself. With ``--sweep`` it also times the gather kernel's variants (tile, warps,
cache hints, a persistent grid) at each block size, to show what its shape can still win
(NVLink's stores and one GPU's memory want different shapes). Prints one JSON object
(medians of 9, microseconds).

    python3 ci/gpu-copy-engines.py [--total-mib 1024] [--blocks-kib 256 64 16] [--sweep]
        [--devices SRC DST]
"""
import argparse
import ctypes
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvruntime.host import cudart  # noqa: E402


def check(lib, err: int, what: str) -> None:
    if err:
        raise SystemExit(f"{what} failed: CUDA error {err}")


class _MemLocation(ctypes.Structure):  # cudaMemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):  # cudaMemcpyAttributes (CUDA 12.8+)
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation),
                ("dstLocHint", _MemLocation), ("flags", ctypes.c_uint)]


SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream: the sources read in stream order


class BatchCopy:
    """Many device-to-device copies queued on ``stream`` in one call, run by the copy engines
    (``cudaMemcpyBatchAsync``, CUDA 12.8+; CUDA 13 dropped its ``failIdx`` argument). The
    batch runs in stream order as a whole; its copies in any order among themselves."""

    def __init__(self, stream: int):
        lib = cudart.runtime()
        self.lib = lib
        if lib is None or not hasattr(lib, "cudaMemcpyBatchAsync"):
            raise SystemExit("this CUDA runtime has no cudaMemcpyBatchAsync (12.8+)")
        version = ctypes.c_int()
        check(lib, lib.cudaRuntimeGetVersion(ctypes.byref(version)), "cudaRuntimeGetVersion")
        self.version = version.value
        self.stream = stream
        self._attrs = _MemcpyAttributes(SRC_ACCESS_ORDER_STREAM)
        self._attr_at = (ctypes.c_size_t * 1)(0)
        self._fail = ctypes.c_size_t() if self.version < 13000 else None
        self._sizes = None

    def copy(self, dsts, srcs, nbytes: int) -> None:
        """``nbytes`` from each address of ``srcs`` to the same place of ``dsts`` (numpy uint64
        arrays of one length)."""
        import numpy as np

        n = len(dsts)
        if len(srcs) != n:
            raise SystemExit(f"{n} destinations for {len(srcs)} sources")
        if self._sizes is None or len(self._sizes) < n or self._sizes[0] != nbytes:
            self._sizes = np.full(max(n, 1), nbytes, dtype=np.uint64)
        d = np.ascontiguousarray(dsts, dtype=np.uint64)
        s = np.ascontiguousarray(srcs, dtype=np.uint64)
        args = [ctypes.c_void_p(d.ctypes.data), ctypes.c_void_p(s.ctypes.data),
                ctypes.c_void_p(self._sizes.ctypes.data), ctypes.c_size_t(n),
                ctypes.byref(self._attrs), self._attr_at, ctypes.c_size_t(1)]
        if self._fail is not None:
            args.append(ctypes.byref(self._fail))
        args.append(ctypes.c_void_p(self.stream))
        check(self.lib, self.lib.cudaMemcpyBatchAsync(*args), "cudaMemcpyBatchAsync")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--total-mib", type=int, default=1024)
    ap.add_argument("--blocks-kib", type=int, nargs="+", default=[256, 64, 16])
    ap.add_argument("--iters", type=int, default=9)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--devices", type=int, nargs=2, default=(0, 1), metavar=("SRC", "DST"),
                    help="the source's and the destination's GPU (0 0: a copy within one)")
    args = ap.parse_args()
    if torch.cuda.device_count() <= max(args.devices):
        raise SystemExit(f"needs CUDA devices {args.devices[0]} and {args.devices[1]}")
    a, b = (f"cuda:{i}" for i in args.devices)
    from kvruntime.engines.gather import BlockGather

    total = args.total_mib << 20
    src = torch.randint(0, 255, (total,), dtype=torch.uint8, device=a)
    dst = torch.zeros(total, dtype=torch.uint8, device=b)
    ref = torch.empty(total, dtype=torch.uint8, device=b)
    stream = torch.cuda.Stream(a)
    batch = BatchCopy(stream.cuda_stream)
    out = {"device": torch.cuda.get_device_name(a), "devices": args.devices,
           "total_mib": args.total_mib,
           "runtime": batch.version, "rows": []}

    def timed(f) -> float:
        times = []
        for _ in range(args.iters):
            for d in (a, b):
                torch.cuda.synchronize(d)
            t = time.perf_counter()
            f()
            for d in (a, b):
                torch.cuda.synchronize(d)
            times.append((time.perf_counter() - t) * 1e6)
        return round(sorted(times)[len(times) // 2], 1)

    def peer_copy():
        with torch.cuda.stream(stream):
            ref.copy_(src, non_blocking=True)

    for kib in args.blocks_kib:
        size = kib << 10
        n = total // size
        g = torch.Generator().manual_seed(kib)
        src_ids, dst_ids = torch.randperm(n, generator=g), torch.randperm(n, generator=g)
        gather = BlockGather([src], [dst], size, n, n, stream)
        with torch.cuda.device(a), torch.cuda.stream(stream):
            gather.warm()

        class Plan:  # the two id lists a plan hands the gather, many runs
            num_runs = n

            @staticmethod
            def block_ids():
                return src_ids.numpy(), dst_ids.numpy()

        def kernel():
            with torch.cuda.device(a), torch.cuda.stream(stream):
                gather.copy(Plan)

        s0, d0 = src.data_ptr(), dst.data_ptr()
        srcs = (s0 + src_ids.numpy().astype("uint64") * size)
        dsts = (d0 + dst_ids.numpy().astype("uint64") * size)

        def engines():
            batch.copy(dsts, srcs, size)

        row = {"block_kib": kib, "blocks": n, "peer_copy_us": timed(peer_copy)}
        dst.zero_()
        row["kernel_us"] = timed(kernel)
        ok_k = bool(torch.equal(dst.view(n, size)[dst_ids.to(dst.device)].cpu(),
                                src.view(n, size)[src_ids.to(src.device)].cpu()))
        dst.zero_()
        host = time.perf_counter()
        engines()
        row["batch_call_us"] = round((time.perf_counter() - host) * 1e6, 1)
        row["copy_engines_us"] = timed(engines)
        ok_b = bool(torch.equal(dst.view(n, size)[dst_ids.to(dst.device)].cpu(),
                                src.view(n, size)[src_ids.to(src.device)].cpu()))
        row["peer_copy_us"] = min(row["peer_copy_us"], timed(peer_copy))  # before and after
        row["kernel_ratio"] = round(row["peer_copy_us"] / row["kernel_us"], 3)
        row["copy_engines_ratio"] = round(row["peer_copy_us"] / row["copy_engines_us"], 3)
        row["bit_exact"] = {"kernel": ok_k, "copy_engines": ok_b}
        out["rows"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        if args.sweep:
            out.setdefault("sweep", {})[kib] = sweep(src, dst, size, n, src_ids, dst_ids,
                                                     stream, timed, row["peer_copy_us"])
    print(json.dumps(out, indent=1))


def sweep(src, dst, size, n, src_ids, dst_ids, stream, timed, reference) -> list:
    """The gather kernel's shapes: one program a tile of a block (as engines/gather.py), or a
    persistent grid of a few programs per SM walking the tiles; each with and without
    streaming cache hints. GPU time beside the peer copy, and bit-exactness."""
    import triton
    import triton.language as tl

    @triton.jit
    def tiled(src, dst, ids, dst_at, words, TILE: tl.constexpr, HINT: tl.constexpr):
        i = tl.program_id(0)
        s = tl.load(ids + i).to(tl.int64)
        d = tl.load(ids + dst_at + i).to(tl.int64)
        offs = tl.program_id(1) * TILE + tl.arange(0, TILE)
        mask = offs < words
        if HINT:
            v = tl.load(src + s * words + offs, mask=mask, eviction_policy="evict_first")
            tl.store(dst + d * words + offs, v, mask=mask, cache_modifier=".cs")
        else:
            v = tl.load(src + s * words + offs, mask=mask)
            tl.store(dst + d * words + offs, v, mask=mask)

    @triton.jit
    def persistent(src, dst, ids, dst_at, words, n, tiles, TILE: tl.constexpr,
                   HINT: tl.constexpr):
        for w in tl.range(tl.program_id(0), n * tiles, tl.num_programs(0)):
            i = w // tiles
            s = tl.load(ids + i).to(tl.int64)
            d = tl.load(ids + dst_at + i).to(tl.int64)
            offs = (w % tiles) * TILE + tl.arange(0, TILE)
            mask = offs < words
            if HINT:
                v = tl.load(src + s * words + offs, mask=mask, eviction_policy="evict_first")
                tl.store(dst + d * words + offs, v, mask=mask, cache_modifier=".cs")
            else:
                v = tl.load(src + s * words + offs, mask=mask)
                tl.store(dst + d * words + offs, v, mask=mask)

    words = size // 8
    sw, dw = src.view(torch.int64), dst.view(torch.int64)
    ids = torch.cat([src_ids, dst_ids]).to(src.device)
    sms = torch.cuda.get_device_properties(src.device).multi_processor_count
    rows = []
    cases = [("tiled", t, w, h, 0) for t in (1024, 2048, 4096, 8192) for w in (4, 8, 16)
             for h in (0, 1) if t <= words]
    cases += [("persistent", t, w, 0, k) for t in (2048, 4096) for w in (8, 16)
              for k in (2, 4, 8) if t <= words]
    for kind, tile, warps, hint, per_sm in cases:
        tiles = -(-words // tile)

        def run():
            with torch.cuda.device(src.device), torch.cuda.stream(stream):
                if kind == "tiled":
                    tiled[(n, tiles)](sw, dw, ids, n, words, TILE=tile, HINT=hint,
                                      num_warps=warps)
                else:
                    persistent[(sms * per_sm,)](sw, dw, ids, n, words, n, tiles, TILE=tile,
                                                HINT=hint, num_warps=warps)
        try:
            dst.zero_()
            us = timed(run)
            ok = bool(torch.equal(dst.view(n, size)[dst_ids.to(dst.device)].cpu(),
                                  src.view(n, size)[src_ids.to(src.device)].cpu()))
        except Exception as exc:  # a shape this Triton cannot compile: said, not fatal
            rows.append({"kind": kind, "tile": tile, "warps": warps, "hint": hint,
                         "error": str(exc)[-300:]})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            continue
        rows.append({"kind": kind, "tile": tile, "warps": warps, "hint": hint,
                     "programs_per_sm": per_sm, "us": us,
                     "ratio": round(reference / us, 3), "bit_exact": ok})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


if __name__ == "__main__":
    main()
