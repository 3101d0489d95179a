"""``python -m kvruntime bench --tp-pairs PxD[xN],...`` (or ``--scenario``): mixed tensor-parallel
transfers with every rank a process of its own on its device, beside the copies that bound them.

A group (placement.Group) is prefill TP p read by N decode instances of TP d at once, each rank
on a device of ``--device-ids`` (placement.place: prefill ranks first, round robin), with
``bench_layout``'s shape and the model's 8 KV heads split over the ranks. Every decode rank
requests the same random blocks; it receives its own heads of them from every prefill rank that
holds some (tp_group.py). For each engine (tp_group.ENGINES) and op (pull; a push the prefill
ranks start, timed from their ``start_push`` as the pair bench times it), one row:

- ``ranks``: each decode rank alone (the others idle), the median GB/s of ``iters`` requests,
  beside its ``RankReference`` — a torch copy of the same bytes between the same devices (a
  peer copy across GPUs), or a host memmove — timed just before each request; and its GB/s
  while every rank moves at once (``together_gbps``);
- ``total``: every rank of every decode instance started at one moment; all their bytes over
  the span from the first start to the last end, beside all their reference copies started
  at one moment the same way;
- descriptors per request, UCX's lanes, device memory over TCP flagged, and each rank's heads
  checked bit-exact against the prefill ranks they came from (the first, warm-up request).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import statistics

from ..layout import CROSS_LAYER
from .placement import parse_group, place
from .tp_group import ENGINES, STAGED_OPS, RankError, RankGroup, kv_buffer_sets
from .workload import BENCH_HEADS, bench_layout, pick_blocks


def tp_layout(cfg, tp: int, max_mib: int):
    full = bench_layout(CROSS_LAYER, cfg.block_kib, max_mib)
    return dataclasses.replace(full, num_kv_heads=full.num_kv_heads // tp, tp_size=tp)


def run_tp(cfg) -> list[dict]:
    """The rows of every group of ``cfg.tp_pairs``, each engine of ``cfg.tp_engines`` and op
    of ``cfg.tp_ops``."""
    rows = []
    size = max(cfg.sizes_mib)
    rnd = random.Random(cfg.seed)
    full = bench_layout(CROSS_LAYER, cfg.block_kib, size)
    count = max(1, (size << 20) // full.block_bytes)
    for n, text in enumerate(cfg.tp_pairs):
        group = parse_group(text, BENCH_HEADS)
        placement = place(group, cfg.device_ids,
                          cfg.tp_placements[n] if cfg.tp_placements else None)
        blocks = pick_blocks("random", count, full.num_blocks, rnd)
        layouts = (tp_layout(cfg, group.p, size), tp_layout(cfg, group.d, size))
        for kv_buffers in kv_buffer_sets(cfg.device):
            engines = [e for e in cfg.tp_engines if ENGINES[e]["kv_buffer"] in kv_buffers]
            if not engines:
                continue
            options = {"nixl_module": cfg.nixl_module, "huge": cfg.huge_pages,
                       "device": cfg.device, "timeout": 120.0, "staging_blocks": count + 1}
            base = {"group": group.label, "tp": [group.p, group.d],
                    "decode_instances": group.instances,
                    "memory": "DRAM" if cfg.device == "cpu" else "VRAM", "blocks": count}
            if cfg.device != "cpu":  # host memory has no place: every rank shares it
                base["placement"] = placement.as_dict()
            try:
                with RankGroup(group, placement, layouts, kv_buffers, options,
                               cfg.seed + 100 * n, blocks, references=True) as ranks:
                    for engine in engines:
                        kv_buffer = ENGINES[engine]["kv_buffer"]
                        ops = [op for op in cfg.tp_ops
                               if op in STAGED_OPS or kv_buffer != "host_staged"]
                        connected = ranks.connect(engine)
                        refused = next((c.get("skipped") or c.get("error")
                                        for c in connected.values()
                                        if "skipped" in c or "error" in c), None)
                        for op in ops:
                            row = {**base, "kv_buffer": kv_buffer, "engine": engine, "op": op}
                            if refused is not None:
                                key = "skipped" if any("skipped" in c for c in
                                                       connected.values()) else "error"
                                rows.append({**row, key: refused})
                                continue
                            first = connected[ranks.ranks[0]]
                            row.update(engine_used=first["engine"], reason=first["reason"],
                                       staged_copy=first["staged_copy"])
                            rows.append(_measure(ranks, cfg.iters, row, op))
            except RankError as exc:
                rows.append({**base, "kv_buffer": "+".join(kv_buffers), "error": str(exc)})
    return rows


def _rate(t: dict) -> float:
    return t["bytes"] / (t["t1"] - t["t0"]) / 1e9


def _span_rate(answers: dict) -> float:
    """All ranks' bytes over the span from the first start to the last end."""
    span = max(a["t1"] for a in answers.values()) - min(a["t0"] for a in answers.values())
    return sum(a["bytes"] for a in answers.values()) / span / 1e9


def _measure(ranks, iters: int, row: dict, op: str) -> dict:
    requests = itertools.count()

    def move(who, check=False) -> dict:
        answers = ranks.at_once(who, {"move": op, "check": check,
                                      "request": f"bench-{op}-{next(requests)}"})
        failed = [f"decode {k} rank {j}: {a['error']}" for (k, j), a in answers.items()
                  if "error" in a]
        if failed:
            raise RankError("; ".join(failed))
        return answers

    def copy(who) -> dict:
        return ranks.at_once(who, {"copy": True})

    try:
        first = move(ranks.ranks, check=True)  # warm-up of every rank, and its heads checked
        alone = {r: ([], []) for r in ranks.ranks}
        for r in ranks.ranks:
            for _ in range(iters):
                alone[r][1].append(_rate(copy([r])[r]))
                alone[r][0].append(_rate(move([r])[r]))
        together, totals, total_refs = {r: [] for r in ranks.ranks}, [], []
        for _ in range(iters):
            refs = copy(ranks.ranks)
            total_refs.append(_span_rate(refs))
            moved = move(ranks.ranks)
            totals.append(_span_rate(moved))
            for r in ranks.ranks:
                together[r].append(_rate(moved[r]))
    except RankError as exc:
        return {**row, "error": str(exc)}
    out = []
    for r in ranks.ranks:
        (k, j), got = r, first[r]
        gbps, ref = statistics.median(alone[r][0]), statistics.median(alone[r][1])
        where = {} if "placement" not in row else {
            "device_id": ranks.placement.decode[k][j],
            "prefill_device_ids": [ranks.placement.prefill[s.prefill_rank]
                                   for s in ranks.slices[r]]}
        out.append({"instance": k, "rank": j, **where,
                    "prefill_ranks": [s.prefill_rank for s in ranks.slices[r]],
                    "bytes": got["bytes"], "descriptors": got["descriptors"],
                    "gbps": round(gbps, 3), "ref_gbps": round(ref, 3),
                    "ratio": round(gbps / ref, 3),
                    "together_gbps": round(statistics.median(together[r]), 3),
                    "bit_exact": got["bit_exact"], "transports": got.get("transports"),
                    **({"reason": got["reason"]} if "reason" in got else {}),
                    "tcp_for_device_memory": got.get("tcp_for_device_memory") or []})
    total, total_ref = statistics.median(totals), statistics.median(total_refs)
    return {**row, "ref": refs[ranks.ranks[0]]["ref"], "ranks": out,
            "total": {"bytes": sum(o["bytes"] for o in out), "gbps": round(total, 3),
                      "ref_gbps": round(total_ref, 3), "ratio": round(total / total_ref, 3)},
            "bit_exact": all(o["bit_exact"] for o in out),
            "tcp_for_device_memory": any(o["tcp_for_device_memory"] for o in out)}
