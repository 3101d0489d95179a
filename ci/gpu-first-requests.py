"""Where a CUDA decode's client start, connect and first requests spend their time (issue 31's
"a first request as fast as the hundredth"). A prefill process serves a 2 GiB cross_layer cache
on cuda:0; per row a decode client (same-node, or NIXL forced through the pools) on cuda:0 or
cuda:1 connects under cProfile and pulls 64 random blocks 8 times, the first two under cProfile
too (which inflates those two). Prints a JSON line per row, then the profiles. Runs on a GPU
host with the installer's cuda build sourced (its env.sh) and this checkout on PYTHONPATH:

    . PREFIX/env.sh; PYTHONPATH=$PWD python3 ci/gpu-first-requests.py
"""
import cProfile
import io
import json
import multiprocessing as mp
import pstats
import random
import time

LAY = dict(num_layers=32, num_blocks=1024, tokens_per_block=16, num_kv_heads=8, head_dim=128,
           dtype="bfloat16")

def timed(spans, cls, name):
    """Wrap cls.name: each call's start (perf_counter: one clock for both processes on Linux)
    and duration appended to spans."""
    f = getattr(cls, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            spans.append((name, round(t * 1e6), round((time.perf_counter() - t) * 1e6)))
    setattr(cls, name, wrapper)


def prefill(q, dev):
    import logging

    from kvruntime import KVCache, KVLayout, PrefillServer
    from kvruntime.pools import staging
    from kvruntime.prefill import stages
    logging.basicConfig(level=logging.INFO,
                        format="%(relativeCreated)8.1f prefill %(name)s %(message)s")
    # the prefill's side of a coalesced request: when a stage arrives, what its gather and
    # answers cost (its first one took ~17 ms more than later ones on 2 x H100)
    spans = []
    for cls, name in ((stages.Stages, "stage"), (stages.Stages, "_gather_chunks"),
                      (staging.StagingPool, "ids"), (staging.StagingPool, "gather"),
                      (staging.StagingPool, "try_acquire"), (stages.Stages, "unstage")):
        timed(spans, cls, name)
    lay = KVLayout("cross_layer", **LAY)
    t = time.perf_counter()
    cache = KVCache.allocate_device(lay, "cuda", dev)
    with PrefillServer(cache, secret=b"s", port=0) as s:
        q.put((s.address, time.perf_counter() - t))
        q.get()
    print(json.dumps({"prefill_spans_us": spans[:60]}), flush=True)

def stats(pr, n=22):
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(n)
    return "\n".join(line for line in s.getvalue().splitlines() if line.strip())[:5000]

def main():
    from kvruntime import DecodeClient, KVCache, KVLayout
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=prefill, args=(q, 0))
    p.start()
    addr, ts = q.get(timeout=120)
    print(json.dumps({"prefill_start_s": ts}), flush=True)
    lay = KVLayout("cross_layer", **LAY)
    cases = [("samenode", "never", 0), ("samenode", "never", 0), ("samenode", "never", 1),
             ("nixl", "always", 0), ("nixl", "always", 1)]
    for engine, coalesce, dev in cases:
        t = time.perf_counter()
        cache = KVCache.allocate_device(lay, "cuda", dev)
        c = DecodeClient(cache, secret=b"s", engine=engine, coalesce=coalesce)
        t1 = time.perf_counter()
        pr = cProfile.Profile()
        pr.enable()
        peer = c.connect(*addr)
        pr.disable()
        t2 = time.perf_counter()
        lat, profs, starts = [], [], []
        for i in range(8):
            ids = random.sample(range(1024), 64)
            rp = cProfile.Profile() if i < 2 else None
            if rp:
                rp.enable()
            a = time.perf_counter()
            starts.append(round(a * 1e6))
            r = peer.pull(ids, ids, request_id=f"r{engine}{dev}{i}")
            lat.append((time.perf_counter() - a) * 1e6)
            if rp:
                rp.disable()
                profs.append(stats(rp, 30))
        row = {"engine": engine, "coalesce": coalesce, "decode_gpu": dev,
               "peer_engine": peer.engine, "coalesced": r.coalesced,
               "client_ms": round((t1 - t) * 1e3, 1), "connect_ms": round((t2 - t1) * 1e3, 1),
               "lat_us": [round(x) for x in lat], "starts_us": starts}
        print(json.dumps(row), flush=True)
        print(stats(pr), flush=True)
        for i, s in enumerate(profs):
            print(f"--- request {i} profile", flush=True)
            print(s, flush=True)
        c.close()
        cache.close()
    q.put("stop")
    p.join(30)

if __name__ == "__main__":
    main()
