"""``python -m kvruntime selftest``: prove KV blocks cross between two processes, bit-exact.

A prefill process serves one cache per layout (random content); a decode process handshakes
over loopback, runs every mode this host offers (layouts x pull/push), and compares a digest of
every moved block with the prefill side's. Modes the host cannot run are reported as skipped
with the reason, never as passed.
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
import time
import traceback

from .layout import CROSS_LAYER, PER_LAYER, KVLayout
from .roles import prefill_main, reap

OPS = ("pull", "push")
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


def _device_modes() -> list[dict]:
    out = []
    try:
        import torch  # noqa: F401
    except ImportError:
        reason = "torch is not installed (device tensors need it)"
        return [{"mode": f"{dev}/{kind}/{op}", "layout": kind, "op": op, "memory": "VRAM",
                 "status": "skipped", "reason": reason}
                for dev in ("cuda", "xpu") for kind in (CROSS_LAYER, PER_LAYER) for op in OPS]
    import torch

    for dev, present in (("cuda", torch.cuda.is_available()),
                         ("xpu", hasattr(torch, "xpu") and torch.xpu.is_available())):
        reason = (f"{dev} device present, but device-memory selftest is not implemented yet"
                  if present else f"no {dev} device on this host")
        for kind in (CROSS_LAYER, PER_LAYER):
            for op in OPS:
                out.append({"mode": f"{dev}/{kind}/{op}", "layout": kind, "op": op,
                            "memory": "VRAM", "status": "skipped", "reason": reason})
    return out


def decode_main(result_queue, ports: list[int], layouts: list[dict], seed: int,
                options: dict) -> None:
    modes = []
    client_objs = []
    try:
        from .binding import load_nixl
        from .decode import DecodeClient
        from .memory import KVCache

        binding = load_nixl(options.get("nixl_module"))
        for port, spec in zip(ports, layouts):
            layout = KVLayout.from_dict(spec)
            cache = KVCache.allocate_host(layout, options.get("huge", True))
            client = DecodeClient(cache, binding=binding, secret=options.get("secret"))
            client_objs.append((client, cache))
            peer = client.connect("127.0.0.1", port)
            for n, op in enumerate(OPS):
                src, dst = request_blocks(layout.num_blocks, seed + n)
                cache.fill_value(0)
                entry = {"mode": f"host/{layout.kind}/{op}", "layout": layout.kind, "op": op,
                         "memory": "DRAM", "handshake_ms": round(peer.handshake_seconds * 1e3, 2)}
                try:
                    move = peer.pull if op == "pull" else peer.push
                    res = move(src, dst, timeout=options.get("timeout", 30.0))
                    expected = peer.digests(src)
                    got = [cache.block_digest(b) for b in dst]
                    bad = [s for s, e, g in zip(src, expected, got) if e != g]
                    entry.update({
                        "status": "passed" if not bad else "failed",
                        "bytes": res.nbytes, "blocks": len(src), "runs": res.runs,
                        "descriptors": res.descriptors, "nixl_descriptors": res.nixl_descriptors,
                        "seconds": round(res.seconds, 6), "gbps": round(res.gbps, 3),
                        "digest_ok": not bad, "digests_checked": len(src),
                    })
                    if bad:
                        entry["reason"] = f"{len(bad)} block(s) differ, e.g. source block {bad[0]}"
                except Exception as exc:
                    entry.update({"status": "failed", "digest_ok": False,
                                  "reason": f"{type(exc).__name__}: {exc}"})
                modes.append(entry)
        result_queue.put({"ok": True, "modes": modes, "module": binding.module_name})
    except BaseException as exc:
        result_queue.put({"ok": False, "modes": modes, "error": f"{type(exc).__name__}: {exc}",
                          "trace": traceback.format_exc()})
    finally:
        for client, cache in client_objs:
            client.close()
            cache.close()


def _get(q, timeout: float, what: str, procs) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return q.get(timeout=0.2)
        except queue_mod.Empty:
            dead = [p for p in procs if not p.is_alive()]
            if dead or time.monotonic() > deadline:
                why = (f"{dead[0].name} exited with code {dead[0].exitcode}" if dead
                       else f"no answer within {timeout:.0f}s")
                return {"ok": False, "error": f"{what}: {why}"}


def run_selftest(nixl_module: str | None = None, timeout: float = 120.0,
                 secret: bytes | None = None, seed: int = 1234) -> dict:
    """Run every host mode in two fresh processes; return the JSON-able report."""
    start = time.perf_counter()
    layouts = [KVLayout(kind=k, **SELFTEST_SHAPE).to_dict() for k in (CROSS_LAYER, PER_LAYER)]
    options = {"nixl_module": nixl_module, "secret": secret or __import__("os").urandom(16),
               "timeout": 30.0}
    report: dict = {"tool": "kvruntime selftest", "modes": []}
    ctx = mp.get_context("spawn")
    pq, control, dq = ctx.Queue(), ctx.Queue(), ctx.Queue()
    prefill = ctx.Process(target=prefill_main, args=(pq, control, layouts, seed, options),
                          name="prefill", daemon=True)
    procs = [prefill]
    try:
        prefill.start()
        ready = _get(pq, timeout, "prefill process", procs)
        if not ready.get("ok"):
            report.update(ok=False, error=ready.get("error"), trace=ready.get("trace"))
            return report
        decode = ctx.Process(target=decode_main, args=(dq, ready["ports"], layouts, seed, options),
                             name="decode", daemon=True)
        procs.append(decode)
        decode.start()
        result = _get(dq, timeout, "decode process", procs[1:])
        report["nixl_module"] = ready.get("module")
        modes = result.get("modes", []) + _device_modes()
        report["modes"] = modes
        ran = [m for m in modes if m["status"] != "skipped"]
        report["ok"] = bool(result.get("ok")) and bool(ran) and all(
            m["status"] == "passed" for m in ran)
        if not result.get("ok"):
            report["error"] = result.get("error")
            report["trace"] = result.get("trace")
        return report
    finally:
        for p in procs:
            reap(p, control if p is prefill else None)
        report["seconds"] = round(time.perf_counter() - start, 3)

