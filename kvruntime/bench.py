"""``python -m kvruntime bench``: GB/s, descriptors per request and handshake time.

The decode side runs in this process, the prefill side in a spawned one. Every transfer is
measured beside a reference copy of the same size in the same run (host ``memmove`` between two
buffers with the same page setting), because the CI-class hosts are noisy: compare ratios taken
together, not figures from different runs. Columns follow nixlbench's (block size, batch size,
average latency, bandwidth) plus the reference and the ratio.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

from .layout import KVLayout
from .memory import HostBuffer, thp_mode


@dataclass
class BenchConfig:
    sizes_mib: list = field(default_factory=lambda: [64, 256, 1024])
    patterns: list = field(default_factory=lambda: ["contiguous", "random"])
    layouts: list = field(default_factory=lambda: ["cross_layer", "per_layer"])
    ops: list = field(default_factory=lambda: ["pull", "push"])
    splits: list = field(default_factory=lambda: [1])
    ucx_threads: int = 0
    huge_pages: bool = True
    iters: int = 5
    block_kib: int = 256
    nixl_module: str | None = None
    handshakes: int = 10
    seed: int = 7


def bench_layout(kind: str, block_kib: int, max_mib: int) -> KVLayout:
    """4 layers, 16 tokens, 8 heads, fp16; head_dim sized so a block is ``block_kib`` KiB."""
    page = block_kib * 1024 // 8
    head_dim = max(1, page // (16 * 8 * 2))
    blocks_needed = -(-max_mib * 1024 // block_kib)
    return KVLayout(kind, 4, blocks_needed + blocks_needed // 4 + 1, 16, 8, head_dim, "float16")


def pick_blocks(pattern: str, count: int, num_blocks: int, rnd: random.Random):
    if pattern == "contiguous":
        s0, d0 = rnd.randint(0, num_blocks - count), rnd.randint(0, num_blocks - count)
        return list(range(s0, s0 + count)), list(range(d0, d0 + count))
    return rnd.sample(range(num_blocks), count), rnd.sample(range(num_blocks), count)


def _memcpy_gbps(src: HostBuffer, dst: HostBuffer, nbytes: int) -> float:
    t = time.perf_counter()
    ctypes.memmove(dst.address, src.address, nbytes)
    return nbytes / (time.perf_counter() - t) / 1e9


def run_bench(cfg: BenchConfig) -> dict:
    from .binding import load_nixl
    from .decode import DecodeClient
    from .memory import KVCache
    from .roles import prefill_main, reap

    report: dict = {"tool": "kvruntime bench", "config": asdict(cfg), "thp": thp_mode(),
                    "results": [], "ok": False}
    binding = load_nixl(cfg.nixl_module)
    report["nixl_module"] = binding.module_name
    max_mib = max(cfg.sizes_mib)
    layouts = [bench_layout(k, cfg.block_kib, max_mib) for k in cfg.layouts]
    options = {"nixl_module": cfg.nixl_module, "huge": cfg.huge_pages,
               "ucx_threads": cfg.ucx_threads}
    ctx = mp.get_context("spawn")
    ready_q, control = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=prefill_main, name="prefill", daemon=True,
                       args=(ready_q, control, [l.to_dict() for l in layouts], cfg.seed, options))
    clients = []
    ref_src = ref_dst = None
    try:
        proc.start()
        ready = ready_q.get(timeout=300)
        if not ready.get("ok"):
            report["error"] = ready.get("error")
            return report
        ref_src = HostBuffer(max_mib << 20, cfg.huge_pages)
        ref_dst = HostBuffer(max_mib << 20, cfg.huge_pages)
        ctypes.memset(ref_src.address, 0x5A, max_mib << 20)
        rnd = random.Random(cfg.seed)
        for layout, port in zip(layouts, ready["ports"]):
            cache = KVCache.allocate_host(layout, cfg.huge_pages)
            client = DecodeClient(cache, binding=binding, ucx_threads=cfg.ucx_threads)
            clients.append((client, cache))
            hs = []
            for _ in range(max(1, cfg.handshakes)):
                peer = client.connect("127.0.0.1", port)
                hs.append(peer.handshake_seconds * 1e3)
            report.setdefault("handshake_ms", {})[layout.kind] = {
                "first": round(hs[0], 3),
                "median_later": round(statistics.median(hs[1:]), 3) if len(hs) > 1 else None,
                "all": [round(h, 3) for h in hs]}
            for op in cfg.ops:
                move = peer.pull if op == "pull" else peer.push
                for pattern in cfg.patterns:
                    for size in cfg.sizes_mib:
                        count = max(1, (size << 20) // layout.block_bytes)
                        for split in cfg.splits:
                            src, dst = pick_blocks(pattern, count, layout.num_blocks, rnd)
                            move(src, dst, timeout=120, split=split)  # warm-up
                            rates, refs, lats, res = [], [], [], None
                            for _ in range(cfg.iters):
                                refs.append(_memcpy_gbps(ref_src, ref_dst, count *
                                                         layout.block_bytes))
                                res = move(src, dst, timeout=120, split=split)
                                rates.append(res.gbps)
                                lats.append(res.seconds * 1e6)
                            gbps, ref = statistics.median(rates), statistics.median(refs)
                            report["results"].append({
                                "layout": layout.kind, "op": op, "pattern": pattern,
                                "split": split, "ucx_threads": cfg.ucx_threads,
                                "huge_pages": cfg.huge_pages,
                                "size_bytes": res.nbytes, "block_size": layout.block_bytes,
                                "batch_size": count, "runs": res.runs,
                                "descriptors": res.descriptors,
                                "nixl_descriptors": res.nixl_descriptors,
                                "avg_lat_us": round(statistics.mean(lats), 1),
                                "gbps": round(gbps, 3), "gbps_max": round(max(rates), 3),
                                "ref_gbps": round(ref, 3), "ref": "host memmove, same run",
                                "ratio": round(gbps / ref, 3),
                                "ratio_pairs_median": round(statistics.median(
                                    r / f for r, f in zip(rates, refs)), 3),
                            })
        report["ok"] = True
        return report
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        return report
    finally:
        for client, cache in clients:
            client.close()
            cache.close()
        for buf in (ref_src, ref_dst):
            if buf is not None:
                buf.close()
        reap(proc, control)
