"""``python -m kvruntime demo``: a prompt prefilled in one process and continued in another.

A small Llama-style model (model_kv.py: built from a config with a fixed seed, no download) runs
the prompt in a prefill process, whose KV lands in paged caches (cross_layer and per_layer,
16 tokens a block) at the blocks its allocator chose; a decode process, with its own allocator
and other block ids, pulls them (or has the prefill push them) through kvruntime, rebuilds the
model's cache from its pages and generates greedily. A third process generates the same tokens
alone, on the decode's device, as the reference. A case passes when its tokens equal the
reference's and every step's logits are bit-identical (same device, same arithmetic: a byte
changed on the way shows). Every engine (NIXL, same-node, host-staged pools, coalesced NIXL),
pull and push, and mixed TP (prefill TP 2 -> decode TP 1 and back) where the engine allows.
The decode's model and layout must match the prefill's: the handshake refuses them otherwise
(``--decode-seed``, ``--decode-tokens-per-block`` show it).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass

from .demo_roles import ENGINE_OPTIONS, decode_main, prefill_main, reference_main
from .roles import answer, reap

ENGINES = tuple(ENGINE_OPTIONS)
OPS = ("pull", "push")
KINDS = ("cross_layer", "per_layer")
TP_PAIRS = ((1, 1), (2, 1), (1, 2))
# Whether (engine, op, mixed TP) can run here, and why not: checked before any process starts
SKIPS = {
    ("host_staged", "push"): "a host-staged prefill pushes nothing: its decodes pull through "
                             "the pools",
}
CPU_SKIPS = {
    ("samenode", "mixed"): "the same-node engine copies head slices between GPUs only (CUDA "
                           "IPC): on host memory mixed TP goes through NIXL",
}


@dataclass(frozen=True)
class DemoConfig:
    steps: int = 16
    prompt_tokens: int = 45
    seed: int = 0
    kinds: tuple[str, ...] = KINDS
    engines: tuple[str, ...] = ENGINES
    ops: tuple[str, ...] = OPS
    tp_pairs: tuple[tuple[int, int], ...] = TP_PAIRS
    device: str = "cpu"
    device_ids: tuple[int, int] = (0, 0)  # the prefill ranks', the decode's (and reference's)
    num_blocks: int = 64
    decode_seed: int | None = None  # None: the prefill's (another: refused at the handshake)
    decode_tokens_per_block: int = 16  # another: refused at the handshake
    timeout: float = 60.0
    nixl_module: str | None = None
    secret: bytes | None = None


def cases(cfg: DemoConfig) -> tuple[list[dict], list[dict]]:
    """(the cases to run, the ones skipped with why), in the order they are reported."""
    run, skipped = [], []
    for p, d in cfg.tp_pairs:
        for kind in cfg.kinds:
            for engine in cfg.engines:
                for op in cfg.ops:
                    case = {"layout": kind, "engine": engine, "op": op, "prefill_tp": p,
                            "decode_tp": d}
                    why = SKIPS.get((engine, op)) or (
                        CPU_SKIPS.get((engine, "mixed")) if p != d and cfg.device == "cpu"
                        else None)
                    (skipped if why else run).append({**case, **({"skipped": why} if why
                                                                 else {})})
    return run, skipped


def case_name(case: dict) -> str:
    return (f"{case['layout']}/{case['engine']}/{case['op']}/"
            f"tp{case['prefill_tp']}->{case['decode_tp']}")


def _context():
    """The demo's processes come from a fork server that has imported torch and transformers'
    Llama modelling once (~6 s of CPU a process on a 2-core host: three of them importing it
    was most of the demo's time) and nothing of NIXL or UCX: each starts as clean as a spawned
    one (UCX is set up and NIXL loaded in it, roles.prepare_process; CUDA is not initialized
    before the fork)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # a module missing is skipped
    return ctx


# what every demo process imports: the fork server's, once
PRELOAD = ("numpy", "torch", "transformers.models.llama.modeling_llama",
           "kvruntime.tools.demo_roles")


def run_demo(cfg: DemoConfig) -> dict:
    """The report: the reference, each prefill rank's phases, each case's tokens and times.
    Every process starts at once: the prefill ranks, the reference and the decode (which builds
    its model while the prefills run the prompt, then takes their ready reports from here)."""
    from . import model_kv

    started = time.perf_counter()
    prompt = model_kv.prompt(cfg.prompt_tokens, cfg.seed)
    todo, skipped = cases(cfg)
    report = {"tool": "kvruntime demo", "ok": False, "device": cfg.device,
              "device_ids": list(cfg.device_ids), "prompt_tokens": len(prompt),
              "steps": cfg.steps, "cases": [], "skipped": skipped}
    ctx = _context()
    procs, controls, queues = [], [], []
    base = {"device": cfg.device, "num_blocks": cfg.num_blocks, "nixl_module": cfg.nixl_module,
            "secret": cfg.secret, "timeout": cfg.timeout, "prompt": prompt}

    def start(target, name: str, *args) -> None:
        proc = ctx.Process(target=target, args=args, name=name, daemon=True)
        proc.start()
        procs.append(proc)

    try:
        prefills = {}
        decode_q, go, ref_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
        queues += [decode_q, go, ref_q]
        buffers = sorted({"host_staged" if c["engine"] == "host_staged" else "device"
                          for c in todo}) or ["device"]
        for p in sorted({c["prefill_tp"] for c in todo}):
            ranks = []
            for rank in range(p):
                ready_q, control, answers = ctx.Queue(), ctx.Queue(), ctx.Queue()
                queues += [ready_q, control, answers]
                spec = {**base, "rank": rank, "tp": p, "seed": cfg.seed,
                        "device_id": cfg.device_ids[0], "kinds": sorted({c["layout"] for c in
                                                                        todo}),
                        "buffers": buffers}
                start(prefill_main, f"prefill-tp{p}-rank{rank}", ready_q, control, [answers],
                      spec)
                controls.append((procs[-1], control))
                ranks.append({"proc": procs[-1], "ready_q": ready_q, "control": control,
                              "answers": answers})
            prefills[str(p)] = ranks
        # the same generation in one process of its own, on the decode's device
        start(reference_main, "reference", ref_q, {**base, "seed": cfg.seed,
                                                  "device_id": cfg.device_ids[1],
                                                  "steps": cfg.steps})
        reference_proc = procs[-1]
        spec = {**base, "seed": cfg.seed if cfg.decode_seed is None else cfg.decode_seed,
                "device_id": cfg.device_ids[1], "steps": cfg.steps, "cases": todo,
                "tokens_per_block": cfg.decode_tokens_per_block,
                "prefills": {p: [{k: r[k] for k in ("control", "answers")} for r in ranks]
                             for p, ranks in prefills.items()},
                # as long as this process may wait for every rank's ready report and the
                # reference's, one timeout each
                "ready_timeout": cfg.timeout * (1 + sum(len(r) for r in prefills.values()))}
        start(decode_main, "decode", decode_q, spec, go)
        decoder = procs[-1]
        controls.append((decoder, go))  # "stop" there ends a decode still waiting
        ready_all = {}
        for p, ranks in prefills.items():
            for r in ranks:
                ready = answer(r["ready_q"], cfg.timeout, r["proc"].name, [r["proc"]])
                if not ready.get("ok"):
                    report["error"] = f"{r['proc'].name}: {ready.get('error')}"
                    report["trace"] = ready.get("trace")
                    return report
                ready_all.setdefault(p, []).append(ready)
                report.setdefault("prefills", []).append(
                    {"tp": int(p), "rank": ready["rank"], "blocks": ready["blocks"],
                     "first_token": ready["first"], "seconds": ready["seconds"]})
        ref = answer(ref_q, cfg.timeout, "the reference process", [reference_proc])
        if not ref.get("ok"):
            report["error"], report["trace"] = f"reference: {ref.get('error')}", ref.get("trace")
            return report
        ref_logits = ref.pop("logits")
        report["reference"] = {k: ref[k] for k in ("tokens", "app", "seconds")}
        go.put(ready_all)  # only now: on an error above, the decode waiting there is told stop
        _collect(report, ref_logits, decode_q, decoder, cfg)
    finally:
        for proc, control in controls:
            reap(proc, control)
        for proc in procs:
            reap(proc)
        for q in queues:
            q.close()
    report["seconds"] = round(time.perf_counter() - started, 2)
    return report


def _collect(report: dict, ref_logits, q, decoder, cfg: DemoConfig) -> None:
    """Each case's report from the decode, judged against the reference."""
    import numpy as np

    ref = report["reference"]
    first = answer(q, cfg.timeout, "the decode process", [decoder])
    if "built" not in first:
        report["error"], report["trace"] = f"decode: {first.get('error')}", first.get("trace")
        return
    report["decode_build_seconds"] = first["built"]
    while True:
        got = answer(q, cfg.timeout, "the decode process", [decoder])
        if got.get("done"):
            break
        if "case" not in got:
            report["error"], report["trace"] = f"decode: {got.get('error')}", got.get("trace")
            return
        case = {**got.pop("case"), **got}
        if case.get("ok"):
            logits = case.pop("logits")
            case["tokens_match"] = case["tokens"] == ref["tokens"]
            # bit for bit: the same device and dtype run the same kernels on the same bytes
            case["logits_bit_identical"] = bool(
                logits.shape == ref_logits.shape
                and np.array_equal(logits.view(np.uint32), ref_logits.view(np.uint32)))
            case["ok"] = case["tokens_match"] and case["logits_bit_identical"]
        report["cases"].append(case)
    report.pop("error", None)
    report["ok"] = bool(report["cases"]) and all(c.get("ok") or "skipped" in c
                                                 for c in report["cases"])
