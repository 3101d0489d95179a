"""A random property run of kvruntime: every request lands bit-exact, nothing else moves.

Each trial draws a layout (kind per side, layers, tokens, head size, dtype, blocks), a TP pair
(prefill ranks x decode ranks over 4 KV heads), a KV buffer (direct, or host-staged with a pool
of random size, so large requests move in pieces), an engine (auto, nixl, samenode) and a
coalesce mode (never, auto, always), starts a prefill process serving its ranks, and has every
decode rank pull random requests from every prefill rank it takes heads from, one by one
(``start_pull``) and in batches (``start_pulls``). Every decode block starts as a canary; at the
end each requested block must hold exactly its heads from the prefill ranks' own seeds and every
other block its canary (a "corrupt" block otherwise). Prints one JSON line.

    python tests/integration/kvruntime/property_run.py --trials 100 --seed 1
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))

HEADS = 4  # the model's KV heads, split over each side's ranks
CANARY = 0xA5
TP_PAIRS = [(1, 1), (1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 2)]


def draw(rnd: random.Random) -> dict:
    """One trial's configuration."""
    from kvruntime.layout import CROSS_LAYER, PER_LAYER

    p, d = rnd.choice(TP_PAIRS)
    staged = rnd.random() < 0.3
    pkind = rnd.choice([CROSS_LAYER, PER_LAYER])
    shape = dict(layers=rnd.randint(1, 3), blocks=rnd.randint(16, 48),
                 tokens=rnd.choice([1, 4, 16]), dim=rnd.choice([8, 32, 64]),
                 dtype=rnd.choice(["float16", "bfloat16", "float32"]))
    return dict(p=p, d=d, staged=staged, pkind=pkind,
                dkind=rnd.choice([CROSS_LAYER, PER_LAYER]) if staged else pkind,
                engine=rnd.choice(["auto", "nixl"] if staged else ["auto", "nixl", "samenode"]),
                coalesce="auto" if staged else rnd.choice(["never", "auto", "always"]),
                staging_blocks=rnd.randint(2, 16) if staged else 0, **shape)


def layout(cfg: dict, kind: str, tp: int):
    from kvruntime.layout import KVLayout

    return KVLayout(kind, cfg["layers"], cfg["blocks"], cfg["tokens"], HEADS // tp, cfg["dim"],
                    cfg["dtype"], tp)


def trial(cfg: dict, seed: int, rnd: random.Random, requests: int) -> dict:
    """Run one configuration; its counts."""
    import numpy as np

    from kvruntime.decode.client import DecodeClient
    from kvruntime.errors import KVRuntimeError
    from kvruntime.memory import KVCache
    from kvruntime.tools.roles import prefill_main, reap
    from kvruntime.tp import head_slices

    counts = {"trials": 1, "requests": 0, "batched": 0, "ok": 0, "failed": 0, "corrupt": 0,
              "canary_hits": 0, "refused_connects": 0}
    players = [layout(cfg, cfg["pkind"], cfg["p"]) for _ in range(cfg["p"])]
    reference = []
    for i, lay in enumerate(players):  # the prefill ranks' bytes, from their own seeds
        c = KVCache.allocate_host(lay, False)
        c.fill_random(seed + i)
        reference.append(c.head_view())
        c.close()
    options = {"huge": False, "tp_ranks": list(range(cfg["p"])), "coalesce": "auto"}
    shared = {}
    if cfg["staged"]:
        shared = dict(kv_buffer="host_staged", staging_blocks=cfg["staging_blocks"])
        options.update(shared)
    ctx = mp.get_context("spawn")
    ready_q, control = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=prefill_main, daemon=True,
                       args=(ready_q, control, [lay.to_dict() for lay in players], seed, options))
    proc.start()
    try:
        ready = ready_q.get(timeout=120)
        if not ready["ok"]:
            raise RuntimeError(f"the prefill did not start: {ready}")
        for j in range(cfg["d"]):
            dlay = layout(cfg, cfg["dkind"], cfg["d"])
            cache = KVCache.allocate_host(dlay, False)
            cache.fill_value(CANARY)
            with DecodeClient(cache, engine=cfg["engine"], tp_rank=j, coalesce=cfg["coalesce"],
                              timeout=30, **shared) as client:
                slices = head_slices(players[0], dlay, j)
                peers = []
                for s in slices:
                    try:
                        peers.append((s, client.connect("127.0.0.1",
                                                        ready["ports"][s.prefill_rank])))
                    except KVRuntimeError:
                        counts["refused_connects"] += 1  # e.g. samenode where it cannot serve
                if len(peers) != len(slices):
                    cache.close()
                    continue
                free = list(range(dlay.num_blocks))
                rnd.shuffle(free)
                landed = []  # (src, dst) every slice moved
                while free and counts["requests"] < requests * (j + 1):
                    batch = []
                    for _ in range(rnd.randint(1, 4)):
                        n = min(len(free), rnd.randint(1, 6))
                        if not n:
                            break
                        dst, free = free[:n], free[n:]
                        batch.append((rnd.sample(range(players[0].num_blocks), n), dst))
                    together = rnd.random() < 0.5 and len(batch) > 1
                    outcomes = []
                    for s, peer in peers:
                        if together:
                            handles = peer.start_pulls([(src, dst, None) for src, dst in batch],
                                                       timeout=30)
                        else:
                            handles = [peer.start_pull(src, dst, timeout=30)
                                       for src, dst in batch]
                        for h in handles:
                            try:
                                h.wait()
                                outcomes.append(True)
                            except KVRuntimeError as exc:
                                outcomes.append(False)
                                print(f"failed: {exc}", file=sys.stderr)
                                h.wait_settled(30)
                    counts["requests"] += len(outcomes)
                    counts["batched"] += len(outcomes) if together else 0
                    counts["ok"] += sum(outcomes)
                    counts["failed"] += len(outcomes) - sum(outcomes)
                    if all(outcomes):
                        landed += batch
                    else:  # which landed is not known: its blocks are left out of the check
                        landed += [(None, dst) for _src, dst in batch]
                view = cache.head_view()
                touched = set()
                for src, dst in landed:
                    touched.update(dst)
                    if src is None:
                        continue
                    for sb, db in zip(src, dst):
                        for s, _peer in peers:
                            want = reference[s.prefill_rank][sb][:, :, s.src[0]:s.src[1]]
                            got = view[db][:, :, s.dst[0]:s.dst[1]]
                            if not np.array_equal(want, got):
                                counts["corrupt"] += 1
                for b in range(dlay.num_blocks):
                    if b not in touched and not (view[b] == CANARY).all():
                        counts["canary_hits"] += 1
            cache.close()
    finally:
        reap(proc, control)
        ready_q.close(), control.close()
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--requests", type=int, default=40, help="requests a decode rank, at most")
    args = ap.parse_args(argv)
    from kvruntime.tools.roles import prepare_process

    prepare_process({})
    rnd = random.Random(args.seed)
    total: dict = {}
    kinds: dict = {}
    t0 = time.monotonic()
    for t in range(args.trials):
        cfg = draw(rnd)
        counts = trial(cfg, args.seed * 1000 + t * 10, rnd, args.requests)
        for k, v in counts.items():
            total[k] = total.get(k, 0) + v
        key = (f"tp{cfg['p']}x{cfg['d']} {'host_staged' if cfg['staged'] else 'direct'} "
               f"{cfg['engine']} {cfg['coalesce']}")
        kinds[key] = kinds.get(key, 0) + counts["requests"]
        if counts["corrupt"] or counts["canary_hits"]:
            print(json.dumps({"bad_trial": t, "config": cfg, "counts": counts}),
                  file=sys.stderr, flush=True)
    total["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps({"totals": total, "requests_by_config": kinds}))
    return 1 if total.get("corrupt") or total.get("canary_hits") else 0


if __name__ == "__main__":
    sys.exit(main())
