"""``python -m kvruntime bench --tp-pairs PxD,...``: mixed tensor-parallel pulls, direct and
host-staged, beside a same-run reference.

For each pair, one process serves the p prefill ranks (a cache each, ``bench_layout``'s shape
with the model's 8 KV heads split over them); this process is decode rank 0 of TP d, with its
own cache of 8/d heads. One request pulls random blocks: from every prefill rank that holds
some of rank 0's heads at once (``start_pull`` on each, then ``wait_all``). Direct moves one
NIXL descriptor per token row of each block's head slice; staged gathers head-major into the
prefill's pool, moves one run, and scatters. The reference copies the same bytes as one
contiguous copy (host memmove, or a device copy), timed beside every request.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import random
import statistics
import time

from ..layout import CROSS_LAYER
from .references import DeviceReference, HostReference
from .workload import bench_layout, pick_blocks

# direct: one NIXL descriptor a token row of each head slice (or the same-node engine where it
# moves head slices); coalesced: NIXL forced, through both sides' staging pools (coalesce.py)
MODES = ("direct", "coalesced", "host_staged")


def tp_layout(cfg, tp: int, max_mib: int):
    full = bench_layout(CROSS_LAYER, cfg.block_kib, max_mib)
    return dataclasses.replace(full, num_kv_heads=full.num_kv_heads // tp, tp_size=tp)


def run_tp(cfg, pairs, binding) -> list[dict]:
    from ..decode import DecodeClient
    from .roles import allocate_cache, prefill_main, reap
    from ..tp import head_slices

    rows = []
    size = max(cfg.sizes_mib)
    rnd = random.Random(cfg.seed)
    full = bench_layout(CROSS_LAYER, cfg.block_kib, size)
    count = max(1, (size << 20) // full.block_bytes)
    for p, d in pairs:
        for mode in MODES:
            staged = mode == "host_staged"
            options = {"nixl_module": cfg.nixl_module, "huge": cfg.huge_pages,
                       "device": cfg.device, "tp_ranks": list(range(p)),
                       "kv_buffer": mode if staged else "device",
                       "staging_blocks": count + 1}
            pre = tp_layout(cfg, p, size)
            ctx = mp.get_context("spawn")
            ready_q, control = ctx.Queue(), ctx.Queue()
            proc = ctx.Process(target=prefill_main, name="prefill", daemon=True,
                               args=(ready_q, control, [pre.to_dict()] * p, cfg.seed,
                                     {**options, "device_id": cfg.device_ids[0]}))
            cache = client = reference = None
            row = {"tp": [p, d], "kv_buffer": mode, "decode_rank": 0, "memory": "DRAM"
                   if cfg.device == "cpu" else "VRAM", "blocks": count}
            try:
                proc.start()
                ready = ready_q.get(timeout=300)
                if not ready.get("ok"):
                    raise RuntimeError(ready.get("error"))
                cache = allocate_cache(tp_layout(cfg, d, size),
                                       {**options, "device_id": cfg.device_ids[1]})
                client = DecodeClient(cache, binding=binding, device_kind=cfg.device,
                                      kv_buffer=options["kv_buffer"],
                                      staging_blocks=options["staging_blocks"], tp_rank=0,
                                      **({"engine": "nixl", "coalesce": "always"}
                                         if mode == "coalesced" else {"coalesce": "never"}))
                slices = head_slices(pre, cache.layout, 0)
                peers = [client.connect("127.0.0.1", ready["ports"][s.prefill_rank])
                         for s in slices]
                src, dst = pick_blocks("random", count, pre.num_blocks, rnd)
                nbytes = count * cache.layout.block_bytes  # this rank's heads of each block
                reference = (HostReference(nbytes, cfg.huge_pages) if cfg.device == "cpu"
                             else DeviceReference(nbytes, cfg.device, cfg.device_ids))
                rates, refs, descriptors = [], [], 0
                for i in range(cfg.iters + 1):
                    ref = reference.gbps(nbytes)
                    t = time.perf_counter()
                    results = client.wait_all([peer.start_pull(src, dst, timeout=120)
                                               for peer in peers])
                    seconds = time.perf_counter() - t
                    if i:  # the first: warm-up
                        refs.append(ref)
                        rates.append(sum(r.nbytes for r in results) / seconds / 1e9)
                    descriptors = sum(r.descriptors for r in results)
                gbps, ref = statistics.median(rates), statistics.median(refs)
                row.update(prefill_ranks=[s.prefill_rank for s in slices], bytes=nbytes,
                           descriptors=descriptors, gbps=round(gbps, 3),
                           ref_gbps=round(ref, 3), ref=reference.label,
                           ratio=round(gbps / ref, 3), engine=peers[0].engine,
                           coalesced=results[0].coalesced,
                           transports=client.agent.transports())
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"
            finally:
                if client is not None:
                    client.close()
                if cache is not None:
                    cache.close()
                if reference is not None:
                    reference.close()
                reap(proc, control)
            rows.append(row)
    for pair in pairs:  # staged's and coalesced's against direct, same pair, same run
        got = {r["kv_buffer"]: r for r in rows if r["tp"] == list(pair) and "gbps" in r}
        for mode in ("coalesced", "host_staged"):
            if mode in got and "direct" in got:
                got[mode]["vs_direct"] = round(got[mode]["gbps"] / got["direct"]["gbps"], 3)
    return rows
