"""python -m installer: the only module that reads argv and prints.

    python -m installer [--platform P] [--prefix DIR] [--mirror DIR|URL] [--dry-run [--json]] ...
    python -m installer mirror DIR [--platform P ...] [--from DIR|URL]
    python -m installer verify [--prefix DIR]
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from pathlib import Path

from . import detect, install, mirror, plan as planmod, recipe as recipemod, verify
from .cache import Cache
from .errors import InstallerError, Interrupted, UsageError
from .sources import Fetcher

log = logging.getLogger("kvstack.installer")
COMMANDS = ("install", "mirror", "verify")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and our usage exit code, not argparse's
        raise UsageError(message, fix=f"see `{self.prog} --help`")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", type=Path, default=None, help="download and build cache (default: platformdirs user cache, or $KVSTACK_CACHE_DIR)")
    p.add_argument("--recipes", type=Path, default=recipemod.RECIPES_DIR, help=argparse.SUPPRESS)
    p.add_argument("-v", "--verbose", action="store_true", help="log every detail")


def build_parser() -> dict[str, argparse.ArgumentParser]:
    inst = _Parser(prog="python -m installer", description="Build UCX + NIXL for this host from pinned sources, "
                   "into an atomic prefix, and prove the result moves KV bytes.")
    inst.add_argument("--platform", choices=recipemod.PLATFORMS, help="default: detected (NVIDIA driver: cuda; Intel GPU: xpu; else cpu)")
    inst.add_argument("--prefix", type=Path, default=None, help="install location, a symlink to the current build (default: ~/.local/kvstack or $KVSTACK_PREFIX)")
    inst.add_argument("--jobs", "-j", type=int, default=None, help="parallel build jobs (default: CPUs available)")
    inst.add_argument("--python", default=sys.executable, help="the Python environment that receives NIXL's module (default: this one)")
    inst.add_argument("--mirror", help="take every source from this directory or URL instead of upstream")
    inst.add_argument("--recipe-overlay", type=Path, action="append", default=[], metavar="TOML",
                      help="lay this TOML over the platform recipe (repeatable)")
    inst.add_argument("--system-packages", choices=("install", "check", "ignore"), default="install",
                      help="install: apt-get what the recipe lists and is missing (as root); check: fail if any is "
                           "missing; ignore: only warn (hosts whose tools come from elsewhere)")
    inst.add_argument("--dry-run", action="store_true", help="print the plan and stop")
    inst.add_argument("--json", action="store_true", help="with --dry-run: the plan as JSON; otherwise the manifest")
    _common(inst)

    mir = _Parser(prog="python -m installer mirror", description="Fill DIR with every pinned source, for --mirror on an air-gapped host.")
    mir.add_argument("dir", type=Path)
    mir.add_argument("--platform", action="append", choices=recipemod.PLATFORMS, help="repeatable (default: all platforms)")
    mir.add_argument("--from", dest="source_mirror", help="copy from another mirror instead of upstream")
    mir.add_argument("--python", default=sys.executable, help="the Python whose build-tool wheels to add (default: this one)")
    mir.add_argument("--recipe-overlay", type=Path, action="append", default=[], metavar="TOML",
                     help="lay this TOML over each platform recipe (repeatable)")
    mir.add_argument("--no-wheels", action="store_true", help="sources only, no build-tool wheels")
    _common(mir)

    ver = _Parser(prog="python -m installer verify", description="Re-run the verification levels on this host.")
    ver.add_argument("--prefix", type=Path, default=None)
    ver.add_argument("--json", action="store_true")
    _common(ver)
    return {"install": inst, "mirror": mir, "verify": ver}


def _terminate(signum, frame):
    raise KeyboardInterrupt  # a kill gets the same cleanup as Ctrl-C: build processes stopped, prefix untouched


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _terminate)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["image"]:  # container images: a verb of its own, see installer/image_cli.py
        from . import image_cli
        return image_cli.main(argv[1:])
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "install"
    try:
        args = build_parser()[command].parse_args(argv)
        _setup_logging(args.verbose)
        return {"install": _install, "mirror": _mirror, "verify": _verify}[command](args)
    except InstallerError as e:
        if e.detail:
            print(e.detail, file=sys.stderr)
        print(e.line(), file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        e = Interrupted("stopped (Ctrl-C or SIGTERM)", fix="the previous install is untouched; run the same command again")
        print(e.line(), file=sys.stderr)
        return e.exit_code


def _setup_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger("kvstack")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.propagate = False


def _resolve(args) -> planmod.Plan:
    if args.platform:
        platform, reason = args.platform, "chosen with --platform"
    else:
        platform, reason = detect.detect_platform()
    recipe = recipemod.load(platform, args.recipe_overlay, recipes_dir=args.recipes)
    jobs = args.jobs if args.jobs is not None else planmod.default_jobs()
    return planmod.make_plan(recipe, prefix=args.prefix or planmod.default_prefix(),
                             cache_dir=args.cache_dir or planmod.default_cache_dir(), jobs=jobs,
                             target=planmod.Target.probe(args.python), platform_reason=reason)


def _install(args) -> int:
    plan = _resolve(args)
    if args.dry_run:
        print(json.dumps(plan.to_dict(), indent=2) if args.json else plan.render())
        return 0
    manifest = install.run(plan, mirror=args.mirror, system_packages=args.system_packages)
    if args.json:
        print(json.dumps(manifest, indent=2))
    else:
        print(install.summary(manifest))
    return 0


def _mirror(args) -> int:
    platforms = args.platform or list(recipemod.PLATFORMS)
    recipes = [recipemod.load(p, args.recipe_overlay, recipes_dir=args.recipes) for p in platforms]
    cache = Cache(args.cache_dir or planmod.default_cache_dir())
    records = mirror.fill(args.dir, recipes, Fetcher(cache, args.source_mirror))
    if not args.no_wheels:
        reqs = sorted({r for rec in recipes for r in rec.data["build_tools"]["python"] + rec.data["build_tools"].get("target", [])})
        mirror.fill_wheels(args.dir, reqs, args.python, cache.root / "mirror-wheels.log")
    print(f"mirror {args.dir}: {len(records)} sources for {', '.join(platforms)}")
    for r in records:
        print(f"  {r['file']:40} {r['pin']}")
    return 0


def _verify(args) -> int:
    prefix = args.prefix or planmod.default_prefix()
    report = verify.verify_prefix(prefix)
    print(json.dumps(report, indent=2) if args.json else verify.render_verification(report))
    return 0 if report["ok"] else 9
