"""CLI: ``python -m kvruntime selftest|bench|policy|which|demo [--json]``: the only place that
prints.

Its parser and exit codes follow the convention both programs share (tools/cli.py: README,
"Exit codes").
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import math
import os
import sys

from .options import Options
from .tools.cli import INTERRUPTED, MODE_FAILED, OK, UNUSABLE, Parser


@contextlib.contextmanager
def _report_stream():
    """Yield a stream on the real stdout while fd 1 points at stderr.

    NIXL's Python logger writes INFO lines to stdout, in this process and in the spawned
    prefill/decode processes (which inherit fd 1). The report must be the only thing on
    stdout (``--json`` is parsed by the installer), so everything else goes to stderr.
    """
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with os.fdopen(os.dup(saved), "w") as out:
            yield out
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _secret(args) -> bytes | None:
    return Options.from_env(**({"secret": args.secret.encode()} if args.secret else {})).secret


def _selftest(args, out) -> int:
    say = functools.partial(print, file=out)
    from .tools.selftest import run_selftest

    report = run_selftest(nixl_module=args.nixl_module, timeout=args.timeout,
                          secret=_secret(args), device_ids=tuple(args.device_ids),
                          tp_pairs=args.tp_pairs, at_once=args.pairs_at_once)
    if args.json:
        report.pop("trace", None) if report.get("ok") else None
        say(json.dumps(report, indent=None if args.compact else 2))
    else:
        w = max([28] + [len(m["mode"]) for m in report.get("modes", [])])  # the names line up
        for m in report.get("modes", []):
            if m["status"] == "skipped":
                say(f"SKIP {m['mode']:{w}} {m['reason']}")
            elif m["status"] == "passed" and "tp" in m:
                say(f"PASS {m['mode']:{w}} {m['bytes'] / 2**20:8.1f} MiB from prefill ranks "
                    f"{m['prefill_ranks']}, {m['descriptors']} descriptors, heads bit-exact"
                    f"{_transports(m)}")
            elif m["status"] == "passed":
                say(f"PASS {m['mode']:{w}} {m['bytes'] / 2**20:8.1f} MiB {m['gbps']:7.2f} GB/s "
                      f"{m['descriptors']:4} descriptors, {m['digests_checked']} digests ok"
                    f"{_transports(m)}")
            else:
                say(f"FAIL {m['mode']:{w}} {m.get('reason')}")
        if report.get("error"):
            print(f"error: {report['error']}", file=sys.stderr)
        if report.get("id_reader"):
            say(f"block-id lists: {report['id_reader']}")
        _say_policy(say, report)
        say(("OK" if report.get("ok") else "FAILED") + f" in {report.get('seconds')} s "
              f"(NIXL module: {report.get('nixl_module')})")
    if report.get("ok"):
        return OK
    return MODE_FAILED if report.get("modes") else UNUSABLE


# The lines of a report's ucx_policy the text output shows: the transport choice on one host
# (UCX_TLS), across hosts (the wire, the NIC, GPUDirect) and a refusal; the rest is in --json.
_CHOICE = ("UCX_TLS", "refused", "across hosts", "UCX_NET_DEVICES")


def _say_policy(say, report: dict) -> None:
    """The transport choice and why, per memory kind (selftest's kinds, bench's one)."""
    for kind, lines in (report.get("ucx_policy") or {}).items():
        for line in lines:
            if line.startswith(_CHOICE):
                say(f"UCX for {kind} memory: {line}")


def _policy(args, out) -> int:
    """The UCX settings each memory kind would get here, and why, on one host and across hosts,
    without moving anything: what selftest reports, in a second."""
    say = functools.partial(print, file=out)
    from .tools.selftest import ucx_policy

    try:  # the GPU's PCI address is read only where CUDA is up (nics.py); nothing forks here
        import torch

        if torch.cuda.is_available():
            torch.cuda.init()
    except Exception:  # no torch, no CUDA: the GPU's nearest NIC is said to be unknown
        pass
    said = ucx_policy(args.device_id)
    refused = [kind for kind, lines in said.items() if lines[:1] and
               lines[0].startswith("refused")]
    report = {"tool": "kvruntime policy", "ok": not refused, "ucx_policy": said}
    if args.json:
        say(json.dumps(report, indent=None if args.compact else 2))
    else:
        for kind, lines in said.items():
            for line in lines:
                say(f"UCX for {kind} memory: {line}")
    return UNUSABLE if refused else OK


def _transports(mode: dict) -> str:
    t = mode.get("transports")
    return f" [rma {','.join(t['rma']) or '-'}, am {','.join(t['am']) or '-'}]" if t else ""


def _at_least(low: int, what: str = ""):
    """An argparse type: a whole number of at least ``low`` (and ``what`` it must also be)."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = low - 1
        if n < low:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least "
                                             f"{low}{what}")
        return n
    return parse


_positive_int = _at_least(1)


def _even_kib(text: str) -> int:
    """A bench block's KiB: a block is 2 KiB per unit of head_dim (4 layers x K/V x 16 tokens
    x 8 heads x fp16), so an even number of at least 2."""
    n = _positive_int(text)
    if n % 2:
        raise argparse.ArgumentTypeError(f"{text!r} KiB is not a bench block size: blocks are "
                                         f"multiples of 2 KiB (4, 256, ...)")
    return n


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _tp_pairs(heads: int):
    """An argparse type for ``--tp-pairs``: '1x2,2x1x2' -> (Group(1, 2), Group(2, 1, 2));
    'none' -> () (placement.parse_group: each TP size must split the model's ``heads`` KV
    heads evenly)."""
    from .tools.placement import parse_group

    def parse(text: str):
        if text == "none":
            return ()
        try:
            return tuple(parse_group(item, heads) for item in text.split(","))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{exc} (a list like 1x2,2x1x2, or none)") from None
    return parse


def _placement(text: str) -> tuple[int, ...]:
    from .tools.placement import parse_ids

    try:
        return parse_ids(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _bench(args, out) -> int:
    say = functools.partial(print, file=out)
    from .tools.bench import BenchConfig, run_bench

    cfg = BenchConfig(
        sizes_mib=args.sizes, patterns=args.patterns, layouts=args.layouts, ops=args.ops,
        splits=args.split or [None], ucx_threads=args.ucx_threads,
        host_streams=args.host_streams, huge_pages=not args.no_huge,
        iters=args.iters, block_kib=args.block_kib, nixl_module=args.nixl_module,
        handshakes=args.handshakes, device=args.device, device_ids=args.device_ids,
        engines=args.engines, bare=not args.no_bare, inflight=args.inflight or [],
        kv_buffer=args.kv_buffer, tp_pairs=[g.label for g in args.tp_pairs],
        tp_engines=args.tp_engines, tp_ops=args.tp_ops,
        tp_placements=[list(p) for p in args.placement or []], tp_only=args.tp_only,
        coalesce=args.coalesce)
    report = run_bench(cfg)
    if args.json:
        say(json.dumps(report, indent=None if args.compact else 2))
    else:
        if report.get("results"):
            say(f"{'layout':12} {'engine':26} {'op':5} {'pattern':10} {'split':>5} "
                f"{'size MiB':>9} {'descs':>6} {'avg lat us':>11} {'GB/s':>7} {'ref':>7} "
                f"{'ratio':>6} {'overhead us':>11}")
        for r in report.get("results", []):
            ovh = r.get("overhead_us")
            engine = r["engine"] + (f" ({r['staged_copy']})" if r.get("staged_copy") else
                                    " (coalesced)" if r.get("coalesced") else "")
            say(f"{r['layout']:12} {engine:26} {r['op']:5} {r['pattern']:10} {r['split']:5} "
                  f"{r['size_bytes'] / 2**20:9.0f} {r['descriptors']:6} {r['avg_lat_us']:11.0f} "
                  f"{r['gbps']:7.2f} {r['ref_gbps']:7.2f} {r['ratio']:6.2f} "
                  f"{'' if ovh is None else f'{ovh:11.1f}'}")
        for r in report.get("inflight", []):
            say(f"in flight ({r['layout']}, {r['engine']}): {r['requests_in_flight']} requests "
                f"from {r['decode_peers']} decode peers {r['aggregate_gbps']:.2f} GB/s "
                f"({r['batched_gbps']:.2f} batched per peer) vs one request "
                f"{r['one_request_gbps']:.2f} GB/s: ratio {r['ratio']:.2f} "
                f"({r['ratio_batched']:.2f} batched); each peer a process of its own "
                f"{r['processes_gbps']:.2f} GB/s: ratio {r['ratio_processes']:.2f} "
                f"({r['processes_batched_gbps']:.2f} batched: ratio "
                f"{r['ratio_processes_batched']:.2f}; the processes' own copies of the same "
                f"bytes {r['processes_copy_gbps']:.2f} GB/s: batched "
                f"{r['ratio_processes_batched_to_copy']:.2f} of them)")
        for c in report.get("staging_copies", []):
            say(f"staging ({c['layout']}, {c['blocks']} random blocks): gather "
                f"{c['gather_gbps']:.1f} GB/s vs pinned D2H {c['d2h_pinned_gbps']:.1f} "
                f"({c['gather_ratio']:.2f}); scatter {c['scatter_gbps']:.1f} vs pinned H2D "
                f"{c['h2d_pinned_gbps']:.1f} ({c['scatter_ratio']:.2f})")
        for t in report.get("tp", []):
            for line in _tp_lines(t):
                say(line)
        for s in report.get("skipped", []):
            say(f"skipped {s['layout']}/{s['engine']}: {s['reason']}")
        for kind, hs in (report.get("handshake_ms") or {}).items():
            later = hs["median_later"]
            say(f"handshake ms ({kind}): first {hs['first']:.1f}"
                + (f", median later {later:.1f}" if later is not None else ""))
        if report.get("id_reader"):
            say(f"block-id lists: {report['id_reader']}")
        _say_policy(say, report)
        if report.get("device"):
            say(f"device: {report['device']}; reference: "
                f"{(report.get('results') or [{}])[0].get('ref')}")
        if report.get("error"):
            print(f"error: {report['error']}", file=sys.stderr)
    return OK if report.get("ok") else UNUSABLE


def _tp_lines(t: dict) -> list[str]:
    """A mixed-TP row as text: the group, engine and op; then its total and each rank."""
    head = f"tp {t['group']} {t.get('engine', t['kv_buffer'])} {t.get('op', '')}".rstrip()
    if "error" in t or "skipped" in t:
        return [f"{head}: {'skipped: ' + t['skipped'] if 'skipped' in t else t['error']}"]
    tot = t["total"]
    lines = [f"{head} ({t['engine_used']}): all {len(t['ranks'])} decode ranks at once "
             f"{tot['gbps']:.2f} GB/s, their copies at once {tot['ref_gbps']:.2f} "
             f"({tot['ratio']:.2f}); {'bit-exact' if t['bit_exact'] else 'NOT BIT-EXACT'}"
             + ("; DEVICE MEMORY OVER TCP" if t["tcp_for_device_memory"] else "")]
    for r in t["ranks"]:
        lanes = r["transports"]
        where = (f" on {r['device_id']}", f" on {r['prefill_device_ids']}") if "device_id" in r \
            else ("", "")
        lines.append(
            f"  decode {r['instance']} rank {r['rank']}{where[0]} from prefill ranks "
            f"{r['prefill_ranks']}{where[1]}: {r['bytes'] / 2**20:.0f} MiB "
            f"{r['gbps']:.2f} GB/s alone, copy {r['ref_gbps']:.2f} ({r['ratio']:.2f}), "
            f"{r['together_gbps']:.2f} at once, {r['descriptors']} descriptors"
            + (f" [rma {','.join(lanes['rma']) or '-'}]" if lanes else ""))
    return lines


def _which(args) -> int:
    """UNUSABLE when `import nixl` fails or the process holds no, or two, libucp."""
    from .tools.which import render, which

    module = args.nixl_module or "nixl"  # as engines import it, unless told otherwise
    try:
        info = which(module)
    except Exception as exc:  # ImportError (kvstack's nixl says why in one line), NIXL's own
        print(f"{module}: does not load here: {type(exc).__name__}: {exc}", file=sys.stderr)
        return UNUSABLE
    print(json.dumps(info, indent=2) if args.json else "\n".join(render(info)))
    return OK if len(info["ucp"]) == 1 else UNUSABLE


def main(argv=None) -> int:
    from .tools.placement import SCENARIOS, place
    from .tools.selftest import TP_HEADS
    from .tools.tp_group import ENGINES as TP_ENGINES
    from .tools.workload import BENCH_HEADS  # the model's KV heads the TP pairs split

    parser = Parser(prog="python -m kvruntime")
    parser.add_argument("--nixl-module", help="NIXL module to import (default: search "
                        "nixl_cpu, nixl_xpu, nixl_cu13, nixl_cu12, nixl; env "
                        "KVRUNTIME_NIXL_MODULE)")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    st = sub.add_parser("selftest", help="move KV blocks between two processes, bit-exact")
    st.add_argument("--json", action="store_true")
    st.add_argument("--compact", action="store_true", help="one-line JSON")
    st.add_argument("--timeout", type=_seconds, default=120.0)
    ids_help = ("device ids for device memory: the prefill's and the decode's (default: 0 0; "
                "two ids put the caches on two GPUs); a mixed-TP group's ranks are laid on "
                "all of them, one a rank, prefill ranks first, round robin (0 1 2 3: four GPUs)")
    st.add_argument("--device-ids", type=_at_least(0), nargs="+", default=None,
                    metavar="ID", help=ids_help)
    st.add_argument("--secret", help="shared secret for the handshake (env KVRUNTIME_SECRET; "
                    "default: a random one)")
    st.add_argument("--tp-pairs", type=_tp_pairs(TP_HEADS), default="1x2,2x1,2x4,4x2",
                    metavar="PxD[xN],...",
                    help="mixed tensor-parallel groups to prove, every rank a process of its "
                         "own, on host memory and each device's, direct and staged: prefill "
                         "TP x decode TP [x decode instances reading at once] (default: "
                         "1x2,2x1,2x4,4x2; none: skip)")
    st.add_argument("--pairs-at-once", type=_positive_int, default=None, metavar="N",
                    help="process pairs run side by side (host, host staged, TP, each device's "
                         "direct and staged; default: one per four CPUs)")
    w = sub.add_parser("which", help="which NIXL and which UCX `import nixl` loads here: the "
                       "module's file, libucp's, its transports")
    w.add_argument("--json", action="store_true")
    b = sub.add_parser("bench", help="GB/s and descriptors per request vs memcpy")
    b.add_argument("--json", action="store_true")
    b.add_argument("--compact", action="store_true")
    b.add_argument("--sizes", type=_positive_int, nargs="+", default=None,
                   help="MiB a request moves (default: 64 256 1024; a --scenario's own)",
                   metavar="MIB")
    b.add_argument("--patterns", nargs="+", default=["contiguous", "random"],
                   choices=["contiguous", "random"])
    b.add_argument("--layouts", nargs="+", default=["cross_layer", "per_layer"],
                   choices=["cross_layer", "per_layer"])
    b.add_argument("--ops", nargs="+", default=["pull", "push"],
                   choices=["pull", "push", "prefill_push"],
                   help="push: the decode asks the prefill to WRITE; prefill_push: the prefill "
                        "starts the push into blocks the decode named (expect_push), timed "
                        "from its start to the notification's arrival (NIXL) or to the end of "
                        "the decode's own copy (same-node)")
    b.add_argument("--split", type=_positive_int, nargs="+", default=None,
                   help="pieces per contiguous run (parallel descriptors; default: one per "
                        "copy stream for host memory, else 1)")
    b.add_argument("--ucx-threads", type=_at_least(0), default=None,
                   help="NIXL UCX engine threads (default: the decode's, by what NIXL moves, "
                        "the cores and /dev/shm: host memory one a core up to 4; the "
                        "prefill's 0)")
    b.add_argument("--host-streams", type=_positive_int, default=None,
                   help="same-node engine's reader threads for host memory (default: 4 on "
                        "hosts of 8 cores or more, else 1)")
    b.add_argument("--no-huge", action="store_true", help="4 KiB pages instead of MADV_HUGEPAGE")
    b.add_argument("--iters", type=_positive_int, default=None,
                   help="requests a row measures (default: 5; a --scenario's own)")
    b.add_argument("--block-kib", type=_even_kib, default=256,
                   help="KiB of one block, all layers (even)")
    b.add_argument("--handshakes", type=_positive_int, default=10)
    b.add_argument("--device", default="cpu", choices=["cpu", "cuda", "xpu"],
                   help="where both sides keep their KV caches: host DRAM or device VRAM "
                   "(reference: memmove, or a device-to-device copy)")
    b.add_argument("--device-ids", type=_at_least(0), nargs="+", default=None, metavar="ID",
                   help=ids_help)
    b.add_argument("--engines", nargs="+", default=["nixl", "samenode"],
                   choices=["nixl", "samenode", "auto"],
                   help="what moves the bytes: NIXL, the same-node engine, or auto")
    b.add_argument("--coalesce", nargs="+", default=["auto"], choices=["auto", "always", "never"],
                   help="NIXL clients' coalesce modes, a row set each (coalesced: through the "
                        "staging pools, one descriptor a chunk)")
    b.add_argument("--kv-buffer", default="device", choices=["device", "host_staged"],
                   help="host_staged: caches stay unregistered, NIXL moves staging-pool blocks")
    b.add_argument("--no-bare", action="store_true",
                   help="skip timing a bare transfer beside each request (a NIXL READ of the same "
                   "descriptors, or the same-node engine's copy of the same plan)")
    b.add_argument("--tp-pairs", type=_tp_pairs(BENCH_HEADS), default="none",
                   metavar="PxD[xN],...",
                   help="also mixed-TP rows: prefill TP P read by N decode instances of TP D at "
                        "once (N default 1), every rank a process on its device id (e.g. "
                        "2x2,2x1x2,1x2,2x4,4x2; default: none)")
    b.add_argument("--tp-engines", nargs="+", default=list(TP_ENGINES), choices=list(TP_ENGINES),
                   help="what moves the TP rows' bytes (default: all)")
    b.add_argument("--tp-ops", nargs="+", default=["pull", "prefill_push"],
                   choices=["pull", "push", "prefill_push"],
                   help="the TP rows' ops (default: pull prefill_push; staged rows skip "
                        "prefill_push)")
    b.add_argument("--placement", type=_placement, nargs="+", default=None, metavar="IDS",
                   help="per TP group, a device id a rank (prefill ranks, then each decode "
                        "instance's), e.g. 0,1,2,3 for 2x2; default: --device-ids round robin")
    b.add_argument("--tp-only", action="store_true", help="the TP rows alone")
    b.add_argument("--scenario", choices=list(SCENARIOS), default=None,
                   help="a named preset of TP groups, run alone: "
                        + "; ".join(f"{n}: {v['about']}" for n, v in SCENARIOS.items())
                        + " (its device ids, sizes and iterations unless --device-ids, --sizes,"
                        + " --iters)")
    b.add_argument("--inflight", type=_at_least(0), nargs=2, metavar=("PEERS", "REQUESTS"),
                   default=[4, 32], help="decode peers and requests kept in flight on one "
                   "prefill, beside one request of the same bytes: the peers as clients of "
                   "this process, and as decode processes of their own (0 0: skip)")
    from .tools import demo_cli

    demo_cli.add_parser(sub, {"at_least": _at_least, "seconds": _seconds})
    po = sub.add_parser("policy", help="the UCX settings each memory kind gets here and why, "
                        "on one host and across hosts (RDMA, the GPU's nearest NIC), moving "
                        "nothing")
    po.add_argument("--json", action="store_true")
    po.add_argument("--compact", action="store_true", help="one-line JSON")
    po.add_argument("--device-id", type=_at_least(0), default=0, metavar="ID",
                    help="the GPU whose nearest NIC is chosen (default: 0)")
    args = parser.parse_args(argv)
    if args.command == "policy":
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                            stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
        with _report_stream() as out:
            return _policy(args, out)
    if args.command == "which":
        return _which(args)
    if args.command == "demo":
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                            stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
        try:
            with _report_stream() as out:
                return demo_cli.run(args, out, _secret(args))
        except KeyboardInterrupt:
            return INTERRUPTED
    if args.command == "bench" and args.scenario:
        preset = SCENARIOS[args.scenario]
        args.tp_pairs = _tp_pairs(BENCH_HEADS)(",".join(preset["groups"]))
        args.device_ids = args.device_ids or preset["device_ids"]
        args.sizes, args.iters = args.sizes or preset["sizes_mib"], args.iters or preset["iters"]
        args.tp_only = True
    if args.command == "bench":
        args.sizes, args.iters = args.sizes or [64, 256, 1024], args.iters or 5
    args.device_ids = args.device_ids or [0, 0]
    if len(args.device_ids) < 2:
        (st if args.command == "selftest" else b).error(
            f"argument --device-ids: {args.device_ids[0]}: give at least two ids (the "
            f"prefill's and the decode's; 0 0 for one GPU)")
    if args.command == "bench" and args.placement:
        if len(args.placement) != len(args.tp_pairs):
            b.error(f"argument --placement: {len(args.placement)} placement(s) for "
                    f"{len(args.tp_pairs)} TP group(s): give one per group of --tp-pairs")
        for group, ids in zip(args.tp_pairs, args.placement):
            try:
                place(group, args.device_ids, ids)
            except ValueError as exc:
                b.error(f"argument --placement: {exc}")
    if args.command == "bench" and args.inflight == [0, 0]:
        args.inflight = None
    elif args.command == "bench" and 0 in args.inflight:
        b.error(f"argument --inflight: {args.inflight[0]} {args.inflight[1]}: peers and "
                f"requests must both be at least 1, or both 0 (skip)")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    try:
        with _report_stream() as out:
            return _selftest(args, out) if args.command == "selftest" else _bench(args, out)
    except KeyboardInterrupt:
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
