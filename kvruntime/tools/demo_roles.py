"""The demo's processes: a prefill rank that runs the prompt and serves its KV as pages, a
decode that pulls (or is pushed) them into blocks of its own and continues the generation, and
the reference, which generates alone.

Started from the demo's fork server (demo._context: torch and transformers imported there, no
NIXL or UCX state inherited); they report through queues and never print. A decode of TP d is
d ``DecodeClient``s (a NIXL agent and a cache each) in one process: the model then runs whole
on their heads side by side, so what the demo proves for mixed TP is that each rank's pages
carry exactly its heads, not a tensor-parallel forward pass.
"""

from __future__ import annotations

import contextlib
import time
import traceback

from .roles import _log_from_env, _serve_command, prefill_pushes, prepare_process

# The allocators' orders: the prefill's and the decode's blocks for one request differ.
PREFILL_ALLOCATOR, DECODE_ALLOCATOR = 1, 2
# client keyword arguments of each engine the demo runs (engines/choice.py, coalesce.py, staging.py)
ENGINE_OPTIONS = {
    "nixl": dict(engine="nixl", coalesce="never"),
    "samenode": dict(engine="samenode", coalesce="never"),
    "host_staged": dict(kv_buffer="host_staged"),
    "coalesced": dict(engine="nixl", coalesce="always"),
}


def server_key(kind: str, engine: str) -> str:
    """Which of a prefill rank's servers a case reads: each layout kind, direct or staged."""
    return f"{kind}/{'host_staged' if engine == 'host_staged' else 'device'}"


def _torch_device(spec: dict, device_id: int) -> str:
    return "cpu" if spec["device"] == "cpu" else f"{spec['device']}:{device_id}"


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def prefill_main(report, control, replies, spec: dict) -> None:
    """Prefill rank ``spec["rank"]`` of ``spec["tp"]``: the model from ``spec["seed"]`` runs
    ``spec["prompt"]``; its KV heads of this rank go into one cache per layout kind at the
    blocks its allocator gives; one PrefillServer a (kind, direct or staged) serves them until
    ``control`` says stop (pushes on command: roles._serve_command)."""
    servers = []
    try:
        _log_from_env()
        prepare_process({"device": spec["device"]})
        import torch

        from ..memory import KVCache
        from ..nixl.binding import load_nixl
        from ..prefill.server import PrefillServer
        from . import model_kv

        torch.set_num_threads(1)  # the arithmetic of every process alike, and 2 cores shared
        device = _torch_device(spec, spec["device_id"])
        binding = load_nixl(spec.get("nixl_module"))
        seconds = {}
        start = time.perf_counter()
        model = model_kv.build(spec["seed"], device)
        seconds["build"] = time.perf_counter() - start
        start = time.perf_counter()
        past, first, _logits = model_kv.run_prompt(model, spec["prompt"])
        _synchronize(device)
        seconds["prefill"] = time.perf_counter() - start
        tpb = model_kv.kv_layout("cross_layer", 1).tokens_per_block
        blocks = model_kv.BlockAllocator(spec["num_blocks"], PREFILL_ALLOCATOR).take(
            -(-len(spec["prompt"]) // tpb))
        start = time.perf_counter()
        caches = {}
        for kind in spec["kinds"]:
            layout = model_kv.kv_layout(kind, spec["num_blocks"], spec["tp"])
            tensors = model_kv.page_tensors(layout, device)
            heads = layout.num_kv_heads
            model_kv.write_kv(tensors, layout, past, blocks,
                              (spec["rank"] * heads, (spec["rank"] + 1) * heads))
            caches[kind] = KVCache.from_tensors(layout, tensors)
        _synchronize(device)
        seconds["write_pages"] = time.perf_counter() - start
        keys = []
        for kind in spec["kinds"]:
            for buffer in spec["buffers"]:
                servers.append(PrefillServer(
                    caches[kind], binding=binding, secret=spec.get("secret"),
                    device_kind=spec["device"], kv_buffer=buffer, tp_rank=spec["rank"],
                    app=model.kv_descriptor, timeout=spec["timeout"]))
                keys.append(f"{kind}/{buffer}")
        report.put({"ok": True, "rank": spec["rank"], "tp": spec["tp"], "blocks": blocks,
                    "first": first, "seconds": seconds,
                    "servers": {k: (i, s.address[1]) for i, (k, s) in
                                enumerate(zip(keys, servers))}})
        while _serve_command(control.get(), servers, [report, *replies]):
            pass
    except BaseException as exc:  # report, don't print
        report.put({"ok": False, "error": f"{type(exc).__name__}: {exc}",
                    "trace": traceback.format_exc()})
    finally:
        for server in servers:
            server.close()


def reference_main(report, spec: dict) -> None:
    """The prompt prefilled and ``spec["steps"]`` tokens generated in this one process, on the
    decode's device: tokens, each step's logits (on the CPU), the model's descriptor, times."""
    try:
        _log_from_env()
        import torch

        from . import model_kv

        torch.set_num_threads(1)  # as the other processes: the same kernels, the same sums
        model = model_kv.build(spec["seed"], _torch_device(spec, spec["device_id"]))
        start = time.perf_counter()
        past, first, _ = model_kv.run_prompt(model, spec["prompt"])
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        tokens, logits = model_kv.generate(model, past, first, spec["steps"])
        report.put({"ok": True, "tokens": [first, *tokens], "logits": logits.numpy(),
                    "app": model.kv_descriptor,
                    "seconds": {"prefill": prefill, "decode": time.perf_counter() - start}})
    except BaseException as exc:
        report.put({"ok": False, "error": f"{type(exc).__name__}: {exc}",
                    "trace": traceback.format_exc()})


def decode_main(report, spec: dict, ready) -> None:
    """Run every case of ``spec["cases"]`` against the prefill ranks ``spec["prefills"]``
    (per TP size, each rank's command queue and the queue it answers this process on), once
    ``ready`` brings their ready reports (per TP size, in rank order; anything else: stop);
    one report a case, then ``{"done": True}``."""
    try:
        _log_from_env()
        prepare_process({"device": spec["device"]})
        import torch

        from ..nixl.binding import load_nixl
        from . import model_kv

        torch.set_num_threads(1)
        device = _torch_device(spec, spec["device_id"])
        binding = load_nixl(spec.get("nixl_module"))
        start = time.perf_counter()
        model = model_kv.build(spec["seed"], device)
        report.put({"built": time.perf_counter() - start, "app": model.kv_descriptor})
        got = ready.get(timeout=spec["ready_timeout"])
        if not isinstance(got, dict):
            return
        for p, reports in got.items():
            for rank, ready_report in zip(spec["prefills"][p], reports):
                rank["ready"] = ready_report
        for case in spec["cases"]:
            try:
                report.put({"case": case, **_run_case(case, spec, model, binding, device)})
            except Exception as exc:  # the case fails; the next one runs
                report.put({"case": case, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
        report.put({"done": True})
    except BaseException as exc:
        report.put({"ok": False, "error": f"{type(exc).__name__}: {exc}",
                    "trace": traceback.format_exc()})


def _run_case(case: dict, spec: dict, model, binding, device: str) -> dict:
    """One case: connect d decode ranks to the prefill ranks that hold their heads, move the
    prompt's blocks, rebuild the model's cache from the pages, generate."""
    from ..decode.client import DecodeClient
    from ..engines.samenode import SameNodeUnavailable
    from ..memory import KVCache
    from ..tp import head_slices
    from . import model_kv

    p, d, kind, engine = case["prefill_tp"], case["decode_tp"], case["layout"], case["engine"]
    ranks = spec["prefills"][str(p)]
    src, tokens = ranks[0]["ready"]["blocks"], len(spec["prompt"])
    dst = model_kv.BlockAllocator(spec["num_blocks"], DECODE_ALLOCATOR).take(len(src))
    tpb = spec["tokens_per_block"]
    # the decode's view of the prefill's pages (its TP size; the block size it expects)
    theirs = model_kv.kv_layout(kind, spec["num_blocks"], p, tpb)
    key = server_key(kind, engine)
    name = f"{kind}-{engine}-{case['op']}-{p}x{d}"
    out = {"src": src, "dst": dst, "seconds": {}}
    with contextlib.ExitStack() as stack:
        mine, peers = [], []
        start = time.perf_counter()
        for j in range(d):
            layout = model_kv.kv_layout(kind, spec["num_blocks"], d, tpb)
            tensors = model_kv.page_tensors(layout, device)
            client = stack.enter_context(DecodeClient(
                KVCache.from_tensors(layout, tensors), binding=binding,
                secret=spec.get("secret"), device_kind=spec["device"], tp_rank=j,
                app=model.kv_descriptor, timeout=spec["timeout"], **ENGINE_OPTIONS[engine]))
            mine.append((tensors, layout, dst))
            for s in head_slices(theirs, layout, j):
                rank = ranks[s.prefill_rank]
                index, port = rank["ready"]["servers"][key]
                try:
                    peer = client.connect("127.0.0.1", port)
                except SameNodeUnavailable as exc:
                    if p == d:
                        raise
                    return {"skipped": str(exc)}
                peers.append((j, peer, rank, index))
        out["seconds"]["connect"] = time.perf_counter() - start
        out["engines"] = sorted({peer.engine + (" coalesced" if peer.mover.coalesces else "")
                                 for _j, peer, _r, _i in peers})
        start = time.perf_counter()
        if case["op"] == "pull":
            handles = [peer.start_pull(src, dst, request_id=f"{name}-{j}-{i}",
                                       timeout=spec["timeout"])
                       for i, (j, peer, _r, _i) in enumerate(peers)]
            for handle in handles:
                handle.wait()
        else:  # the prefill ranks start the push once the decode rank named its blocks
            for j in range(d):
                prefill_pushes([(peer, rank["control"], rank["answers"], index, 1)
                                for jj, peer, rank, index in peers if jj == j],
                               f"{name}-{j}", src, dst, spec["timeout"])
        _synchronize(device)
        out["seconds"]["transfer"] = time.perf_counter() - start
        start = time.perf_counter()
        cache = model_kv.read_kv(mine, tokens)
        generated, logits = model_kv.generate(model, cache, ranks[0]["ready"]["first"],
                                              spec["steps"])
        out["seconds"]["decode"] = time.perf_counter() - start
    out.update(ok=True, tokens=[ranks[0]["ready"]["first"], *generated], logits=logits.numpy())
    return out
