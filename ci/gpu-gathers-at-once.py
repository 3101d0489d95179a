"""Several processes' gathers at once, beside the same processes' copies at once: what bounds
``bench --inflight 4 32``'s ``processes_batched`` row (four decode processes pulling random
blocks at once, rated against ``processes_copy``, each process copying its share's bytes at
the same moment) with kvruntime's request path taken out.

Each process holds a source of its own on ``--src`` (a prefill's cache: in the bench the
processes share one, which the GPU reads alike) and a destination on ``--dst``, and moves
``--share-mib`` of random ``--block-kib`` blocks with kvruntime's gather kernel
(engines/gather.py, run on the source's GPU as the same-node engine runs it), or copies as
many contiguous bytes with torch (the bench's reference copy). The processes start each round
at one moment on the host's monotonic clock (as bench_inflight.py starts its processes), and
a round's rate counts all their bytes from the first start to the last end. Each way is also
timed with one process alone. No NIXL, no side channel, no plan: the copies themselves.
Prints one JSON object (medians of ``--iters`` rounds, GB/s).

    python3 ci/gpu-gathers-at-once.py [--procs 4] [--share-mib 256] [--block-kib 256]
        [--src 0] [--dst 1] [--iters 9]
"""
import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def worker(rank: int, args, commands, answers) -> None:
    import numpy as np
    import torch

    from kvruntime.engines.gather import BlockGather

    block = args.block_kib << 10
    n = (args.share_mib << 20) // block
    pool = 2 * n  # the caches' blocks: a request's ids are a random half of them
    src_dev, dst_dev = torch.device("cuda", args.src), torch.device("cuda", args.dst)
    g = torch.Generator().manual_seed(rank)
    src = torch.randint(0, 255, (pool * block,), dtype=torch.uint8, generator=g).to(src_dev)
    dst = torch.zeros(pool * block, dtype=torch.uint8, device=dst_dev)
    ref_src = torch.full((n * block,), 0x5A, dtype=torch.uint8, device=src_dev)
    ref_dst = torch.empty(n * block, dtype=torch.uint8, device=dst_dev)
    ids = np.sort(np.random.default_rng(rank).choice(pool, n, replace=False)).astype(np.int64)
    stream = torch.cuda.Stream(src_dev)
    gather = BlockGather([src], [dst], block, pool, pool, stream)
    with torch.cuda.device(src_dev), torch.cuda.stream(stream):
        gather.warm()

    class Plan:  # what the gather reads of a plan: its runs' count and its ids
        num_runs = int(1 + np.count_nonzero(np.diff(ids) != 1))

        @staticmethod
        def block_ids():
            return ids, ids

    def sync() -> None:
        torch.cuda.synchronize(src_dev)
        torch.cuda.synchronize(dst_dev)

    def gathered() -> str:
        with torch.cuda.device(src_dev), torch.cuda.stream(stream):
            return gather.copy(Plan)

    def copied() -> None:
        ref_dst.copy_(ref_src, non_blocking=True)

    method = gathered()
    sync()
    t = torch.from_numpy(ids).to(src_dev)
    exact = bool(torch.equal(dst.view(pool, block)[t.to(dst_dev)].cpu(),
                             src.view(pool, block)[t].cpu()))
    answers.put({"rank": rank, "ready": True, "bit_exact": exact, "runs": Plan.num_runs,
                 "method": method, "bytes": n * block})
    while True:
        command = commands.get()
        if command is None:
            return
        way, moment = command
        sync()
        while time.monotonic() < moment:
            pass
        t0 = time.monotonic()
        (gathered if way == "gather" else copied)()
        sync()
        answers.put({"rank": rank, "t0": t0, "t1": time.monotonic()})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--share-mib", type=int, default=256)
    ap.add_argument("--block-kib", type=int, default=256)
    ap.add_argument("--src", type=int, default=0)
    ap.add_argument("--dst", type=int, default=None, help="default: 1 where there are two GPUs")
    ap.add_argument("--iters", type=int, default=9)
    args = ap.parse_args()
    import torch

    gpus = torch.cuda.device_count()
    if not gpus:
        raise SystemExit("needs a CUDA device")
    if args.dst is None:
        args.dst = 1 if gpus > 1 else 0
    ctx = mp.get_context("spawn")
    answers = ctx.Queue()
    commands = [ctx.Queue() for _ in range(args.procs)]
    procs = [ctx.Process(target=worker, args=(r, args, commands[r], answers), daemon=True)
             for r in range(args.procs)]
    for p in procs:
        p.start()
    ready = [answers.get(timeout=300) for _ in procs]
    share = ready[0]["bytes"]

    def round_(who, way) -> float:
        moment = time.monotonic() + 0.05
        for r in who:
            commands[r].put((way, moment))
        got = [answers.get(timeout=120) for _ in who]
        span = max(a["t1"] for a in got) - min(a["t0"] for a in got)
        return len(who) * share / span / 1e9

    everyone = list(range(args.procs))
    rates = {k: [] for k in ("alone_copy", "alone_gather", "at_once_copy", "at_once_gather")}
    for _ in range(args.iters):  # interleaved, so that both ways meet the same GPU state
        rates["alone_copy"].append(round_([0], "copy"))
        rates["alone_gather"].append(round_([0], "gather"))
        rates["at_once_copy"].append(round_(everyone, "copy"))
        rates["at_once_gather"].append(round_(everyone, "gather"))
    for c in commands:
        c.put(None)
    for p in procs:
        p.join(30)
    med = {k: round(statistics.median(v), 1) for k, v in rates.items()}
    print(json.dumps({
        "device": torch.cuda.get_device_name(args.src), "src": args.src, "dst": args.dst,
        "procs": args.procs, "share_mib": args.share_mib, "block_kib": args.block_kib,
        "runs_a_share": [a["runs"] for a in ready], "method": ready[0]["method"], "gbps": med,
        "alone_ratio": round(med["alone_gather"] / med["alone_copy"], 3),
        "at_once_ratio": round(med["at_once_gather"] / med["at_once_copy"], 3),
        "bit_exact": all(a["bit_exact"] for a in ready)}, indent=1))


if __name__ == "__main__":
    main()
