"""``python -m kvruntime selftest``: prove KV blocks cross between two processes, bit-exact.

A prefill process serves one cache per layout (random content); a decode process handshakes
over loopback, runs every mode this host offers (layouts x pull/push, and a push the prefill
process starts into blocks the decode named), and compares a digest of every moved block with
the prefill side's. Modes the host cannot run are reported as skipped
with the reason, never as passed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

from .. import native
from ..layout import CROSS_LAYER, PER_LAYER, KVLayout
from ..memory import device_unavailable
from .placement import Group, place
from .roles import (
    allocate_cache,
    answer,
    device_of,
    prefill_main,
    prefill_push,
    prepare_process,
    reap,
)

OPS = ("pull", "push")
# what each engine's client proves: a push the prefill starts is NIXL's WRITE and notification
# to a NIXL decode, the decode's own copy to a same-node one (its "ready"); staged: none
ENGINE_OPS = {"nixl": OPS + ("prefill_push",), "samenode": OPS + ("prefill_push",),
              "staged": OPS}
# NIXL always (it is what the installer verifies), and the same-node engine beside it; the
# host-staged modes ("staged") run in a pair of their own.
ENGINES = ("nixl", "samenode")
SELFTEST_SHAPE = dict(num_layers=4, num_blocks=256, tokens_per_block=16, num_kv_heads=8,
                      head_dim=128, dtype="float16")


def request_blocks(num_blocks: int, seed: int) -> tuple[list[int], list[int]]:
    """A request mixing runs and singles, landing on different destination ids."""
    import random

    rnd = random.Random(seed)
    src: list[int] = []
    start = 0
    while len(src) < num_blocks // 4:
        start += rnd.randint(1, 6)
        length = rnd.choice((1, 1, 3, 8))
        src.extend(b for b in range(start, start + length) if b < num_blocks)
        start += length
    src = sorted(set(src))[: num_blocks // 4]
    shift = rnd.randint(1, num_blocks - 1)
    return src, [(b + shift) % num_blocks for b in src]


DEVICES = ("cuda", "xpu")


def mode_name(device: str, kind: str, op: str, engine: str = "nixl") -> str:
    return f"{'host' if device == 'cpu' else device}/{kind}/{op}/{engine}"


def skipped_modes(device: str, reason: str, engines=ENGINES + ("staged",),
                  kinds=(CROSS_LAYER, PER_LAYER)
                  ) -> list[dict]:
    memory = "DRAM" if device == "cpu" else "VRAM"
    return [{"mode": mode_name(device, kind, op, engine), "layout": kind, "op": op,
             "engine": engine, "memory": memory, "status": "skipped", "reason": reason}
            for kind in kinds for engine in engines for op in ENGINE_OPS[engine]]


def _report(result_queue, modes: list, role) -> None:
    """Run a decode role (``role()`` appends to ``modes`` and returns the NIXL module's name)
    and put its outcome on ``result_queue``, failed or not: the modes done so far survive."""
    try:
        result_queue.put({"ok": True, "modes": modes, "module": role()})
    except BaseException as exc:
        result_queue.put({"ok": False, "modes": modes, "error": f"{type(exc).__name__}: {exc}",
                          "trace": traceback.format_exc()})


def decode_main(result_queue, ports: list[int], layouts: list[dict], seed: int,
                options: dict) -> None:
    modes: list = []
    _report(result_queue, modes, lambda: _decode_every_mode(modes, ports, layouts, seed, options))


def _decode_every_mode(modes, ports, layouts, seed, options) -> str:
    client_objs, caches = [], []
    try:
        prepare_process(options)
        from ..decode.client import DecodeClient
        from ..engines.samenode import SameNodeUnavailable
        from ..nixl.binding import load_nixl

        device = device_of(options)
        binding = load_nixl(options.get("nixl_module"))
        for port, spec in zip(ports, layouts):
            layout = KVLayout.from_dict(spec)
            cache = allocate_cache(layout, options)
            staged = options.get("kv_buffer") == "host_staged"
            for engine in (("staged",) if staged else ENGINES):
                client = DecodeClient(cache, binding=binding, secret=options.get("secret"),
                                      device_kind=device, engine="nixl" if staged else engine,
                                      kv_buffer=options.get("kv_buffer", "device"),
                                      staging_blocks=options.get("staging_blocks", 0))
                client_objs.append(client)
                try:
                    peer = client.connect("127.0.0.1", port)
                except SameNodeUnavailable as exc:  # e.g. xpu memory: no IPC export here
                    modes += skipped_modes(device, str(exc), (engine,), (layout.kind,))
                    continue
                ops = ENGINE_OPS[engine]
                if "prefill_queues" not in options:  # no prefill process to tell to push
                    ops = tuple(op for op in ops if op != "prefill_push")
                for n, op in enumerate(ops):
                    modes.append(_run_mode(peer, cache, layout, device, op, engine, seed + n,
                                           options, len(caches)))
            caches.append(cache)
        return binding.module_name
    finally:
        for client in client_objs:
            client.close()
        for cache in caches:
            cache.close()


def _run_mode(peer, cache, layout, device, op, engine, seed, options, index=0) -> dict:
    """One op through ``peer``; every moved block's digest compared with the prefill's.
    ``prefill_push``: the prefill process (its server ``index``) starts the push, told through
    its command queue (``options["prefill_queues"]``: roles._serve_command)."""
    src, dst = request_blocks(layout.num_blocks, seed)
    cache.fill_value(0)
    entry = {"mode": mode_name(device, layout.kind, op, engine), "layout": layout.kind,
             "op": op, "engine": peer.engine, "engine_reason": peer.engine_reason,
             "memory": cache.mem_type, "handshake_ms": round(peer.handshake_seconds * 1e3, 2)}
    if device != "cpu":
        entry["device_ids"] = options.get("device_ids")
    try:
        timeout = options.get("timeout", 30.0)
        if op == "prefill_push":
            control, replies = options["prefill_queues"]
            res = prefill_push(peer, control, replies, index, f"selftest-{index}-{src[0]}", src,
                               dst, timeout)
        else:
            res = (peer.pull if op == "pull" else peer.push)(src, dst, timeout=timeout)
        expected = peer.digests(src)
        got = cache.block_digests(dst)
        bad = [s for s, e, g in zip(src, expected, got) if e != g]
        entry.update({
            "status": "passed" if not bad else "failed",
            "bytes": res.nbytes, "blocks": len(src), "runs": res.runs,
            "descriptors": res.descriptors, "nixl_descriptors": res.nixl_descriptors,
            "seconds": round(res.seconds, 6), "gbps": round(res.gbps, 3),
            "digest_ok": not bad, "digests_checked": len(src),
            # UCX's lanes; a same-node engine's copies take none
            "transports": (peer.client.agent.transports()
                           if peer.mover.over_nixl else None),
        })
        if bad:
            entry["reason"] = f"{len(bad)} block(s) differ, e.g. source block {bad[0]}"
    except Exception as exc:
        entry.update({"status": "failed", "digest_ok": False,
                      "reason": f"{type(exc).__name__}: {exc}"})
    return entry


# Mixed tensor-parallel groups (placement.Group: prefill TP x decode TP [x decode instances]) the
# selftest proves: every rank a process of its own with a cache of its own (tp_group.py), on host
# memory always and on each device torch sees, its ranks laid on the device ids.
TP_GROUPS = (Group(1, 2), Group(2, 1), Group(2, 4), Group(4, 2))
TP_SHAPE = dict(num_layers=2, num_blocks=64, tokens_per_block=16, head_dim=64, dtype="float16")
TP_HEADS = 4  # the model's KV heads


def tp_layout(kind: str, tp: int) -> KVLayout:
    return KVLayout(kind=kind, num_kv_heads=TP_HEADS // tp, tp_size=tp, **TP_SHAPE)


def tp_jobs(groups, options: dict, device_ids, seed: int, timeout: float) -> list[tuple]:
    """The mixed-TP jobs of one memory kind, (name, function, args) each: one per set of KV
    buffers its processes can serve together (tp_group.kv_buffer_sets)."""
    from .tp_group import kv_buffer_sets

    device = device_of(options)
    prefix = "" if device == "cpu" else f"{device} "
    return [(prefix + "tp" + ("" if "device" in kinds else " staged"), run_tp_modes,
             (list(groups), {**options, "staging_blocks": 32}, list(device_ids), seed, timeout,
              kinds)) for kinds in kv_buffer_sets(device)]


def run_tp_modes(groups, options: dict, device_ids, seed: int, timeout: float,
                 kv_buffers) -> dict:
    """Each group's ranks in processes of their own, every engine of ``kv_buffers``
    (tp_group.ENGINES), each op once, all decode ranks at once; every rank's heads checked
    against the prefill ranks they came from. The shape of ``_run_pair``'s result."""
    from .tp_group import ENGINES, STAGED_OPS, RankError, RankGroup

    modes: list = []
    device = device_of(options)
    engines = [e for e, spec in ENGINES.items()
               if spec["kv_buffer"] in kv_buffers and not spec.get("bench_only")]
    module = None
    for n, group in enumerate(groups):
        placement = place(group, device_ids)
        blocks = request_blocks(TP_SHAPE["num_blocks"], seed + n)
        layouts = (tp_layout(CROSS_LAYER, group.p), tp_layout(CROSS_LAYER, group.d))
        try:
            with RankGroup(group, placement, layouts, kv_buffers, options, seed + 100 * n,
                           blocks, start_timeout=timeout) as ranks:
                module = ranks.module
                for engine in engines:
                    connected = ranks.connect(engine, timeout)
                    staged = ENGINES[engine]["kv_buffer"] == "host_staged"
                    for op in (STAGED_OPS if staged else OPS):
                        # a group moves whole or not at all: ranks doubled up on one GPU
                        # may connect where their neighbours' engine is unavailable
                        refused = next((c["skipped"] for c in connected.values()
                                        if "skipped" in c), None)
                        moved = {} if refused or any("error" in c for c in connected.values()) \
                            else ranks.at_once(ranks.ranks, {"move": op, "check": True,
                                                             "request": f"selftest-{op}"})
                        modes += [_tp_entry(group, placement, r, op, engine, device,
                                            connected[r], moved.get(r), ranks.slices[r],
                                            refused)
                                  for r in ranks.ranks]
        except RankError as exc:
            return {"ok": False, "modes": modes, "module": module,
                    "error": f"tp {group.label}: {exc}"}
    return {"ok": True, "modes": modes, "module": module}


def tp_mode_name(device: str, group, rank, op: str, engine: str) -> str:
    k, j = rank
    who = f"rank {j}" + (f" of decode {k}" if group.instances > 1 else "")
    return (f"{'' if device == 'cpu' else device + '/'}tp {group.p}->{group.d}"
            f"{'' if group.instances == 1 else f' x{group.instances}'}/{who}/{op}/{engine}")


def _tp_entry(group, placement, rank, op, engine, device, connected, moved, slices,
              refused: str | None = None) -> dict:
    """One rank's mode. ``refused``: why another rank of the group could not take ``engine``
    (then the group is skipped whole, this rank too, though its own connect worked)."""
    k, j = rank
    entry = {"mode": tp_mode_name(device, group, rank, op, engine), "op": op,
             "tp": [group.p, group.d], "group": group.label, "instance": k, "rank": j,
             "memory": "DRAM" if device == "cpu" else "VRAM", "engine": engine,
             "prefill_ranks": [s.prefill_rank for s in slices]}
    if device != "cpu":
        entry.update(device_id=placement.decode[k][j],
                     prefill_device_ids=[placement.prefill[s.prefill_rank] for s in slices])
    if "skipped" in connected:
        return {**entry, "status": "skipped", "reason": connected["skipped"]}
    if refused and "error" not in connected:
        return {**entry, "status": "skipped", "reason": f"another rank of the group: {refused}"}
    failed = connected.get("error") or (moved or {}).get("error")
    if failed or moved is None:
        return {**entry, "status": "failed",
                "reason": failed or "another rank of the group failed to connect"}
    entry.update(engine=moved["engine"], bytes=moved["bytes"], descriptors=moved["descriptors"],
                 digest_ok=moved["bit_exact"], transports=moved.get("transports"),
                 status="passed" if moved["bit_exact"] else "failed")
    if moved.get("tcp_for_device_memory"):
        entry.update(status="failed", reason="UCX moved device memory over TCP: "
                     + "; ".join(moved["tcp_for_device_memory"]))
    elif not moved["bit_exact"]:
        entry["reason"] = moved["reason"]
    return entry


def _run_pair(layouts: list[dict], seed: int, options: dict, device_ids, timeout: float,
              decode=None) -> dict:
    """One prefill and one decode process over loopback; the decode's result (plus module).
    ``decode``: (target, args before the options) instead of the every-mode decode."""
    ctx = mp.get_context("spawn")
    pq, control, dq = ctx.Queue(), ctx.Queue(), ctx.Queue()
    prefill = ctx.Process(target=prefill_main, name="prefill", daemon=True,
                          args=(pq, control, layouts, seed,
                                {**options, "device_id": device_ids[0]}))
    procs = [prefill]
    try:
        prefill.start()
        ready = answer(pq, timeout, "prefill process", procs)
        if not ready.get("ok"):
            return ready
        target, args = decode or (decode_main, (layouts, seed))
        # the every-mode decode also has the prefill start pushes (its command queue)
        queues = {} if decode else {"prefill_queues": (control, pq)}
        decode = ctx.Process(target=target, name="decode", daemon=True,
                             args=(dq, ready["ports"], *args,
                                   {**options, "device_id": device_ids[1], **queues}))
        procs.append(decode)
        decode.start()
        return {**answer(dq, timeout, "decode process", procs[1:]), "module": ready.get("module"),
                "module_file": ready.get("module_file")}
    finally:
        for p in procs:
            reap(p, control if p is prefill else None)


def _pairs_at_once(jobs: int) -> int:
    """Process pairs run side by side on a host with cores to spare (one pair per four CPUs): on
    16 cores the four pairs of a cuda host take the time of the slowest, not the sum; on 2 cores
    they run one after another as before."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, min(jobs, cpus // 4))


def ucx_policy(device_id: int = 0) -> dict[str, list[str]]:
    """What each memory kind's processes set in UCX, and why (transports.policy), under this
    process's environment, which the pairs inherit: for xpu, the transport choice and its reason;
    for each, the choice across hosts from this host's RDMA ports (device memory on
    ``device_id``). ucx_info runs once at most."""
    from ..nixl.transports import policy, rdma_facts

    out, offered = {}, None
    for kind in ("cpu", *DEVICES):
        host, offered = rdma_facts(kind, os.environ, None if kind == "cpu" else device_id,
                                   offered)
        out["host" if kind == "cpu" else kind] = policy(kind, os.environ, offered, host)
    return out


def run_selftest(nixl_module: str | None = None, timeout: float = 120.0,
                 secret: bytes | None = None, seed: int = 1234,
                 device_ids=(0, 0), tp_pairs=TP_GROUPS, at_once: int | None = None) -> dict:
    """Run every mode this host offers, each memory kind in two fresh processes (host DRAM;
    cuda/xpu VRAM on the first two ``device_ids`` = (prefill's, decode's) where torch sees the
    device), and the mixed-TP groups ``tp_pairs`` (placement.Group) with every rank a process
    of its own (host memory; device memory laid on all of ``device_ids``); return the
    JSON-able report. Device modes that cannot run are skipped with the reason.
    ``at_once``: process pairs (or TP jobs) side by side (default: one per four CPUs)."""
    start = time.perf_counter()
    layouts = [KVLayout(kind=k, **SELFTEST_SHAPE).to_dict() for k in (CROSS_LAYER, PER_LAYER)]
    # every mode explicitly (KVRUNTIME_KV_BUFFER, a deployment's default, must not mix them)
    options = {"nixl_module": nixl_module, "secret": secret or os.urandom(16),
               "timeout": 30.0, "kv_buffer": "device"}
    # host-staged: the KV caches stay unregistered; NIXL moves staging pool blocks (the TPU
    # case on a CPU host). A pool smaller than a request's worth of blocks x 2 keeps it busy.
    staged = {"kv_buffer": "host_staged", "staging_blocks": 96}
    pair = tuple(device_ids[:2])
    jobs: list[tuple[str, object, tuple]] = [
        ("host", _run_pair, (layouts, seed, options, (0, 0), timeout)),
        ("host staged", _run_pair, (layouts, seed, {**options, **staged}, (0, 0), timeout))]
    if tp_pairs:  # mixed TP on host memory, direct and staged
        jobs += tp_jobs(tp_pairs, options, [0], seed, timeout)
    names = [name for name, _f, _a in jobs]
    skipped: dict[str, list[dict]] = {}
    report: dict = {"tool": "kvruntime selftest", "modes": []}
    try:
        # block-id lists read natively or by array('q'): built here, once, before the pairs load it
        report["id_reader"] = native.status()
        most = _pairs_at_once(1 << 16)  # one pair per four CPUs, however many jobs come
        with ThreadPoolExecutor(max_workers=at_once or most) as pool:
            # the host pairs start first: which devices torch sees (importing it, ~2 s of CPU)
            # and the UCX policy are found while they run
            futures = [pool.submit(f, *a) for _n, f, a in jobs]
            for device in DEVICES:
                reason = device_unavailable(device)
                if reason is not None:
                    skipped[device] = skipped_modes(device, reason) + [
                        {"mode": f"{device}/tp {g.label}", "tp": [g.p, g.d], "memory": "VRAM",
                         "status": "skipped", "reason": reason} for g in tp_pairs]
                    continue
                on = {"device": device, "device_ids": list(pair)}
                more = [(device, _run_pair, (layouts, seed, {**options, **on}, pair, timeout)),
                        (f"{device} staged", _run_pair,
                         (layouts, seed, {**options, **on, **staged}, pair, timeout))]
                if tp_pairs:  # its ranks laid on every device id given
                    more += tp_jobs(tp_pairs, {**options, "device": device,
                                               "device_ids": list(device_ids)}, device_ids, seed,
                                    timeout)
                jobs += more
                futures += [pool.submit(f, *a) for _n, f, a in more]
            report["ucx_policy"] = ucx_policy(device_ids[0])
            report["pairs_at_once"] = at_once or min(most, len(jobs))
            done = dict(zip([n for n, _f, _a in jobs], [f.result() for f in futures]))
        host = done["host"]
        if not host.get("modes") and not host.get("ok"):  # the stack itself is unusable
            report.update(ok=False, error=host.get("error"), trace=host.get("trace"))
            return report
        report["nixl_module"] = host.get("module")
        report["nixl_module_file"] = host.get("module_file")  # which build of NIXL moved the bytes
        modes, errors = [], []

        def take(name: str) -> None:  # a job's modes, and its error where it failed
            modes.extend(done[name].get("modes", []))
            if not done[name].get("ok"):
                errors.append(done[name])

        for name in names:
            take(name)
        for device in DEVICES:
            if device in skipped:
                modes += skipped[device]
                continue
            ran, got = done[device], list(done[device].get("modes", []))
            got += done[f"{device} staged"].get("modes", [])
            if not done[f"{device} staged"].get("ok"):
                errors.append(done[f"{device} staged"])
            if not ran.get("ok"):
                errors.append(ran)
                have = {m["mode"] for m in got}
                got += [{**m, "status": "failed", "reason": ran.get("error")}
                        for m in skipped_modes(device, "") if m["mode"] not in have]
            modes += got
            for name in [n for n, _f, _a in jobs if n.startswith(f"{device} tp")]:
                take(name)
        report["modes"] = modes
        ran = [m for m in modes if m["status"] != "skipped"]
        report["ok"] = not errors and bool(ran) and all(m["status"] == "passed" for m in ran)
        if errors:
            report["error"] = "; ".join(str(e.get("error")) for e in errors)
            report["trace"] = "\n".join(str(e.get("trace")) for e in errors if e.get("trace"))
        return report
    finally:
        report["seconds"] = round(time.perf_counter() - start, 3)
