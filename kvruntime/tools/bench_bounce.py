"""The staged copies alone, per bounce-slot size: gather of random blocks (device cache -> pinned
pool) and scatter back, beside one contiguous pinned copy of the same bytes in the same run, and
where a gather's time goes (host: ids as int64 numpy, the fills' views, queueing the whole
call, the ids' upload included; device: how long the copy stream is busy, from just before the
call is queued to its last copy).

    python3 -m kvruntime.tools.bench_bounce [--device cuda] [--mib 1024] [--slots-mib 4 16 32 64]

Prints one JSON object per (layout, slot size)."""

from __future__ import annotations

import json
import math
import random
import statistics
import time

from .cli import UNUSABLE, Parser


def _timeline(pool, blocks, iters: int) -> dict:
    """Medians over ``iters`` gathers of all heads of ``blocks`` into the pool's first run."""
    import torch

    from ..pools.bounce import pieces

    mod = getattr(torch, pool._device[0].device.type)
    rows = {"ids_us": [], "fills_us": [], "queue_us": [], "copy_stream_ms": [], "call_ms": []}
    for _ in range(iters + 1):
        mod.synchronize()
        t0 = time.perf_counter()
        ids = pool.ids(blocks)
        t1 = time.perf_counter()
        hs = pool.device_layout.num_kv_heads
        run, shape, regions = pool._run_flat(0, len(ids), hs), pool._row_shape(hs), pool._regions()
        fills = pieces(range(len(regions)), len(ids), math.prod(shape), pool._ring.slot_words)
        t2 = time.perf_counter()
        first, last = mod.Event(enable_timing=True), mod.Event(enable_timing=True)
        first.record(pool._ring.streams.copy_stream)
        pool._ring.gather(fills, regions, ids, run, shape)
        t3 = time.perf_counter()
        last.record(pool._ring.streams.copy_stream)
        last.synchronize()
        t4 = time.perf_counter()
        for key, value in (("ids_us", (t1 - t0) * 1e6), ("fills_us", (t2 - t1) * 1e6),
                           ("queue_us", (t3 - t2) * 1e6), ("call_ms", (t4 - t0) * 1e3),
                           ("copy_stream_ms", first.elapsed_time(last))):
            rows[key].append(value)
    return {k: round(statistics.median(v[1:]), 3) for k, v in rows.items()}


def main(argv=None) -> int:
    import numpy as np

    from ..memory import KVCache, device_unavailable
    from ..pools.staging import StagingPool
    from .bench import BenchConfig, _staging_copies
    from .workload import bench_layout

    ap = Parser(prog="python -m kvruntime.tools.bench_bounce", description=__doc__)
    ap.add_argument("--device", default="cuda", choices=["cuda", "xpu"])
    ap.add_argument("--mib", type=int, default=1024, help="bytes a request moves (MiB)")
    ap.add_argument("--slots-mib", type=int, nargs="+", default=[4, 16, 32, 64])
    ap.add_argument("--layouts", nargs="+", default=["cross_layer", "per_layer"],
                    choices=["cross_layer", "per_layer"])
    ap.add_argument("--iters", type=int, default=7)
    args = ap.parse_args(argv)
    if any(m < 1 for m in (args.mib, args.iters, *args.slots_mib)):
        ap.error("--mib, --iters and --slots-mib take positive integers")
    why = device_unavailable(args.device)
    if why:
        print(f"bench_bounce: no {args.device} device here: {why}")
        return UNUSABLE
    cfg = BenchConfig(sizes_mib=[args.mib], iters=args.iters, device=args.device)
    for kind in args.layouts:
        layout = bench_layout(kind, cfg.block_kib, args.mib)
        cache = KVCache.allocate_device(layout, args.device, 0)
        count = (args.mib << 20) // layout.block_bytes
        for mib in args.slots_mib:
            pool = StagingPool(layout, count + 1, cache, bounce_bytes=mib << 20)
            try:
                row = {"slot_mib": mib, **_staging_copies(pool, layout, random.Random(7), cfg)}
                blocks = np.array(random.Random(8).sample(range(layout.num_blocks), count))
                row["gather_timeline"] = _timeline(pool, blocks, args.iters)
            finally:
                pool.close()
            print(json.dumps(row), flush=True)
        cache.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
