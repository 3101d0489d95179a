"""``python -m kvruntime demo``'s options and its text report (__main__.py runs it)."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys

from .cli import MODE_FAILED, OK, UNUSABLE

# what `pip install` brings the demo's model from (pyproject's "demo" extra pins the same)
TRANSFORMERS = "transformers==5.17.0"


def add_parser(sub, types) -> None:
    """The ``demo`` subcommand; ``types``: __main__'s argparse types (at_least, seconds)."""
    from .demo import ENGINES, KINDS, OPS, TP_PAIRS

    d = sub.add_parser("demo", help="see a prompt prefilled in one process and continued in "
                       "another: a small transformer's KV through kvruntime, tokens and logits "
                       "compared with one process's")
    d.add_argument("--json", action="store_true")
    d.add_argument("--compact", action="store_true", help="one-line JSON")
    d.add_argument("--steps", type=types["at_least"](1), default=16,
                   help="tokens the decode generates after the prefill's first (default: 16)")
    d.add_argument("--prompt-tokens", type=types["at_least"](1), default=45,
                   help="the prompt's length (default: 45, three blocks of 16, one partial)")
    d.add_argument("--seed", type=types["at_least"](0), default=0,
                   help="the model's weights and the prompt")
    d.add_argument("--layouts", nargs="+", choices=list(KINDS), default=list(KINDS))
    d.add_argument("--engines", nargs="+", choices=list(ENGINES), default=list(ENGINES))
    d.add_argument("--ops", nargs="+", choices=list(OPS), default=list(OPS),
                   help="pull: the decode READs; push: the prefill WRITEs once the decode named "
                        "its blocks")
    d.add_argument("--tp", type=_tp_pairs, default=TP_PAIRS, metavar="PxD,...",
                   help="prefill TP x decode TP pairs (default: 1x1,2x1,1x2; the model has 4 "
                        "KV heads)")
    d.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the model runs and its pages live: host memory or GPU memory")
    d.add_argument("--device-ids", type=types["at_least"](0), nargs=2, default=[0, 0],
                   metavar="ID", help="the prefill ranks' GPU and the decode's (default: 0 0)")
    d.add_argument("--decode-seed", type=types["at_least"](0), default=None,
                   help="the decode's weights from another seed: refused at the handshake")
    d.add_argument("--decode-tokens-per-block", type=types["at_least"](1), default=16,
                   help="the decode's block size (another than 16: refused at the handshake)")
    d.add_argument("--timeout", type=types["seconds"], default=60.0)
    d.add_argument("--secret", help="shared secret for the handshake (env KVRUNTIME_SECRET; "
                   "default: a random one)")


def _tp_pairs(text: str) -> tuple[tuple[int, int], ...]:
    import argparse

    out = []
    for item in text.split(","):
        parts = item.split("x")
        if len(parts) != 2 or not all(x.isdigit() and int(x) in (1, 2, 4) for x in parts):
            raise argparse.ArgumentTypeError(f"{item!r} is not PxD with P and D of 1, 2 or 4 "
                                             f"(the model's 4 KV heads split evenly)")
        out.append((int(parts[0]), int(parts[1])))
    return tuple(out)


def run(args, out, secret: bytes | None) -> int:
    say = functools.partial(print, file=out)
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"demo: {' and '.join(missing)} not installed in {sys.executable}: pip install "
              f"{'torch ' if 'torch' in missing else ''}'{TRANSFORMERS}' (or the kvstack[demo] "
              f"extra)", file=sys.stderr)
        return UNUSABLE
    if args.device == "cuda":
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if max(args.device_ids) >= count:
            fix = f"give ids below {count}" if count else "run it with --device cpu"
            print(f"demo: --device cuda --device-ids {args.device_ids[0]} {args.device_ids[1]}: "
                  f"this host has {count} CUDA device(s); {fix}", file=sys.stderr)
            return UNUSABLE
    from .demo import DemoConfig, case_name, run_demo

    report = run_demo(DemoConfig(
        steps=args.steps, prompt_tokens=args.prompt_tokens, seed=args.seed,
        kinds=tuple(args.layouts), engines=tuple(args.engines), ops=tuple(args.ops),
        tp_pairs=args.tp, device=args.device, device_ids=tuple(args.device_ids),
        decode_seed=args.decode_seed, decode_tokens_per_block=args.decode_tokens_per_block,
        timeout=args.timeout, nixl_module=args.nixl_module,
        secret=secret or os.urandom(16)))  # the handshake authenticated, as an engine's is
    if args.json:
        say(json.dumps(report, indent=None if args.compact else 2))
    else:
        for line in _lines(report, case_name):
            say(line)
        if report.get("error"):
            print(f"error: {report['error']}", file=sys.stderr)
    if report.get("error"):
        return UNUSABLE
    return OK if report["ok"] else MODE_FAILED


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _lines(report: dict, case_name) -> list[str]:
    ref = report.get("reference")
    if not ref:
        return []
    app = ref["app"]
    lines = [f"model: {app['model']}, {app['num_hidden_layers']} layers, "
             f"{app['num_attention_heads']} query heads over {app['num_key_value_heads']} KV "
             f"heads of {app['head_dim']}, vocab {app['vocab_size']}, {app['dtype']}, weights "
             f"sha256 {app['weights_sha256'][:12]}; prompt {report['prompt_tokens']} tokens, "
             f"{report['steps']} steps on {report['device']}",
             f"one process: prefill {_ms(ref['seconds']['prefill'])}, decode "
             f"{_ms(ref['seconds']['decode'])}; tokens {ref['tokens']}"]
    for p in report.get("prefills", []):
        s = p["seconds"]
        lines.append(f"prefill TP {p['tp']} rank {p['rank']}: prefill {_ms(s['prefill'])}, KV "
                     f"into pages {_ms(s['write_pages'])} at blocks {p['blocks']} (model "
                     f"built in {_ms(s['build'])}); first token "
                     f"{p['first_token']}")
    width = max([len(case_name(c)) for c in report["cases"] + report["skipped"]] + [20])
    for c in report["cases"]:
        name = case_name(c)
        if "skipped" in c:
            lines.append(f"SKIP {name:{width}} {c['skipped']}")
        elif "error" in c:
            lines.append(f"FAIL {name:{width}} {c['error']}")
        else:
            s = c["seconds"]
            verdict = ("tokens identical, logits bit-identical" if c["ok"] else
                       f"TOKENS {'identical' if c['tokens_match'] else 'DIFFER'}, LOGITS "
                       f"{'bit-identical' if c['logits_bit_identical'] else 'DIFFER'}")
            lines.append(f"{'PASS' if c['ok'] else 'FAIL'} {name:{width}} blocks {c['src']} -> "
                         f"{c['dst']} ({', '.join(c['engines'])}): transfer "
                         f"{_ms(s['transfer'])}, decode {_ms(s['decode'])} (connect "
                         f"{_ms(s['connect'])}); {verdict}")
            lines.append(f"     {'':{width}} tokens {c['tokens']}")
    for c in report["skipped"]:
        lines.append(f"SKIP {case_name(c):{width}} {c['skipped']}")
    passed = sum(1 for c in report["cases"] if c.get("ok"))
    skipped = len(report["skipped"]) + sum(1 for c in report["cases"] if "skipped" in c)
    failed = len(report["cases"]) - passed - sum(1 for c in report["cases"] if "skipped" in c)
    lines.append(f"{'OK' if report['ok'] else 'FAILED'}: {passed} cases passed, {failed} "
                 f"failed, {skipped} skipped in {report.get('seconds')} s")
    return lines
