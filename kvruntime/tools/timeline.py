"""``python -m kvruntime.tools.timeline``: one handshake, one pull and one push, phase by phase.

The prefill runs in a spawned process, the decode here, as in ``bench``; both record when each
traced step of theirs began and ended (``perf_counter``: CLOCK_MONOTONIC, one clock for every
process of a host), so the two sides' steps line up on one time axis. What is traced is data
(``DECODE_STEPS``, ``PREFILL_STEPS``): kvruntime's own functions, and every NIXL call (each
goes through ``Agent.call``, named). The JSON says, per handshake and per request: each step
(side, thread, start and length in µs from the caller's call), the NIXL calls and frames each
side made, and the phases between them (what the decode waited for and who was working).

It measures; it asserts nothing. Compare a push's phases with the pull's of the same run, and
the first request's with a later one's. On a GPU host (issue 46), both engines' handshakes and
both directions, one GPU and two::

    python -m kvruntime.tools.timeline --device cuda --mib 64 --iters 7 --handshakes 3
    python -m kvruntime.tools.timeline --device cuda --mib 64 --device-ids 0 1
    python -m kvruntime.tools.timeline --device cuda --engine samenode --ops pull
    python -m kvruntime.tools.timeline --device cuda --coalesce never   # connect sans probe

Measured on the 2-core CPU host (host memory, cma, 64 MiB, coalesce never; the WRITE is done
inside its post there): a pull is plan 0.33 ms, READ 6.4 (two descriptors over the decode's
two UCX threads), 0.18 after; the push it is beside (protocol 12, its answer a frame) was plan
0.17, the request frame's crossing 0.28, the prefill's parse and plan 0.20, the WRITE 6.8 (one
descriptor: the prefill's agent has no UCX threads), the answer 0.22 out and 0.12 across, 0.08
after. Per request both make one prepared transfer (make_prepped_xfer + transfer: lists
prepared once a peer, no registration or metadata load); since protocol 13 the push adds one
frame and its wake-up, and its WRITE's NIXL notification is its answer.
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from collections import Counter

from ..layout import KVLayout
from .roles import allocate_cache, prepare_process, reap
from .workload import bench_layout, pick_blocks

# (module, class or None, attribute, label; None: the first argument names it, Agent.call's)
COMMON_STEPS = (
    ("kvruntime.nixl.agent", "Agent", "call", None),
    ("kvruntime.wire.channel", "Channel", "send", "frame out"),
)
DECODE_STEPS = COMMON_STEPS + (
    ("kvruntime.decode.client", None, "connect", "socket connect"),
    ("kvruntime.decode.client", None, "client_handshake", "handshake frames"),
    ("kvruntime.nixl.registration", "Registration", "prepare_peer", "prepare peer list"),
    ("kvruntime.engines.choice", None, "choose", "engine choice (+lane probe, +route)"),
    ("kvruntime.engines.coalesce", None, "open_route", "coalesce route (+probe)"),
    # inside the route: its pool READ warmed, then the probe's READs and gathers
    ("kvruntime.engines.coalesce", None, "warm", "coalesce: pool READ warmed"),
    ("kvruntime.engines.coalesce", None, "probe", "coalesce: probe"),
    ("kvruntime.engines.coalesce", None, "_read", "coalesce: a connect-time READ"),
    ("kvruntime.pools.staging", "StagingPool", "gather", "pool gather"),
    ("kvruntime.engines.engine", "SameNodeEngine", "rehearse", "rehearse"),
    # inside a same-node choice: the proof, then the prefill's memory opened
    ("kvruntime.engines.samenode", None, "prove_same_node", "same-node proof: token"),
    ("kvruntime.engines.samenode", None, "prove_peer", "same-node proof: socket's pid"),
    ("kvruntime.engines.samenode", None, "open_cuda_ipc", "CUDA IPC open (a region)"),
    ("kvruntime.engines.samenode", "CudaEngine", "__init__", "CUDA engine opened"),
    ("kvruntime.engines.gather", "BlockGather", "warm", "gather kernel warm"),
    ("kvruntime.decode.client", "PrefillPeer", "start_pull", "start_pull"),
    ("kvruntime.decode.client", "PrefillPeer", "start_push", "start_push"),
    ("kvruntime.decode.client", "PrefillPeer", "_admit", "plan"),
    ("kvruntime.wire.channel", "PeerChannel", "send", "frame out"),
    ("kvruntime.wire.channel", "PeerChannel", "dispatch", "frame in"),
    ("kvruntime.decode.pushes", None, "on_notif", "notification in"),
    ("kvruntime.decode.inflight", "TransferHandle", "wait", "wait"),
)
PREFILL_STEPS = COMMON_STEPS + (
    ("kvruntime.wire.channel", "Channel", "read", "frame read (incl. idle)"),
    ("kvruntime.prefill.server", None, "serve_handshake", "handshake frames"),
    ("kvruntime.prefill.server", "PrefillServer", "_add_peer", "admit decode"),
    ("kvruntime.nixl.registration", "Registration", "prepare_peer", "prepare peer list"),
    ("kvruntime.prefill.server", "PrefillServer", "_handle", "handle frame"),
    ("kvruntime.prefill.pushes", "Pushes", "start_write", "start_write"),
    ("kvruntime.prefill.pushes", "Writes", "post", "post WRITE"),
    ("kvruntime.prefill.pushes", "Writes", "_end_write", "WRITE ended"),
    ("kvruntime.prefill.pushes", "Writes", "_check_lanes", "lane check"),
)
# NIXL calls of the progress loops' idle polling: counted, not listed one by one
IDLE_CALLS = ("get_new_notifs",)


class Trace:
    """Steps recorded by wrapping the named functions; ``close`` puts the originals back."""

    def __init__(self, side: str, steps):
        self.side = side
        self.events: list = []
        self._lock = threading.Lock()
        self._undo = []
        for module, cls, attr, label in steps:
            owner = importlib.import_module(module)
            owner = getattr(owner, cls) if cls else owner
            original = owner.__dict__[attr] if cls else getattr(owner, attr)
            self._undo.append((owner, attr, original))
            setattr(owner, attr, self._wrap(original, label, cls is not None))

    def _wrap(self, fn, label, method: bool):
        events, lock, side = self.events, self._lock, self.side

        def traced(*args, **kwargs):
            name = label if label is not None else f"nixl {args[1 if method else 0]}"
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
                with lock:
                    events.append((side, threading.current_thread().name, name, t0, t1))
        return traced

    def take(self) -> list:
        with self._lock:
            out, self.events[:] = list(self.events), []
        return out

    def close(self) -> None:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)


def _prefill(ready_q, control, layout: dict, options: dict) -> None:
    """The prefill process: a traced server; answers "events" with its steps so far."""
    try:
        prepare_process(options)
        trace = Trace("prefill", PREFILL_STEPS)
        from ..prefill.server import PrefillServer

        cache = allocate_cache(KVLayout.from_dict(layout), options)
        cache.fill_random(7)
        server = PrefillServer(cache, device_kind=options["device"],
                               coalesce=options["coalesce"], kv_buffer="device")
        ready_q.put({"ok": True, "port": server.address[1]})
        while control.get() == "events":
            ready_q.put({"events": trace.take()})
        server.close()
        cache.close()
    except BaseException as exc:  # reported, never printed
        ready_q.put({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


def _events(trace: Trace, control, ready_q) -> list:
    control.put("events")
    theirs = ready_q.get(timeout=60)["events"]
    return sorted(trace.take() + theirs, key=lambda e: e[3])


def timeline(events: list, t0: float, t1: float) -> dict:
    """The steps between ``t0`` and ``t1`` (relative µs), NIXL calls and frames by side, and
    the decode's phases: the longest stretches where it waited on nothing of its own."""
    steps, nixl, frames, idle = [], Counter(), Counter(), Counter()
    for side, thread, name, a, b in events:
        if b < t0 or a > t1:
            continue
        if name.startswith("nixl "):
            call = name[5:].split(" (")[0]
            (idle if call in IDLE_CALLS else nixl)[f"{side}: {call}"] += 1
            if call in IDLE_CALLS:
                continue
        if name in ("frame out", "frame in"):
            frames[f"{side}: {name}"] += 1
        steps.append({"side": side, "thread": thread, "step": name,
                      "start_us": round((a - t0) * 1e6, 1), "us": round((b - a) * 1e6, 1)})
    return {"total_us": round((t1 - t0) * 1e6, 1), "nixl_calls": dict(nixl),
            "frames": dict(frames), "idle_polls": dict(idle),
            "steps": _merge_polls(steps)}


# A request's phases: (name, from, to), each end a (side, step, "start" | "end", which): the
# first or last such step of the request. A push asked by the decode crosses the side channel
# once, and its WRITE's notification comes back (protocol 13); a pull crosses it not at all
# (its release goes later, batched). The prefill's own sight of the WRITE's end is beside the
# phases (it answers nothing then), not one of them.
PHASES = {
    "push": (
        ("decode: plan", None, ("decode", "frame out", "start", "first")),
        ("request frame to the prefill's handler", ("decode", "frame out", "start", "first"),
         ("prefill", "handle frame", "start", "first")),
        ("prefill: parse, plan, prepare", ("prefill", "handle frame", "start", "first"),
         ("prefill", "nixl transfer", "start", "first")),
        ("WRITE: posted to its notification in", ("prefill", "nixl transfer", "start", "first"),
         ("decode", "notification in", "start", "last")),
        ("decode: finish", ("decode", "notification in", "start", "last"), None),
        ("(beside) WRITE: posted to seen done by the prefill",
         ("prefill", "nixl transfer", "start", "first"), ("prefill", "WRITE ended", "start",
                                                          "first"))),
    "pull": (
        ("decode: plan, prepare", None, ("decode", "nixl transfer", "start", "first")),
        ("READ: posted to seen done", ("decode", "nixl transfer", "start", "first"),
         ("decode", "nixl check_xfer_state", "end", "last")),
        ("decode: finish", ("decode", "nixl check_xfer_state", "end", "last"), None)),
}


def phases(op: str, report: dict) -> dict:
    """``op``'s phases (µs) from a ``timeline`` report; a phase whose ends are missing (a
    WRITE done inside its post is polled by no one) is left out."""
    steps = report["steps"]

    def at(end):
        if end is None:
            return None
        side, name, edge, which = end
        found = [s for s in steps if s["side"] == side and s["step"] == name]
        if not found:
            return None
        s = found[0] if which == "first" else found[-1]
        return s["start_us"] + (s["us"] if edge == "end" else 0.0)

    out = {}
    for name, a, b in PHASES[op]:
        t0 = 0.0 if a is None else at(a)
        t1 = report["total_us"] if b is None else at(b)
        if t0 is not None and t1 is not None:
            out[name] = round(t1 - t0, 1)
    return out


def _merge_polls(steps: list) -> list:
    """Runs of one poll call on one thread (check_xfer_state...) as one line with a count."""
    out = []
    for s in steps:
        last = out[-1] if out else None
        if (last is not None and last["step"] == s["step"] == "nixl check_xfer_state"
                and last["thread"] == s["thread"]):
            last["count"] = last.get("count", 1) + 1
            last["us"] = round(s["start_us"] + s["us"] - last["start_us"], 1)
            continue
        out.append(dict(s))
    return out


def _request(op: str, peer, src, dst) -> tuple[float, float, object]:
    t0 = time.perf_counter()
    result = (peer.pull if op == "pull" else peer.push)(src, dst, timeout=60)
    return t0, time.perf_counter(), result


def run(args) -> dict:
    from ..decode.client import DecodeClient
    from ..nixl.binding import load_nixl

    options = {"device": args.device, "coalesce": args.coalesce}
    prepare_process(options)  # UCX's settings for this memory, before NIXL is loaded
    layout = bench_layout("cross_layer", 256, args.mib)
    ctx = mp.get_context("spawn")
    ready_q, control = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_prefill, name="prefill", daemon=True,
                       args=(ready_q, control, layout.to_dict(),
                             {**options, "device_id": args.device_ids[0]}))
    proc.start()
    trace = Trace("decode", DECODE_STEPS)
    report: dict = {"tool": "kvruntime timeline", "device": args.device, "mib": args.mib,
                    "device_ids": args.device_ids, "engine": args.engine,
                    "coalesce": args.coalesce, "handshakes": [], "requests": {}}
    client = cache = None
    try:
        ready = ready_q.get(timeout=300)
        if not ready.get("ok"):
            raise RuntimeError(ready.get("error"))
        cache = allocate_cache(layout, {**options, "device_id": args.device_ids[1]})
        client = DecodeClient(cache, binding=load_nixl(), device_kind=args.device,
                              engine=args.engine, coalesce=args.coalesce)
        _events(trace, control, ready_q)  # the client's own setup: not a handshake's
        for _ in range(args.handshakes):
            t0 = time.perf_counter()
            peer = client.connect("127.0.0.1", ready["port"])
            t1 = time.perf_counter()
            report["handshakes"].append(timeline(_events(trace, control, ready_q), t0, t1))
        report["engine_used"] = [peer.engine, peer.engine_reason, peer.coalesce_reason]
        import random

        count = (args.mib << 20) // layout.block_bytes
        src, dst = pick_blocks("contiguous", count, layout.num_blocks, random.Random(7))
        for op in args.ops:
            rows = []
            for _ in range(args.iters + 1):  # the first: a first request of its kind
                t0, t1, result = _request(op, peer, src, dst)
                time.sleep(0.01)  # the prefill's answer and release land before the next
                rows.append((timeline(_events(trace, control, ready_q), t0, t1), result))
            later = sorted(rows[1:], key=lambda r: r[0]["total_us"])
            median = later[len(later) // 2]
            report["requests"][op] = {
                "phases_first": phases(op, rows[0][0]), "phases_median": phases(op, median[0]),
                "first": rows[0][0], "median": median[0],
                "descriptors": median[1].descriptors, "runs": median[1].runs,
                "nixl_descriptors": median[1].nixl_descriptors,
                "all_us": [r[0]["total_us"] for r in rows],
                "median_later_us": round(statistics.median(r[0]["total_us"]
                                                           for r in rows[1:]), 1)}
        if "pull" in report["requests"] and "push" in report["requests"]:
            r = report["requests"]
            report["push_over_pull"] = round(r["push"]["median_later_us"]
                                             / r["pull"]["median_later_us"], 3)
        report["ok"] = True
    except Exception as exc:
        report.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    finally:
        trace.close()
        if client is not None:
            client.close()
        if cache is not None:
            cache.close()
        reap(proc, control)
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvruntime.tools.timeline",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda", "xpu"), default="cpu")
    ap.add_argument("--mib", type=int, default=64, help="MiB a request moves")
    ap.add_argument("--iters", type=int, default=5, help="requests after the first, per op")
    ap.add_argument("--handshakes", type=int, default=2)
    ap.add_argument("--ops", nargs="+", choices=("pull", "push"), default=["pull", "push"])
    ap.add_argument("--coalesce", choices=("auto", "always", "never"), default="auto",
                    help="the clients' coalesce mode (auto probes the pair at connect)")
    ap.add_argument("--engine", choices=("nixl", "samenode", "auto"), default="nixl")
    ap.add_argument("--device-ids", type=int, nargs=2, default=[0, 0], metavar="ID",
                    help="device memory: the prefill's and the decode's device ids")
    args = ap.parse_args(argv)
    if args.mib < 1 or args.iters < 1 or args.handshakes < 1:
        ap.error("--mib, --iters and --handshakes must each be at least 1")
    report = run(args)
    json.dump(report, sys.stdout, indent=1)
    print()
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
