"""What two GPUs allow a coalesced request (issue 31's 1 GiB of 4096 random 256 KiB blocks): a
gather into a pool on the source GPU, a peer copy pool to pool, a scatter on the destination,
chunk by chunk on three CUDA streams with events between them: no kvruntime, no NIXL, no side
channel, no host round trip. Against one peer copy of the same bytes in the same run, so the
ratio is the bound the coalesced NIXL path (coalesce.py) can approach on this pair of GPUs, and
what it loses beyond it is kvruntime's. Prints one JSON object (medians of 7, milliseconds).

    python3 ci/gpu-pipeline-bound.py            # needs torch with CUDA and two GPUs
"""
import json
import time

import torch

TOTAL, BLOCK = 1 << 30, 256 << 10
N = TOTAL // BLOCK


def main() -> None:
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs two CUDA devices")
    torch.manual_seed(0)
    src = torch.randint(0, 1 << 62, (N, BLOCK // 8), dtype=torch.int64, device="cuda:0")
    dst = torch.zeros((N, BLOCK // 8), dtype=torch.int64, device="cuda:1")
    pool0, pool1 = torch.empty_like(src), torch.empty_like(dst)
    src_ids, dst_ids = torch.randperm(N, device="cuda:0"), torch.randperm(N, device="cuda:1")
    gathers, scatters = torch.cuda.Stream("cuda:0"), torch.cuda.Stream("cuda:1")
    wire = {"source": torch.cuda.Stream("cuda:0"), "destination": torch.cuda.Stream("cuda:1")}

    def timed(f, n=7) -> float:
        out = []
        for _ in range(n):
            for d in (0, 1):
                torch.cuda.synchronize(d)
            t = time.perf_counter()
            f()
            for d in (0, 1):
                torch.cuda.synchronize(d)
            out.append((time.perf_counter() - t) * 1e3)
        return round(sorted(out)[n // 2], 3)

    def peer_copy():  # the reference: the same bytes, contiguous, one copy
        with torch.cuda.stream(wire["destination"]):
            pool1.copy_(src, non_blocking=True)

    def pipeline(chunks: int, side: str):
        def run():
            c = N // chunks
            for i in range(chunks):
                lo, hi = i * c, (i + 1) * c
                with torch.cuda.stream(gathers):
                    torch.index_select(src, 0, src_ids[lo:hi], out=pool0[lo:hi])
                    gathered = torch.cuda.Event()
                    gathered.record(gathers)
                w = wire[side]
                w.wait_event(gathered)
                with torch.cuda.stream(w):
                    pool1[lo:hi].copy_(pool0[lo:hi], non_blocking=True)
                    landed = torch.cuda.Event()
                    landed.record(w)
                scatters.wait_event(landed)
                with torch.cuda.stream(scatters):
                    dst.index_copy_(0, dst_ids[lo:hi], pool1[lo:hi])
        return run

    for _ in range(2):  # kernels loaded, peer mappings made
        peer_copy()
        pipeline(16, "destination")()
    report = {"gpus": [torch.cuda.get_device_name(d) for d in (0, 1)],
              "bytes": TOTAL, "blocks": N, "peer_copy_ms": timed(peer_copy)}
    for chunks in (4, 16, 64):
        for side in ("destination", "source"):
            ms = timed(pipeline(chunks, side))
            report[f"pipeline_{chunks}_chunks_wire_on_{side}_ms"] = ms
    best = min(v for k, v in report.items() if k.startswith("pipeline_"))
    report["ratio_of_peer_copy"] = round(report["peer_copy_ms"] / best, 3)
    ok = torch.equal(dst[dst_ids], src[src_ids].to("cuda:1"))
    report["bit_exact"] = bool(ok)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
