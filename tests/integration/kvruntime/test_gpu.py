"""KV caches in CUDA device memory (VRAM), moved between real processes by real NIXL agents.

Both sides allocate torch CUDA tensors on an explicit device id and register them as VRAM; every
moved block's digest is compared with the prefill side's. Skipped, with the reason, where torch
or a CUDA device is missing. No timings are asserted: figures go to BENCHMARKS.md.
"""

import json
import os
import subprocess
import sys

import pytest

from kvruntime.decode.client import DecodeClient
from kvruntime.layout import CROSS_LAYER, PER_LAYER, KVLayout
from kvruntime.memory import KVCache, device_unavailable
from kvruntime.plan import coalesce
from kvruntime.tools.selftest import request_blocks

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

_why_not = device_unavailable("cuda")
if _why_not is not None:
    pytest.skip(f"no CUDA memory here: {_why_not}", allow_module_level=True)

DEVICE_ID = 0


def small(kind, blocks=64):
    return KVLayout(kind, 3, blocks, 16, 4, 64, "float16")


def _has_triton() -> bool:
    from kvruntime.engines import gather

    return gather.triton is not None


def _pairs():
    import torch

    return [(0, 0), (0, 1)] if torch.cuda.device_count() > 1 else [(0, 0)]


def test_prewarm_loads_the_gather_kernel_on_the_other_gpus_whose_context_it_holds():
    """A same-node peer on another GPU is gathered there: the client's start loads the kernel
    on every other GPU whose primary context the process holds already, and on no other (no
    context is made for it)."""
    import torch

    from kvruntime.engines import gather
    from kvruntime.host import cudart

    if torch.cuda.device_count() < 2 or not _has_triton():
        pytest.skip("needs two GPUs and Triton")
    torch.zeros(1, device="cuda:1")  # this process holds GPU 1's context
    assert cudart.context_active(1) is True
    cache = KVCache.allocate_device(small(CROSS_LAYER), "cuda", 0)
    held = [i for i in range(torch.cuda.device_count()) if cudart.context_active(i)]
    try:
        said = gather.prewarm(cache)
    finally:
        cache.close()
    warmed = said.removeprefix("gather kernel ready on ").split(", ")
    assert warmed == [f"cuda:{i}" for i in [0] + [i for i in held if i != 0]], said
    assert [i for i in range(torch.cuda.device_count()) if cudart.context_active(i)] == held


@pytest.mark.parametrize("ids", _pairs(), ids=lambda p: f"cuda{p[0]}-to-cuda{p[1]}")
@pytest.mark.parametrize("engine", ["nixl", "samenode"])
@pytest.mark.parametrize("kind", [CROSS_LAYER, PER_LAYER])
def test_bit_exact_pull_and_push_in_vram(prefill, kind, engine, ids):
    layout = small(kind)
    with prefill([layout], seed=21, secret=b"k", device="cuda",
                 device_id=ids[0]) as (_proc, ports):
        cache = KVCache.allocate_device(small(kind, blocks=80), "cuda", ids[1])
        assert cache.mem_type == "VRAM"
        assert {r.device_id for r in cache.regions} == {ids[1]}
        assert {t.device.type for t in cache.tensors} == {"cuda"}
        zero = KVCache.allocate_device(small(kind, blocks=80), "cuda", ids[1])
        zero.fill_value(0)
        # coalesce="never": this is the direct path's test (a descriptor per run and region);
        # auto sends per_layer's 120 descriptors through the pools (test_coalesced_* below)
        with DecodeClient(cache, secret=b"k", device_kind="cuda", engine=engine,
                          coalesce="never") as client:
            # the agent chose CUDA IPC for READs before its UCX backend existed
            assert os.environ.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY") == "on"
            # the same-node engine's kernel compiled with the client, not at its first connect
            assert (client.prewarmed is None) == (engine == "nixl")
            if engine == "samenode" and _has_triton():
                assert client.prewarmed.startswith("gather kernel ready"), client.prewarmed
            peer = client.connect("127.0.0.1", ports[0])
            assert peer.info.mem_type == "VRAM"
            assert peer.engine == ("nixl" if engine == "nixl" else "samenode:cuda-ipc")
            # scattered blocks, then one run each way (the runtime's copies)
            cases = [(op, *request_blocks(layout.num_blocks, 100 + n))
                     for n, op in enumerate(("pull", "push"))]
            cases += [(op, list(range(3, 13)), list(range(40, 50))) for op in ("pull", "push")]
            # every other block: 20 runs, more than the runtime's copies take (the kernel's)
            cases += [(op, list(range(0, 40, 2)), list(range(50, 70))) for op in ("pull", "push")]
            for op, src, dst in cases:
                cache.fill_value(0)
                res = getattr(peer, op)(src, dst, timeout=30)
                assert res.engine == peer.engine
                assert res.nbytes == len(src) * layout.block_bytes
                assert res.runs == len(coalesce(src, dst))
                assert res.descriptors == res.runs * layout.num_regions
                assert not res.coalesced
                expected = peer.digests(src)
                assert len(set(expected)) == len(src)  # random content, not zeros
                assert cache.block_digests(dst) == expected
                untouched = sorted(set(range(80)) - set(dst))[:5]
                assert cache.block_digests(untouched) == zero.block_digests(untouched)
            if engine == "samenode":
                # the many runs went through one kernel, not torch's two-step fallback (across
                # GPUs the kernel runs on the prefill's GPU: there the IPC-opened memory is mapped)
                assert peer.samenode.gather.use_triton == _has_triton()
                if _has_triton():  # the kernel compiled once, later launches skip Triton's JIT
                    assert peer.samenode.gather._kernels.direct > 0
        zero.close()
        cache.close()


@pytest.mark.parametrize("ids", _pairs(), ids=lambda p: f"cuda{p[0]}-to-cuda{p[1]}")
@pytest.mark.parametrize("engine", ["nixl", "samenode"])
@pytest.mark.parametrize("kind", [CROSS_LAYER, PER_LAYER])
def test_pushes_the_prefill_starts_land_bit_exact_in_vram(pushing_prefill, kind, engine, ids):
    """The prefill process pushes device memory into blocks the decode named: a NIXL WRITE
    whose notification finishes the handle after the data, or, to a same-node decode, the
    ids it then copies itself out of the prefill's memory."""
    layout = small(kind)
    with pushing_prefill([layout], seed=23, device="cuda", device_id=ids[0]) as (
            _proc, ports, push):
        cache = KVCache.allocate_device(small(kind, blocks=80), "cuda", ids[1])
        with DecodeClient(cache, device_kind="cuda", engine=engine) as client:
            peer = client.connect("127.0.0.1", ports[0])
            cases = [request_blocks(layout.num_blocks, 300), (list(range(3, 13)),
                                                              list(range(40, 50)))]
            for n, (src, dst) in enumerate(cases):
                cache.fill_value(0)
                handle = peer.expect_push(dst, request_id=f"g{n}", timeout=30)
                assert push(0, f"g{n}", src, client.agent.name) is None
                res = handle.wait(30)
                assert res.engine == peer.engine and res.nbytes == len(src) * layout.block_bytes
                assert cache.block_digests(dst) == peer.digests(src)
        cache.close()


def test_selftest_cli_runs_every_cuda_mode_bit_exact():
    proc = subprocess.run([sys.executable, "-m", "kvruntime", "selftest", "--json",
                           "--device-ids", str(DEVICE_ID), str(DEVICE_ID)],
                          capture_output=True, text=True, timeout=300)
    report = json.loads(proc.stdout)
    assert proc.returncode == 0, (report.get("error"), proc.stderr[-3000:])
    cuda = [m for m in report["modes"] if m["mode"].startswith("cuda/") and "tp" not in m]
    assert {(m["layout"], m["op"], m["mode"].rsplit("/", 1)[1]) for m in cuda} == {
        (k, o, e) for k in (CROSS_LAYER, PER_LAYER) for o in ("pull", "push")
        for e in ("nixl", "samenode", "staged")} | {
        (k, "prefill_push", e) for k in (CROSS_LAYER, PER_LAYER) for e in ("nixl", "samenode")}
    for m in cuda:
        assert m["status"] == "passed", m
        assert m["memory"] == "VRAM" and m["digest_ok"]
        assert m["digests_checked"] == m["blocks"] > 0
    # the mixed-TP groups on device memory, every rank a process (all on DEVICE_ID here): the
    # same-node engine copies head slices of VRAM, so every engine runs
    tp = [m for m in report["modes"] if m["mode"].startswith("cuda/tp")]
    assert {m["mode"].rsplit("/", 1)[1] for m in tp} == {"nixl", "samenode", "staged"}
    assert all(m["status"] == "passed" and m["digest_ok"] for m in tp), tp
    assert report["ok"] is True


def test_bench_reports_vram_beside_a_device_copy(bench_descriptors):
    from kvruntime.tools.bench import BenchConfig, run_bench

    report = run_bench(BenchConfig(sizes_mib=[8], iters=2, handshakes=2, device="cuda",
                                   device_ids=[DEVICE_ID, DEVICE_ID]))
    assert report["ok"], report.get("error")
    assert "cuda:0" in report["device"]
    assert {(r["layout"], r["op"], r["pattern"], r["engine"]) for r in report["results"]} == {
        (k, o, p, e) for k in (CROSS_LAYER, PER_LAYER) for o in ("pull", "push")
        for p in ("contiguous", "random") for e in ("nixl", "samenode:cuda-ipc")}
    for r in report["results"]:
        assert r["memory"] == "VRAM" and "copy_" in r["ref"]
        assert r["gbps"] > 0 and r["ref_gbps"] > 0 and r["ratio"] > 0
        # per_layer: 4 layers, K and V: 8 regions; a coalesced request reports its chunks
        bench_descriptors(r, 1 if r["layout"] == CROSS_LAYER else 8)


def _logical(cache):
    """[block][2 x layers][token][head][bytes of a head] of a cuda cache, as a torch tensor."""
    import torch

    lay = cache.layout
    de = lay.head_dim * lay.element_bytes
    views = cache._byte_views()
    if lay.kind == CROSS_LAYER:
        return views[0].view(lay.num_blocks, 2 * lay.num_layers, lay.tokens_per_block,
                             lay.num_kv_heads, de)
    return torch.stack([v.view(lay.num_blocks, lay.tokens_per_block, lay.num_kv_heads, de)
                        for v in views], dim=1)


def _tp_reference(prefill_layouts, seed):
    """The model's full heads, [block][regions][token][head][bytes], rebuilt on the device from
    the prefill ranks' seeds (the prefill fills rank i with seed + i)."""
    import torch

    full = []
    for i, layout in enumerate(prefill_layouts):
        c = KVCache.allocate_device(layout, "cuda", DEVICE_ID)
        c.fill_random(seed + i)
        full.append(_logical(c).clone())
        c.close()
    return torch.cat(full, dim=3)


def _assert_rank_heads(cache, full, src, dst, rank):
    """Decode ``rank``'s blocks ``dst`` hold exactly its heads of ``src``; nothing else written."""
    import torch

    hd = cache.layout.num_kv_heads
    got = _logical(cache)
    full = full.to(got.device)
    assert torch.equal(got[dst], full[src][:, :, :, rank * hd:(rank + 1) * hd, :])
    others = [b for b in range(cache.layout.num_blocks) if b not in dst]
    assert not got[others].any()


@pytest.mark.parametrize("p,d", [(1, 2), (2, 1)])
def test_mixed_tp_staged_in_vram(prefill, p, d):
    """Staged mixed TP with CUDA caches (ranks share cuda:0): each decode rank's heads equal
    the reference rebuilt from the prefill ranks' seeds on the device."""
    from kvruntime.tp import head_slices

    heads, seed = 4, 70 + p * 10 + d

    def lay(kind, tp):
        return KVLayout(kind, 2, 32, 8, heads // tp, 16, "float16", tp)

    pre = [lay(PER_LAYER, p) for _ in range(p)]
    full = _tp_reference(pre, seed)
    src, dst = [2, 3, 4, 20], [10, 0, 1, 31]
    with prefill(pre, seed=seed, device="cuda", device_id=DEVICE_ID, kv_buffer="host_staged",
                 staging_blocks=16, tp_ranks=list(range(p))) as (_proc, ports):
        for j in range(d):
            cache = KVCache.allocate_device(lay(CROSS_LAYER, d), "cuda", DEVICE_ID)
            cache.fill_value(0)
            with DecodeClient(cache, device_kind="cuda", kv_buffer="host_staged",
                              staging_blocks=16, tp_rank=j) as client:
                assert client.staging._pinned
                for s in head_slices(pre[0], cache.layout, j):
                    client.connect("127.0.0.1", ports[s.prefill_rank]).pull(src, dst, timeout=30)
                _assert_rank_heads(cache, full, src, dst, j)
            cache.close()


@pytest.mark.parametrize("ids", _pairs(), ids=lambda p: f"cuda{p[0]}-to-cuda{p[1]}")
@pytest.mark.parametrize("engine", ["nixl", "samenode"])
@pytest.mark.parametrize("op", ["pull", "push", "prefill_push"])
@pytest.mark.parametrize("p,d", [(1, 2), (2, 1)])
def test_mixed_tp_direct_in_vram(pushing_prefill, p, d, op, engine, ids):
    """Direct mixed TP with CUDA caches (prefill ranks on ids[0], decode ranks on ids[1]):
    NIXL moves each decode rank's head slice row by row, or the same-node engine copies it
    with one kernel per region (Triton; across GPUs it writes into the decode's GPU over
    NVLink), or torch's strided gather on one GPU without Triton; compared with the ranks
    rebuilt on the device. prefill_push: each prefill rank the decode rank reads from starts
    its push (a WRITE, or the same-node decode's copy)."""
    if engine == "samenode" and ids[0] != ids[1] and not _has_triton():
        pytest.skip("head slices across GPUs take the same-node engine's Triton kernel")
    from kvruntime.tp import head_slices

    heads, seed = 4, 90 + p * 10 + d

    def lay(tp):
        return KVLayout(PER_LAYER, 2, 32, 8, heads // tp, 16, "float16", tp)

    full = _tp_reference([lay(p)] * p, seed)
    src, dst = [2, 3, 4, 20], [10, 0, 1, 31]
    with pushing_prefill([lay(p)] * p, seed=seed, device="cuda", device_id=ids[0],
                         tp_ranks=list(range(p))) as (_proc, ports, push):
        for j in range(d):
            cache = KVCache.allocate_device(lay(d), "cuda", ids[1])
            cache.fill_value(0)
            with DecodeClient(cache, device_kind="cuda", tp_rank=j, engine=engine) as client:
                for s in head_slices(lay(p), cache.layout, j):
                    peer = client.connect("127.0.0.1", ports[s.prefill_rank])
                    assert peer.engine.startswith(engine) and peer.head_slice == s
                    if op == "prefill_push":
                        handle = peer.expect_push(dst, request_id=f"r{j}", timeout=30)
                        assert push(s.prefill_rank, f"r{j}", src, client.agent.name) is None
                        res = handle.wait(30)
                        assert res.engine == peer.engine
                    else:
                        res = getattr(peer, op)(src, dst, timeout=30)
                        if peer.samenode is not None and peer.samenode.heads is not None:
                            # a second request goes straight to the kernel the first one
                            # (or connect's warm-up) compiled, around Triton's JIT
                            getattr(peer, op)(src, dst, timeout=30)
                            assert peer.samenode.heads._kernels.direct > 0
                    assert res.nbytes == len(src) * cache.layout.block_bytes * s.count // (
                        heads // d)
                _assert_rank_heads(cache, full, src, dst, j)
            cache.close()


@pytest.mark.parametrize("ids", _pairs(), ids=lambda p: f"cuda{p[0]}-to-cuda{p[1]}")
@pytest.mark.parametrize("head_dim,dtype,heads,src_heads,dst_heads,tile", [
    (128, "float16", (4, 8), (0, 4), (4, 8), 16384),  # the bench's: 16-byte accesses
    (128, "float16", (4, 8), (0, 4), (4, 8), 512),    # a row wider than a program's tile
    (24, "float16", (6, 3), (1, 4), (0, 3), 16384),   # a row padded to a power of 2, masked
    (3, "int8", (4, 2), (2, 4), (0, 2), 16384),       # byte words
], ids=["wide", "split-rows", "padded", "bytes"])
def test_head_gather_kernel_copies_the_slice_and_nothing_else(monkeypatch, ids, head_dim, dtype,
                                                              heads, src_heads, dst_heads, tile):
    """HeadGather's kernel alone (30 token rows a block: no power of 2), from the source's GPU:
    the slice's heads of every destination block equal the source's, and every other byte of
    the destination is as it was; a second request launches the compiled kernel directly."""
    if not _has_triton():
        pytest.skip("the head kernel is Triton's")
    import torch

    from kvruntime.engines import gather
    from kvruntime.tp import HeadSlice

    monkeypatch.setattr(gather, "HEAD_TILE_BYTES", tile)
    theirs = KVLayout(CROSS_LAYER, 3, 40, 5, heads[0], head_dim, dtype)
    ours = KVLayout(CROSS_LAYER, 3, 24, 5, heads[1], head_dim, dtype)
    gen = torch.Generator().manual_seed(head_dim)
    src = torch.randint(0, 256, (theirs.region_bytes,), dtype=torch.uint8, generator=gen)
    dst = torch.randint(0, 256, (ours.region_bytes,), dtype=torch.uint8, generator=gen)
    src, dst = src.to(f"cuda:{ids[0]}"), dst.to(f"cuda:{ids[1]}")
    want = dst.clone()
    s_ids, d_ids = [3, 0, 39, 17, 5], [23, 1, 0, 9, 22]
    slice_ = HeadSlice(0, src_heads, dst_heads)
    stream = torch.cuda.Stream(device=ids[0])
    with torch.cuda.device(ids[0]), torch.cuda.stream(stream):
        hg = gather.HeadGather([src], [dst], theirs, ours, stream)
        hg.warm(slice_)
        for _ in range(2):
            hg.copy(s_ids, d_ids, slice_)
        stream.synchronize()
    assert hg._kernels.direct > 0
    de, rows = head_dim * theirs.element_bytes, 3 * 2 * 5
    (s0, s1), (d0, d1) = src_heads, dst_heads
    want.view(24, rows, heads[1], de)[d_ids, :, d0:d1] = (
        src.view(40, rows, heads[0], de)[s_ids][:, :, s0:s1].to(want.device))
    assert torch.equal(dst, want)


def test_connect_reads_back_the_lanes_ucx_chose_for_vram(prefill):
    """The connect-time probe makes UCX select the protocol for VRAM before any KV moves; the
    lanes it logged are read back, and device memory is not on TCP (else connect refuses)."""
    layout = small(CROSS_LAYER)
    with prefill([layout], seed=5, device="cuda", device_id=DEVICE_ID) as (_proc, ports):
        cache = KVCache.allocate_device(layout, "cuda", DEVICE_ID)
        with DecodeClient(cache, device_kind="cuda", engine="nixl") as client:
            peer = client.connect("127.0.0.1", ports[0])
            print("all lanes:", *map(str, peer.lanes), sep="\n  ")
            rma = [lane for lane in peer.lanes if lane.scope != "self" and lane.memories
                   and lane.memories == ("cuda", "cuda")]
            assert rma, peer.lanes
            assert all("tcp" not in lane.transports for lane in rma), rma
            print("VRAM lanes:", *map(str, rma), sep="\n  ")
        cache.close()


def test_a_user_forcing_tcp_for_vram_gets_a_loud_warning():
    """UCX_TLS set by the user to tcp only: the transfers still run (the user asked) and the
    warning names the lane; never silent."""
    proc = subprocess.run([sys.executable, "-m", "kvruntime", "selftest", "--json",
                           "--tp-pairs", "none"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "UCX_TLS": "tcp,cuda_copy"})
    report = json.loads(proc.stdout)
    cuda = [m for m in report["modes"] if m["mode"].startswith("cuda/")
            and m["mode"].endswith("/nixl") and m["status"] != "skipped"]
    assert cuda, (report, proc.stderr[-3000:])
    assert "UCX moves device memory over TCP" in proc.stderr, proc.stderr[-3000:]
    print(*(f"{m['mode']} {m['status']} {m.get('gbps')} GB/s {m.get('transports')}"
            for m in cuda), sep="\n")


def _check_run_then_scatter(pool, run, src, dst, heads, scatter) -> None:
    """``run`` (on the device) holds heads ``heads`` of cache blocks ``src`` region by region;
    then ``scatter()`` writes it into those heads of blocks ``dst`` and nothing else."""
    import torch

    h0, h1 = heads
    ids = torch.as_tensor(src, device=run.device)
    for r, view in enumerate(pool._regions()):
        assert torch.equal(run[r], view[:, :, h0:h1].index_select(0, ids))
    before = [v.clone() for v in pool._regions()]
    scatter()
    dids = torch.as_tensor(dst, device=run.device)
    for r, view in enumerate(pool._regions()):
        want = before[r].clone()
        want[dids, :, h0:h1] = run[r]
        assert torch.equal(view, want)


@pytest.mark.parametrize("kind", [CROSS_LAYER, PER_LAYER])
@pytest.mark.parametrize("heads", [None, (1, 3)])
def test_staged_copies_through_the_bounce_ring_are_bit_exact(kind, heads):
    """Slots of two block rows, so regions split, fills wrap the ring and calls queue behind
    each other; compared with the device's own index ops on the same tensors."""
    import numpy as np

    from kvruntime.pools.staging import StagingPool

    layout = small(kind)
    cache = KVCache.allocate_device(layout, "cuda", DEVICE_ID)
    cache.fill_random(5)
    row = layout.tokens_per_block * layout.num_kv_heads * layout.head_dim * 2
    pool = StagingPool(layout, 40, cache, bounce_bytes=2 * row)
    try:
        h0, h1 = heads or (0, layout.num_kv_heads)
        rnd = np.random.default_rng(3)
        src, dst = rnd.choice(64, 30, replace=False), rnd.choice(64, 30, replace=False)
        pool.gather(src, 0, heads)
        _check_run_then_scatter(pool, pool._run(0, 30, h1 - h0).cuda(), src, dst, (h0, h1),
                                lambda: pool.scatter(0, dst, heads))
    finally:
        pool.close()
        cache.close()


@pytest.mark.parametrize("kind", [CROSS_LAYER, PER_LAYER])
@pytest.mark.parametrize("heads", [None, (1, 3)])
def test_coalesced_vram_pool_copies_chunk_by_chunk_are_bit_exact(kind, heads):
    """A device pool's gather and scatter (poolcopy.py: whole regions of a cross_layer cache as
    one op along the block dimension, partial ones alone) in chunks that start and end inside
    regions, compared with the device's own index ops region by region."""
    import numpy as np

    from kvruntime.pools.staging import StagingPool

    layout = small(kind)
    cache = KVCache.allocate_device(layout, "cuda", DEVICE_ID)
    cache.fill_random(9)
    pool = StagingPool(layout, 40, cache, memory="device")
    try:
        h0, h1 = heads or (0, layout.num_kv_heads)
        rnd = np.random.default_rng(4)
        src, dst = rnd.choice(64, 30, replace=False), rnd.choice(64, 30, replace=False)
        rows = 2 * layout.num_layers * 30
        cuts = [0, 7, 30, 95, 150, rows]  # inside regions, across several whole ones
        for lo, hi in zip(cuts, cuts[1:]):
            pool.gather(src, 0, heads, (lo, hi))

        def scatter():
            for lo, hi in zip(cuts, cuts[1:]):
                pool.scatter_async(0, dst, heads, (lo, hi))
            pool.scatter(0, dst, heads)  # the whole run again, after the chunks on its stream

        _check_run_then_scatter(pool, pool._run(0, 30, h1 - h0), src, dst, (h0, h1), scatter)
    finally:
        pool.close()
        cache.close()


def test_bench_bounce_reports_gather_and_scatter_beside_pinned_copies():
    out = subprocess.run([sys.executable, "-m", "kvruntime.tools.bench_bounce", "--mib", "16",
                          "--slots-mib", "4", "--iters", "2", "--layouts", "cross_layer"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout.splitlines()[-1])
    assert row["slot_mib"] == 4 and row["bytes"] == 16 << 20
    assert row["gather_gbps"] > 0 and row["scatter_gbps"] > 0
    assert row["gather_timeline"]["copy_stream_ms"] > 0


def test_the_runtime_calls_order_work_like_torchs_own():
    """cudart.StreamScope makes a stream torch's current one and gives the caller's back; an
    IdUploads upload, a runtime copy and a runtime event on that stream are ordered with the
    kernels queued there (a long kernel first: the copy must wait for it)."""
    import numpy as np
    import torch

    from kvruntime.host import cudart

    dev = torch.device("cuda", DEVICE_ID)
    caller = torch.cuda.current_stream(dev)
    s = torch.cuda.Stream(device=dev)
    with cudart.StreamScope(s):
        assert torch.cuda.current_stream(dev) == s
    assert torch.cuda.current_stream(dev) == caller

    ups = cudart.IdUploads(dev, s)
    big = torch.ones(1 << 26, device=dev)
    out = torch.zeros(8, dtype=torch.int64, device=dev)
    with cudart.StreamScope(s):
        for _ in range(20):
            big.mul_(1.0001)  # queued first, on the stream
        buf, at = ups.upload(np.arange(5), np.arange(10, 13))
        cudart.copy_async(out.data_ptr(), buf.data_ptr() + at[1] * 8, 3 * 8, s.cuda_stream)
        done = cudart.Event().record(s.cuda_stream)
    done.synchronize()
    assert out[:3].tolist() == [10, 11, 12] and out[3:].tolist() == [0] * 5
    assert buf[:5].tolist() == [0, 1, 2, 3, 4] and at == [0, 6]
    assert done.query()


def test_the_peers_gpu_is_found_by_uuid_when_it_numbers_gpus_otherwise(prefill, monkeypatch):
    """Deployments give each process its own CUDA_VISIBLE_DEVICES, so the prefill's cuda:0 is
    our cuda:1 here. The same-node engine opens its memory on our index of its GPU (found by
    UUID), for a decode on that GPU and on the other one; the bytes are checked by digest."""
    import contextlib

    import torch

    from kvruntime.engines.samenode import visible_gpus

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    torch.cuda.init()  # our device list is fixed now, before the prefill's environment changes
    ours = os.environ.get("CUDA_VISIBLE_DEVICES")
    second = ours.split(",")[1] if ours else "1"
    uuids = visible_gpus()
    assert len(uuids) == torch.cuda.device_count() and all(len(u) >= 32 for u in uuids)
    layout = small(CROSS_LAYER)
    with contextlib.ExitStack() as stack:
        with monkeypatch.context() as env:
            env.setenv("CUDA_VISIBLE_DEVICES", second)  # the prefill sees our cuda:1 alone
            _proc, ports = stack.enter_context(
                prefill([layout], seed=23, secret=b"k", device="cuda", device_id=0))
        for here in (1, 0):
            cache = stack.enter_context(contextlib.closing(
                KVCache.allocate_device(small(CROSS_LAYER, blocks=80), "cuda", here)))
            client = stack.enter_context(
                DecodeClient(cache, secret=b"k", device_kind="cuda", engine="samenode"))
            peer = client.connect("127.0.0.1", ports[0])
            assert peer.engine == "samenode:cuda-ipc"
            assert {t.device.index for t in peer.samenode.remote} == {1}
            for op in ("pull", "push"):
                src, dst = list(range(0, 40, 2)), list(range(50, 70))  # 20 runs: the kernel
                cache.fill_value(0)
                getattr(peer, op)(src, dst, timeout=30)
                assert cache.block_digests(dst) == peer.digests(src)


@pytest.mark.parametrize("ids", _pairs(), ids=lambda p: f"cuda{p[0]}-to-cuda{p[1]}")
@pytest.mark.parametrize("kind", [CROSS_LAYER, PER_LAYER])
def test_the_cuda_engine_rehearses_into_scratch_at_connect(prefill, kind, ids):
    """The connect runs a pull's path on the same-node CUDA engine (PrefillPeer.rehearse) with
    its copies into scratch: every block of the decode cache keeps its canary through the
    connect, the rehearsal launched the engine's compiled kernels directly (Triton), and the
    first pull is bit-exact."""
    layout = small(kind)
    with prefill([layout], seed=24, device="cuda", device_id=ids[0]) as (_proc, ports):
        cache = KVCache.allocate_device(layout, "cuda", ids[1])
        cache.fill_value(0x5A)
        canary = cache.block_digest(0)
        with DecodeClient(cache, device_kind="cuda", engine="samenode") as client:
            peer = client.connect("127.0.0.1", ports[0])
            assert peer.engine == "samenode:cuda-ipc"
            assert cache.block_digests(range(64)) == [canary] * 64
            kernels = peer.samenode.gather._kernels
            if _has_triton():
                assert kernels is not None and kernels.direct > 0
            src, dst = list(range(0, 40, 2)), list(range(30, 50))  # 20 runs: the kernel
            peer.pull(src, dst, timeout=30)
            assert peer.digests(src) == cache.block_digests(dst)
            others = sorted(set(range(64)) - set(dst))
            assert cache.block_digests(others) == [canary] * len(others)
        cache.close()


@pytest.mark.parametrize("ids", _pairs(), ids=lambda p: f"cuda{p[0]}-to-cuda{p[1]}")
@pytest.mark.parametrize("kind", [CROSS_LAYER, PER_LAYER])
def test_coalesced_pulls_and_pushes_through_vram_pools_are_bit_exact(prefill, kind, ids):
    """NIXL forced, coalesce="always": both sides' staging pools in VRAM (coalesce.py), the
    gather and scatter torch index ops on the device; blocks not named keep their canary."""
    layout = small(kind, blocks=96)
    with prefill([layout], seed=23, device="cuda", device_id=ids[0],
                 staging_blocks=48) as (_proc, ports):
        cache = KVCache.allocate_device(layout, "cuda", ids[1])
        cache.fill_value(0x5A)
        canary = cache.block_digest(0)
        with DecodeClient(cache, device_kind="cuda", engine="nixl", coalesce="always",
                          staging_blocks=48) as client:
            assert client.pool.memory == "device" and client.pool.cache.mem_type == "VRAM"
            peer = client.connect("127.0.0.1", ports[0])
            assert peer.route is not None and peer.route.remote_mem == "VRAM"
            src, dst = [3, 90, 17, 4, 5, 6, 60, 61, 33], [0, 9, 18, 27, 36, 45, 54, 63, 72]
            for op in ("pull", "push"):
                res = getattr(peer, op)(src, dst, timeout=30)
                assert res.coalesced and res.engine == "nixl"
                assert peer.digests(src) == cache.block_digests(dst)
            others = sorted(set(range(96)) - set(dst))
            assert cache.block_digests(others) == [canary] * len(others)
        cache.close()


@pytest.mark.parametrize("ids", _pairs(), ids=lambda p: f"cuda{p[0]}-to-cuda{p[1]}")
def test_a_decodes_vram_is_mapped_by_the_prefill_at_its_connect(ids):
    """prefill/warm.py on device memory: before any push, the prefill READs a few bytes of
    each of the decode's regions (so that UCX maps them then, not in the first push's post),
    in READs of at most BATCH regions, then WRITEs into the decode's scratch (UCX's put
    chosen then); the push after lands bit-exact. Both sides in this
    process (UCX copies within one process without CUDA IPC): the wait drives the decode's
    progress too, which across processes the IPC copy would not need."""
    import math
    import time

    from kvruntime.prefill import warm
    from kvruntime.prefill.server import PrefillServer

    layout = small(PER_LAYER)
    src = KVCache.allocate_device(layout, "cuda", ids[0])
    dst = KVCache.allocate_device(layout, "cuda", ids[1])
    src.fill_random(8)
    with PrefillServer(src, coalesce="never") as server, \
            DecodeClient(dst, engine="nixl", coalesce="never") as client:
        peer = client.connect(*server.address)
        until = time.monotonic() + 30
        while server.stats.warmed < 1:
            assert time.monotonic() < until and server.stats.warm_failed == 0
            client.get_finished()
            time.sleep(0.002)
        assert server.writes.warms.reads == math.ceil(layout.num_regions / warm.BATCH)
        assert server.writes.warms.writes == 1  # the decode's scratch, in its VRAM
        peer.push([1, 2], [5, 6], timeout=30)
        assert dst.block_digests([5, 6]) == src.block_digests([1, 2])
    src.close(), dst.close()
