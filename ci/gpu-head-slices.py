"""Mixed TP's head slices copied by kvruntime's head kernel alone (engines/gather.HeadGather),
against the torch copies of the same bytes between the same GPUs in the same run: the bound of
the same-node engine's mixed-TP copy, without processes, side channel, plans or handshakes.

For each group (``--pairs``, as the bench's ``--tp-pairs``) the ranks are laid on ``--devices``
as the bench lays them (tools/placement.py), the caches are the bench's TP layouts
(``bench_tp.tp_layout``: 4 layers, 16 tokens, 8 KV heads split by TP, fp16, 256 KiB blocks)
and the blocks the bench's random ones. Decode rank 0's slices are copied (each on a stream of
its source's GPU, all started together, as the engine runs them; ``--work dst``: on the
decode rank's GPU, loading the peer's slices over NVLink instead of storing them, which the
engine cannot do today: the memory it opens by CUDA IPC is mapped on the exporter's GPU only),
then every decode rank's at once; beside each, ``references.RankReference`` (one torch copy a
part, on streams of their own, timed the same way: synchronized start to synchronized end).
With ``--sweep`` the kernel's tile (bytes a program copies) and warps are varied. Prints one
JSON object: GB/s and the ratio to the reference, medians of ``--iters``. CI has no GPU:
BENCHMARKS.md takes the figures.

    python3 ci/gpu-head-slices.py [--pairs 2x1 1x2 4x2 2x4] [--mib 256] [--devices 0 1]
        [--iters 9] [--sweep] [--work src|dst]
"""
import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvruntime.engines import gather  # noqa: E402
from kvruntime.layout import CROSS_LAYER  # noqa: E402
from kvruntime.tools.bench_tp import tp_layout  # noqa: E402
from kvruntime.tools.placement import parse_group, place  # noqa: E402
from kvruntime.tools.references import RankReference  # noqa: E402
from kvruntime.tools.workload import BENCH_HEADS, bench_layout, pick_blocks  # noqa: E402
from kvruntime.tp import head_slices  # noqa: E402

BLOCK_KIB = 256  # the bench's default block


def regions(layout, device: int, fill: bool) -> list:
    """The layout's regions on ``device``: random bytes (a source) or zeros."""
    at = torch.device("cuda", device)
    return [torch.randint(0, 256, (layout.region_bytes,), dtype=torch.uint8, device=at) if fill
            else torch.zeros(layout.region_bytes, dtype=torch.uint8, device=at)
            for _ in range(layout.num_regions)]


class Rank:
    """One decode rank's parts: a HeadGather a prefill rank it reads from, on a stream of
    that rank's GPU, into this rank's regions; its reference copies."""

    def __init__(self, rank: int, device: int, pl, dl, sources: dict, placement, blocks,
                 tile: int, warps: int, work: str):
        self.rank, self.device = rank, device
        self.dst = regions(dl, device, False)
        self.parts = []
        self.src_ids, self.dst_ids = blocks
        parts = []
        for s in head_slices(pl, dl, rank):
            src_dev = placement.prefill[s.prefill_rank]
            at = src_dev if work == "src" else device
            stream = torch.cuda.Stream(torch.device("cuda", at))
            with torch.cuda.device(at):
                hg = gather.HeadGather(sources[s.prefill_rank], self.dst, pl, dl, stream)
                word = pl.head_dim * pl.element_bytes // hg.head_words  # bytes a word
                hg.tile_words = tile // word
                hg._kernels = gather._Launches(gather._gather_heads, warps)
                hg.warm(s)
            self.parts.append((hg, s, at))
            parts.append((src_dev, len(self.src_ids) * dl.block_bytes * s.count
                          // dl.num_kv_heads))
        self.nbytes = sum(n for _d, n in parts)
        self.reference = RankReference(parts, "cuda", device)

    def start(self) -> None:
        for hg, s, src_dev in self.parts:
            with torch.cuda.device(src_dev), torch.cuda.stream(hg.stream):
                hg.copy(self.src_ids, self.dst_ids, s)

    def devices(self) -> set:
        return {self.device, *(d for _h, _s, d in self.parts)}


def timed(ranks, what: str, iters: int) -> float:
    """Median seconds from a synchronized start to every GPU synchronized again."""
    devices = sorted(set().union(*(r.devices() for r in ranks)))
    times = []
    for _ in range(iters):
        for d in devices:
            torch.cuda.synchronize(d)
        if what == "reference":  # RankReference times itself; all at once: run them together
            if len(ranks) == 1:
                t0, t1 = ranks[0].reference.copy()
                times.append(t1 - t0)
                continue
            t = time.monotonic()
            for r in ranks:
                at = 0
                for src, stream in zip(r.reference.sources, r.reference.streams):
                    with torch.cuda.stream(stream):
                        r.reference.dst[at:at + src.numel()].copy_(src, non_blocking=True)
                    at += src.numel()
        else:
            t = time.monotonic()
            for r in ranks:
                r.start()
        for d in devices:
            torch.cuda.synchronize(d)
        times.append(time.monotonic() - t)
    return statistics.median(times)


def measure(text: str, args, tile: int, warps: int) -> dict:
    group = parse_group(text, BENCH_HEADS)
    placement = place(group, args.devices)
    full = bench_layout(CROSS_LAYER, BLOCK_KIB, args.mib)
    count = max(1, (args.mib << 20) // full.block_bytes)
    blocks = pick_blocks("random", count, full.num_blocks, random.Random(args.seed))
    bench = argparse.Namespace(block_kib=BLOCK_KIB)
    pl, dl = tp_layout(bench, group.p, args.mib), tp_layout(bench, group.d, args.mib)
    sources = {i: regions(pl, dev, True) for i, dev in enumerate(placement.prefill)}
    ranks = [Rank(r, dev, pl, dl, sources, placement, blocks, tile, warps, args.work)
             for r, dev in enumerate(placement.decode[0])]
    row = {"group": text, "placement": placement.as_dict(), "tile_bytes": tile, "warps": warps,
           "work": args.work,
           "row_bytes": dl.head_dim * dl.element_bytes * dl.num_kv_heads}
    for label, chosen in (("rank0", ranks[:1]), ("all_ranks", ranks)):
        nbytes = sum(r.nbytes for r in chosen)
        kernel, ref = timed(chosen, "kernel", args.iters), timed(chosen, "reference", args.iters)
        row[label] = {"bytes": nbytes, "kernel_gbps": round(nbytes / kernel / 1e9, 1),
                      "reference_gbps": round(nbytes / ref / 1e9, 1),
                      "ratio": round(ref / kernel, 3)}
    # the bytes the kernel wrote are checked against the source heads (rank 0, first block)
    r0 = ranks[0]
    for hg, s, _dev in r0.parts:
        src = hg.src[0].view(-1)[r0.src_ids[0] * hg.src_block:][:hg.src_block]
        dst = hg.dst[0].view(-1)[r0.dst_ids[0] * hg.dst_block:][:hg.dst_block]
        w = (s.src[1] - s.src[0]) * hg.head_words
        a = src.view(hg.rows, -1)[:, s.src[0] * hg.head_words:][:, :w].cpu()
        b = dst.view(hg.rows, -1)[:, s.dst[0] * hg.head_words:][:, :w].cpu()
        row.setdefault("bit_exact", True)
        row["bit_exact"] = row["bit_exact"] and bool(torch.equal(a, b))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", nargs="+", default=["2x1", "1x2", "4x2", "2x4"])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--devices", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--iters", type=int, default=9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--work", choices=["src", "dst"], default="src",
                    help="the GPU the kernel runs on: the source's (the engine's) or ours")
    args = ap.parse_args()
    if gather.triton is None:
        raise SystemExit("no Triton here: the head kernel cannot run")
    shapes = ([(t << 10, w) for t in (4, 16, 64) for w in (4, 8, 16)] if args.sweep else
              [(gather.HEAD_TILE_BYTES, gather.HEAD_WARPS)])
    out = {"tool": "gpu-head-slices", "mib": args.mib, "devices": args.devices,
           "gpus": [torch.cuda.get_device_name(d) for d in sorted(set(args.devices))],
           "rows": []}
    for text in args.pairs:
        for tile, warps in shapes:
            try:
                out["rows"].append(measure(text, args, tile, warps))
            except Exception as exc:  # one group's failure is reported, the others still run
                out["rows"].append({"group": text, "tile_bytes": tile, "warps": warps,
                                    "error": f"{type(exc).__name__}: {exc}"})
            torch.cuda.empty_cache()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
