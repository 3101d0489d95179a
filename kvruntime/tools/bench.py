"""``python -m kvruntime bench``: GB/s, descriptors per request and handshake time.

The decode side runs in this process, the prefill side in a spawned one; both keep their caches
in host memory (``device="cpu"``) or in device memory (``"cuda"``/``"xpu"`` tensors on explicit
device ids). Every transfer is measured beside a reference copy of the same size in the same run
(host ``memmove`` between two buffers with the same page setting; on a GPU a device-to-device
``copy_``, i.e. cudaMemcpy), because hosts are noisy: compare ratios taken together, not figures
from different runs. Columns follow nixlbench's (block size, batch size,
average latency, bandwidth) plus the reference and the ratio.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

from .. import native
from ..memory import device_unavailable, thp_mode
from ..plan import make_plan
from .references import DeviceReference, HostReference
from .roles import allocate_cache, prefill_main, prefill_push, prepare_process, reap
from .workload import bench_layout, pick_blocks, spread


@dataclass
class BenchConfig:
    sizes_mib: list = field(default_factory=lambda: [64, 256, 1024])
    patterns: list = field(default_factory=lambda: ["contiguous", "random"])
    layouts: list = field(default_factory=lambda: ["cross_layer", "per_layer"])
    ops: list = field(default_factory=lambda: ["pull", "push"])  # and "prefill_push"
    splits: list = field(default_factory=lambda: [None])  # None: the client's read_split
    ucx_threads: int | None = None  # None: each side chooses (agent.ucx_threads)
    host_streams: int | None = None  # None: the client chooses (samenode.host_copy_streams)
    huge_pages: bool = True
    iters: int = 5
    block_kib: int = 256
    nixl_module: str | None = None
    handshakes: int = 10
    seed: int = 7
    device: str = "cpu"  # "cpu" (host DRAM), "cuda" or "xpu" (VRAM)
    device_ids: list = field(default_factory=lambda: [0, 0])  # (prefill's, decode's)
    engines: list = field(default_factory=lambda: ["nixl", "samenode"])
    bare: bool = True  # also time a bare transfer of the same bytes (kvruntime's overhead)
    inflight: list = field(default_factory=lambda: [4, 32])  # decode peers, requests; [] off
    kv_buffer: str = "device"  # "host_staged": both sides through their staging pools
    # mixed TP rows (bench_tp.py): groups "PxD" or "PxDxN", every rank a process on its device
    tp_pairs: list = field(default_factory=list)
    tp_engines: list = field(default_factory=lambda: ["samenode", "nixl", "staged"])
    tp_ops: list = field(default_factory=lambda: ["pull", "prefill_push"])
    tp_placements: list = field(default_factory=list)  # per group: a device id a rank, or []
    tp_only: bool = False  # the TP rows alone (a --scenario)
    # NIXL clients' coalesce modes (coalesce.py), a row set each; the pools are sized for the
    # largest request on both sides
    coalesce: list = field(default_factory=lambda: ["auto"])


def run_bench(cfg: BenchConfig) -> dict:
    from ..decode.client import DecodeClient
    from ..engines.samenode import SameNodeUnavailable
    from ..nixl.binding import load_nixl
    from ..nixl.transports import ucx_environment

    report: dict = {"tool": "kvruntime bench", "config": asdict(cfg), "thp": thp_mode(),
                    "results": [], "ok": False}
    reason = device_unavailable(cfg.device)
    if reason is not None:
        report["error"] = f"cannot bench {cfg.device} memory: {reason}"
        return report
    options = {"nixl_module": cfg.nixl_module, "huge": cfg.huge_pages,
               "ucx_threads": cfg.ucx_threads, "device": cfg.device,
               "kv_buffer": cfg.kv_buffer}
    staged = cfg.kv_buffer == "host_staged"
    if staged:
        cfg.inflight = []  # engines: nixl moves the staged run, samenode reads it (same host)
    # a pool of a little more than the largest request, on both sides (host-staged, or the
    # direct sides' pools for coalesced requests)
    options["staging_blocks"] = -(-max(cfg.sizes_mib) * 1024 // cfg.block_kib) + 1
    from ..errors import TransportError
    from ..nixl.transports import CrossHost, cross_host, describe, rdma_facts

    # the choice across hosts, from the environment prepare_process starts from (the same
    # inputs give the same choice; after it, every setting would read as the user's)
    kind = "cpu" if staged else cfg.device  # what NIXL moves (roles.prepare_process)
    host, offered = rdma_facts(kind, os.environ, None if kind == "cpu" else cfg.device_ids[1])
    try:
        cross = cross_host(kind, os.environ, offered, host)
    except TransportError as exc:  # prepare_process refuses it too, with the same line
        cross = CrossHost(lines=(f"refused: {exc}",))
    added = prepare_process(options)  # this process is the decode side: UCX before NIXL
    report["ucx_env"] = ucx_environment()  # what the figures ran under (both sides)
    report["id_reader"] = native.status()  # block-id lists: the native scan, or array('q')
    # what, and why; for Intel GPU memory the transport choice too (ze_ipc, or why ze_copy
    # alone); then across hosts. Keyed by memory kind, as selftest's (the CLI prints both alike)
    report["ucx_policy"] = {cfg.device: describe(added, report["ucx_env"], cfg.device, offered,
                                                 cross)}
    if cfg.device != "cpu":
        report["device"] = _device_name(cfg.device, cfg.device_ids)
    binding = load_nixl(cfg.nixl_module)
    report["nixl_module"] = binding.module_name
    if cfg.tp_only:
        return _with_tp(report, cfg)
    max_mib = max(cfg.sizes_mib)
    layouts = [bench_layout(k, cfg.block_kib, max_mib) for k in cfg.layouts]
    ctx = mp.get_context("spawn")
    ready_q, control = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=prefill_main, name="prefill", daemon=True,
                       args=(ready_q, control, [lay.to_dict() for lay in layouts], cfg.seed,
                             {**options, "device_id": cfg.device_ids[0]}))
    decode_options = {**options, "device_id": cfg.device_ids[1]}
    clients, caches = [], []
    reference = None
    try:
        proc.start()
        ready = ready_q.get(timeout=300)
        if not ready.get("ok"):
            report["error"] = ready.get("error")
            return report
        reference = (HostReference(max_mib << 20, cfg.huge_pages) if cfg.device == "cpu" else
                     DeviceReference(max_mib << 20, cfg.device, cfg.device_ids))
        rnd = random.Random(cfg.seed)
        for index, (layout, port) in enumerate(zip(layouts, ready["ports"])):
            cache = allocate_cache(layout, decode_options)
            caches.append(cache)
            runs = [(e, c) for e in cfg.engines
                    for c in (cfg.coalesce if e == "nixl" and not staged else ["auto"])]
            for engine, coalesce in runs:
                client = DecodeClient(cache, binding=binding, ucx_threads=cfg.ucx_threads,
                                      host_streams=cfg.host_streams,
                                      device_kind=cfg.device, engine=engine,
                                      kv_buffer=cfg.kv_buffer,
                                      staging_blocks=options.get("staging_blocks", 0),
                                      coalesce=coalesce)
                clients.append(client)
                if staged and cfg.device != "cpu":
                    report.setdefault("staging_copies", []).append(
                        _staging_copies(client.staging, layout, rnd, cfg))
                hs = []
                try:
                    for _ in range(max(1, cfg.handshakes)):
                        peer = client.connect("127.0.0.1", port)
                        hs.append(peer.handshake_seconds * 1e3)
                except SameNodeUnavailable as exc:
                    report.setdefault("skipped", []).append(
                        {"layout": layout.kind, "engine": engine, "reason": str(exc)})
                    continue
                key = f"{layout.kind}/{engine}" + (f"/{coalesce}" if len(cfg.coalesce) > 1 and
                                                   engine == "nixl" else "")
                report.setdefault("handshake_ms", {})[key] = {
                    "first": round(hs[0], 3),
                    "median_later": round(statistics.median(hs[1:]), 3) if len(hs) > 1 else None,
                    "all": [round(h, 3) for h in hs]}
                report.setdefault("engines", {})[key] = {
                    "engine": peer.engine, "reason": peer.engine_reason,
                    "coalesce": coalesce, "coalesce_reason": peer.coalesce_reason,
                    "coalesce_model": (peer.coalesce_model.to_dict() if peer.coalesce_model
                                       else None),
                    "staged_copy": peer.staged_copy,
                    "ucx_threads": [client.agent.ucx_threads, client.ucx_threads_reason],
                    "host_streams": [client.host_streams, client.host_streams_reason]}
                for op in cfg.ops:
                    for pattern in cfg.patterns:
                        for size in cfg.sizes_mib:
                            for split in cfg.splits:
                                report["results"].append(_measure(
                                    cfg, peer, cache, layout, reference, rnd, op, pattern,
                                    size, split, (control, ready_q, index)))
                # what UCX really used for this client's transfers (ucxlog.py)
                report["engines"][key]["transports"] = client.agent.transports()
                if cfg.inflight and (engine, coalesce) == runs[-1]:
                    from .bench_inflight import run_inflight

                    report.setdefault("inflight", []).append(run_inflight(
                        cfg, binding, layout, port, decode_options, engine, rnd))
        return _with_tp(report, cfg)
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        if not proc.is_alive():
            report["error"] += f" (the prefill process exited with code {proc.exitcode})"
        return report
    finally:
        for client in clients:
            client.close()
        for cache in caches:
            cache.close()
        if reference is not None:
            reference.close()
        reap(proc, control)


def _with_tp(report: dict, cfg: BenchConfig) -> dict:
    """The report, with the mixed-TP rows where asked for; failed where a row failed (an
    error, a rank's heads not bit-exact, device memory over TCP); an engine a group's ranks
    refused (``skipped``, with the reason) is no failure."""
    if cfg.tp_pairs:
        from .bench_tp import run_tp

        report["tp"] = run_tp(cfg)
        bad = [f"tp {r['group']} {r.get('engine', r['kv_buffer'])} {r.get('op', '')}: "
               + (r.get("error") or ("device memory over TCP" if r.get("tcp_for_device_memory")
                                     else "a rank's heads differ from the prefill's"))
               for r in report["tp"] if "error" in r or r.get("bit_exact") is False
               or r.get("tcp_for_device_memory")]
        if bad:
            report["error"] = "; ".join(bad)
            return report
    report["ok"] = True
    return report


def _measure(cfg, peer, cache, layout, reference, rnd, op, pattern, size, split,
             prefill) -> dict:
    """One row: ``iters`` requests of ``size`` MiB, each beside a same-run reference copy; for
    NIXL pulls and same-node copies also a bare transfer of the same bytes next to each
    request, after it and before it in turn (kvruntime's own overhead: a NIXL READ of the same
    descriptors, the engine's copy of the same plan; a NIXL push's WRITE is the prefill's and
    has none here). ``prefill_push``: the prefill process starts each push (``prefill``: its
    command queue, its reply queue, the server's index), timed from its ``start_push``."""
    if op == "prefill_push":
        control, replies, index = prefill
        move = lambda s, d, timeout, **_: prefill_push(  # noqa: E731
            peer, control, replies, index, f"bench-push-{next(_push_ids)}", s, d, timeout)
    else:
        move = peer.pull if op == "pull" else peer.push
    count = max(1, (size << 20) // layout.block_bytes)
    src, dst = pick_blocks(pattern, count, layout.num_blocks, rnd)
    opts = {"timeout": 120} if split is None else {"timeout": 120, "split": split}  # None: default
    t = time.perf_counter()
    res0 = move(src, dst, **opts)  # warm-up: the first request of its kind on this connection
    first_us = (time.perf_counter() - t) * 1e6
    rates, refs, lats, bare, res = [], [], [], [], None
    bare_one = None
    if cfg.bare and peer.mover.reads_direct and op == "pull" and not res0.coalesced:
        bare_one = lambda: _bare_read(peer, src, dst, split)  # noqa: E731
    elif cfg.bare and peer.samenode is not None:  # a push is our copy there too
        bare_one = lambda: _bare_copy(peer, src, dst)  # noqa: E731
    for i in range(cfg.iters):
        refs.append(reference.gbps(count * layout.block_bytes))
        # the bare transfer before the request every other time: whichever goes second finds
        # the memory (and the GPU's translations of it) warm from the first
        if bare_one is not None and i % 2:
            bare.append(bare_one() * 1e6)
        res = move(src, dst, **opts)
        rates.append(res.gbps)
        lats.append(res.seconds * 1e6)
        if bare_one is not None and not i % 2:
            bare.append(bare_one() * 1e6)
    gbps, ref = statistics.median(rates), statistics.median(refs)
    pairs = [r / f for r, f in zip(rates, refs)]
    row = {
        "layout": layout.kind, "op": op, "pattern": pattern, "engine": res.engine,
        "split": "auto" if split is None else split, "ucx_threads": peer.client.agent.ucx_threads,
        "memory": cache.mem_type,
        "staged_copy": peer.staged_copy,
        "huge_pages": cfg.huge_pages, "size_bytes": res.nbytes, "block_size": layout.block_bytes,
        "batch_size": count, "runs": res.runs, "descriptors": res.descriptors,
        "nixl_descriptors": res.nixl_descriptors,
        "coalesce": peer.client.coalesce, "coalesced": res.coalesced,
        "coalesce_reason": res.coalesce_reason,
        "first_request_us": round(first_us, 1),
        "avg_lat_us": round(statistics.mean(lats), 1),
        "median_lat_us": round(statistics.median(lats), 1),
        "gbps": round(gbps, 3), "gbps_max": round(max(rates), 3),
        "ref_gbps": round(ref, 3), "ref": reference.label, "ratio": round(gbps / ref, 3),
        "ratio_pairs_median": round(statistics.median(pairs), 3),
        # spread over the iterations (hosts are noisy)
        "spread": {"gbps": spread(rates), "ref_gbps": spread(refs), "ratio_pairs": spread(pairs)},
    }
    local = getattr(reference, "local_gbps", lambda n: None)(count * layout.block_bytes)
    if local is not None:
        row["local_copy_gbps"] = round(local, 3)
    if bare:
        # each request against the bare transfer next to it: the median of those differences
        # (two medians apart would mix a slow request with a fast bare one)
        over = [lat - b for lat, b in zip(lats, bare)]
        row["bare_us"] = round(statistics.median(bare), 1)
        row["bare"] = ("NIXL READ of the same descriptors" if peer.mover.reads_direct else
                       f"{peer.engine} engine's copy of the same plan")
        row["overhead_us"] = round(statistics.median(over), 1)
        row["spread"]["overhead_us"] = [round(min(over), 1), round(max(over), 1)]
    return row


def _staging_copies(pool, layout, rnd, cfg) -> dict:
    """The staging copies alone, beside a contiguous pinned copy of the same bytes in the same
    run: gather of random blocks device -> pool vs one device -> pinned copy, and pool -> device
    scatter vs one pinned -> device copy."""
    import numpy as np
    import torch

    fits = pool.units // layout.num_kv_heads  # the pool counts in heads of blocks
    count = min(fits, max(1, (max(cfg.sizes_mib) << 20) // layout.block_bytes))
    blocks = np.array(rnd.sample(range(layout.num_blocks), count))  # as the roles pass them
    nbytes = count * layout.block_bytes
    dev = pool._device[0].device
    module = getattr(torch, dev.type)
    flat = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    host = pool._pool[:nbytes]

    def timed(fn) -> float:
        module.synchronize(dev)
        t = time.perf_counter()
        fn()
        module.synchronize(dev)
        return nbytes / (time.perf_counter() - t) / 1e9

    rows = {"gather": [], "d2h": [], "scatter": [], "h2d": []}
    for _ in range(cfg.iters + 1):
        rows["gather"].append(timed(lambda: pool.gather(blocks, 0)))
        rows["d2h"].append(timed(lambda: host.copy_(flat, non_blocking=True)))
        rows["scatter"].append(timed(lambda: pool.scatter(0, blocks)))
        rows["h2d"].append(timed(lambda: flat.copy_(host, non_blocking=True)))
    med = {k: statistics.median(v[1:]) for k, v in rows.items()}  # first: warm-up
    return {"layout": layout.kind, "blocks": count, "bytes": nbytes, "pinned": pool._pinned,
            "gather_gbps": round(med["gather"], 3), "d2h_pinned_gbps": round(med["d2h"], 3),
            "gather_ratio": round(med["gather"] / med["d2h"], 3),
            "scatter_gbps": round(med["scatter"], 3), "h2d_pinned_gbps": round(med["h2d"], 3),
            "scatter_ratio": round(med["scatter"] / med["h2d"], 3)}


_push_ids = itertools.count()


def _bare_read(peer, src, dst, split) -> float:
    """Seconds of a NIXL READ of the same descriptors driven directly (prepped lists made
    once, as kvruntime has them; no notification, as kvruntime posts it): make_prepped_xfer,
    transfer, check_xfer_state until DONE."""

    client = peer.client
    nixl = client.agent.nixl
    plan = make_plan(peer.info.layout, src, client.cache.layout, dst)
    src_idx, dst_idx = plan.nixl_indices(peer.read_split(plan) if split is None else split)
    local, remote = client.registration.local_dlist, client.registration.peer_dlist(peer.agent)
    t = time.perf_counter()
    handle = nixl.make_prepped_xfer("READ", local, dst_idx, remote, src_idx, b"")
    state = nixl.transfer(handle)
    while state == "PROC":
        state = nixl.check_xfer_state(handle)
    seconds = time.perf_counter() - t
    handle.release()
    if state != "DONE":
        raise RuntimeError(f"bare NIXL READ ended in state {state}")
    return seconds


def _bare_copy(peer, src, dst) -> float:
    """Seconds of the same-node engine's copy of the same blocks driven directly: the plan
    made beforehand, the engine's start (the gather, or the runtime's copies of runs, and its
    completion event), then its job polled until done; no handle, no release, no clock of
    kvruntime's around it."""
    engine = peer.samenode
    plan = make_plan(peer.info.layout, src, peer.client.cache.layout, dst)
    t = time.perf_counter()
    job = engine.start("READ", plan, peer.head_slice)
    block = getattr(job, "block", None)
    while job.poll() == "PROC":
        if block is not None:
            block(0.0002)
    seconds = time.perf_counter() - t
    if job.state != "DONE":
        raise RuntimeError(f"bare same-node copy ended in state {job.state}: {job.error}")
    return seconds


def _device_name(device: str, device_ids) -> str:
    import torch

    module = getattr(torch, device)
    names = [f"{device}:{i} {module.get_device_name(i)}" for i in dict.fromkeys(device_ids)]
    return f"{', '.join(names)} (torch {torch.__version__})"
