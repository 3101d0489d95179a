"""python -m installer: the only module that reads argv and prints.

    python -m installer [install] [--platform P] [--prefix DIR] [--mirror DIR|URL]
                        [--dry-run [--json]] ...
    python -m installer mirror DIR [--platform P ...] [--from DIR|URL]
    python -m installer verify [--prefix DIR]

Every verb is one entry of VERBS (its one-line summary, its parser, its handler); `--help` lists
them from there, so a new verb is one more entry and cannot be left out of the help.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import urlparse

from . import binarycache, buildcompare, detect, image_cli, install, mirror, ucxdirs, verify, wheel
from . import plan as planmod
from . import recipe as recipemod
from .cache import Cache
from .errors import InstallerError, Interrupted, UsageError
from .sources import Fetcher
from .usage import Parser

log = logging.getLogger("kvstack.installer")
DEFAULT_VERB = "install"  # `python -m installer --prefix P` (no verb) installs, as it always did


def _binary_cache(text: str) -> str:
    """--binary-cache: a directory, or a file://, http:// or https:// URL (checked here, not after
    a build)."""
    if "://" in text and urlparse(text).scheme not in ("file", "http", "https"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is no binary cache: give a directory or a file://, http:// or https:// URL"
        )
    return text


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="download and build cache (default: platformdirs user cache, or $KVSTACK_CACHE_DIR)",
    )
    p.add_argument("--recipes", type=Path, default=recipemod.RECIPES_DIR, help=argparse.SUPPRESS)
    p.add_argument("-v", "--verbose", action="store_true", help="log every detail")


def _install_parser() -> argparse.ArgumentParser:
    inst = Parser(
        prog="python -m installer",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="python -m installer [VERB] [options]",
        description="Build UCX + NIXL for this host from pinned sources, into an atomic prefix, "
        "and prove the result moves KV bytes.\n\n"
        + verbs_help()
        + "\n\nWith no verb: install. `python -m installer VERB --help` shows a verb's options; "
        "install's follow.",
    )
    inst.add_argument(
        "--platform",
        choices=recipemod.PLATFORMS,
        help="default: detected (NVIDIA driver: cuda; Intel GPU: xpu; else cpu)",
    )
    inst.add_argument(
        "--variant",
        metavar="NAME",
        help="a named choice within the platform (recipes/variants/): xpu's ze-ipc pins UCX at the "
        "unreleased upstream pull request that adds ze_ipc (single-node Intel GPUs); default: the "
        "platform's release pins",
    )
    inst.add_argument(
        "--prefix",
        type=Path,
        default=None,
        help="install location, a symlink to the current build (default: ~/.local/kvstack or "
        "$KVSTACK_PREFIX)",
    )
    inst.add_argument(
        "--jobs", "-j", type=int, default=None, help="parallel build jobs (default: CPUs available)"
    )
    inst.add_argument(
        "--component-jobs",
        type=int,
        default=None,
        metavar="N",
        help="components built side by side at most (default: as many as their dependencies allow, "
        "e.g. UCX configures while Abseil compiles; 1: one after another). Same build either way",
    )
    inst.add_argument(
        "--python",
        default=sys.executable,
        help="the Python environment that receives NIXL's module (default: this one)",
    )
    inst.add_argument("--mirror", type=_mirror_location,
                      help="take every source from this directory or URL instead of upstream")
    inst.add_argument("--recipe-overlay", type=Path, action="append", default=[], metavar="TOML",
                      help="lay this TOML over the platform recipe (repeatable)")
    inst.add_argument(
        "--system-packages",
        choices=("install", "check", "ignore"),
        default="install",
        help="install: apt-get what the recipe lists and is missing (as root); check: fail if any "
        "is missing; ignore: only warn (hosts whose tools come from elsewhere)",
    )
    inst.add_argument(
        "--binary-cache",
        metavar="DIR|URL",
        type=_binary_cache,
        help="take this build id's verified build from this cache "
        "(directory or file:// URL; see `publish`) instead of building; verified again here",
    )
    inst.add_argument("--dry-run", action="store_true", help="print the plan and stop")
    inst.add_argument(
        "--fetch-only",
        action="store_true",
        help="fetch every source of the plan into the cache, each checked against its "
        "pin, and stop (nothing built, the prefix untouched)",
    )
    inst.add_argument(
        "--json",
        action="store_true",
        help="with --dry-run: the plan as JSON; otherwise the manifest",
    )
    _common(inst)
    return inst


def _mirror_location(value: str) -> str:
    """A directory becomes absolute: the builds run in directories of their own, where NIXL's
    meson passes the mirror's wheels to uv by this path (a relative one named nothing there)."""
    return value if "://" in value else os.path.abspath(value)


def _mirror_parser() -> argparse.ArgumentParser:
    mir = Parser(
        prog="python -m installer mirror",
        description="Fill DIR with every pinned source, for --mirror on an air-gapped host.",
    )
    mir.add_argument("dir", type=Path)
    mir.add_argument(
        "--platform",
        action="append",
        choices=recipemod.PLATFORMS,
        help="repeatable (default: all platforms)",
    )
    mir.add_argument(
        "--variant",
        metavar="NAME",
        help="each platform's variant of this name (e.g. --platform xpu "
        "--variant ze-ipc) instead of its release pins",
    )
    mir.add_argument(
        "--from", dest="source_mirror", help="copy from another mirror instead of upstream"
    )
    mir.add_argument(
        "--python",
        default=sys.executable,
        help="the Python whose build-tool wheels to add (default: this one)",
    )
    mir.add_argument("--recipe-overlay", type=Path, action="append", default=[], metavar="TOML",
                     help="lay this TOML over each platform recipe (repeatable)")
    mir.add_argument("--no-wheels", action="store_true", help="sources only, no build-tool wheels")
    _common(mir)
    return mir


def _verify_parser() -> argparse.ArgumentParser:
    ver = Parser(
        prog="python -m installer verify",
        description="Re-run the verification levels on this host.",
    )
    ver.add_argument("--prefix", type=Path, default=None)
    ver.add_argument("--json", action="store_true")
    _common(ver)
    return ver


def _publish_parser() -> argparse.ArgumentParser:
    pub = Parser(
        prog="python -m installer publish",
        description="Store the verified build --prefix points to in a "
        "binary cache under its build id (archive + sha256 + manifest), for `install "
        "--binary-cache`.",
    )
    pub.add_argument("cache", metavar="DIR|URL", help="a directory or file:// URL")
    pub.add_argument("--prefix", type=Path, default=None)
    _common(pub)
    return pub


def _wheel_parser() -> argparse.ArgumentParser:
    whl = Parser(
        prog="python -m installer wheel",
        description="Make a relocatable wheel of NIXL's Python module from "
        "the verified build --prefix points to: UCX (private SONAMEs), its modules and NIXL's "
        "plugins inside, grafted and tagged manylinux by auditwheel repair, every RUNPATH "
        "$ORIGIN-relative; `pip install` it anywhere, no env.sh needed.",
    )
    whl.add_argument("--prefix", type=Path, default=None)
    whl.add_argument(
        "-o",
        "--output",
        type=Path,
        default=Path("."),
        metavar="DIR",
        help="where the wheel goes (default: .)",
    )
    _common(whl)
    return whl


def _compare_parser() -> argparse.ArgumentParser:
    cmp = Parser(
        prog="python -m installer compare",
        description="Compare two builds byte for byte (e.g. the same "
        "build id built twice, into the same prefix): every installed file, and for each one that "
        "differs the ELF sections and the build paths it holds. Exit code 0 when the bytes are the "
        "same, 1 when not.",
    )
    cmp.add_argument(
        "a",
        type=Path,
        metavar="BUILD_A",
        help="a build directory (P.builds/<build id>) or a prefix",
    )
    cmp.add_argument("b", type=Path, metavar="BUILD_B")
    cmp.add_argument("--json", action="store_true")
    _common(cmp)
    return cmp


@dataclass(frozen=True)
class Verb:
    summary: str  # the one line `python -m installer --help` shows
    parser: Callable[[], argparse.ArgumentParser]
    handler: Callable[[argparse.Namespace], int]


def verbs_help() -> str:
    width = max(len(n) for n in VERBS)
    return "verbs:\n" + "\n".join(
        f"  {name:{width}}  {verb.summary}" for name, verb in VERBS.items()
    )


def build_parser() -> dict[str, argparse.ArgumentParser]:
    return {name: verb.parser() for name, verb in VERBS.items()}


def _terminate(signum, frame):
    # a kill gets the same cleanup as Ctrl-C: build processes stopped, prefix untouched
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _terminate)
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and not argv[0].startswith("-") and argv[0] not in VERBS:
            # install takes no positional argument, so a bare word can only be a mistyped verb
            raise UsageError(
                f"unknown verb {argv[0]!r}",
                fix=f"use one of: {', '.join(VERBS)} (python -m installer --help)",
            )
        command = argv.pop(0) if argv and argv[0] in VERBS else DEFAULT_VERB
        verb = VERBS[command]
        args = verb.parser().parse_args(argv)
        _setup_logging(args.verbose)
        return verb.handler(args)
    except InstallerError as e:
        if e.detail:
            print(e.detail, file=sys.stderr)
        print(e.line(), file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        e = Interrupted(
            "stopped (Ctrl-C or SIGTERM)",
            fix="the previous install is untouched; run the same command again",
        )
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
    recipe = recipemod.load(
        platform, args.recipe_overlay, recipes_dir=args.recipes, variant=args.variant
    )
    jobs = args.jobs if args.jobs is not None else planmod.default_jobs()
    return planmod.make_plan(
        recipe,
        prefix=args.prefix or planmod.default_prefix(),
        cache_dir=args.cache_dir or planmod.default_cache_dir(),
        jobs=jobs,
        component_jobs=args.component_jobs,
        target=planmod.Target.probe(args.python),
        platform_reason=reason,
    )


def _install(args) -> int:
    plan = _resolve(args)
    if args.dry_run:
        print(json.dumps(plan.to_dict(), indent=2) if args.json else plan.render())
        return 0
    if args.fetch_only:
        records = install.fetch_only(plan, args.mirror)
        print(f"{len(records)} sources of {plan.build_id} checked against their pins, "
              f"in {plan.cache_dir}:")
        for name, rec in records.items():
            print(f"  {name:13} {rec['origin']}")
        return 0
    manifest = install.run(
        plan,
        mirror=args.mirror,
        system_packages=args.system_packages,
        binary_cache=args.binary_cache,
    )
    if args.json:
        print(json.dumps(manifest, indent=2))
    else:
        print(install.summary(manifest))
    return 0


def _mirror(args) -> int:
    platforms = args.platform or list(recipemod.PLATFORMS)
    recipes = [
        recipemod.load(p, args.recipe_overlay, recipes_dir=args.recipes, variant=args.variant)
        for p in platforms
    ]
    cache = Cache(args.cache_dir or planmod.default_cache_dir())
    records = mirror.fill(args.dir, recipes, Fetcher(cache, args.source_mirror))
    if not args.no_wheels:
        reqs = sorted(
            {
                r
                for rec in recipes
                for r in rec.data["build_tools"]["python"]
                + rec.data["build_tools"].get("target", [])
            }
        )
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


def _publish(args) -> int:
    out = binarycache.publish(args.prefix or planmod.default_prefix(), args.cache)
    print(
        f"build {out['build_id']} {'already in' if out['existed'] else 'published to'} "
        f"{out['entry']} (sha256 {out['sha256']})"
    )
    return 0


def _wheel(args) -> int:
    out = wheel.make(args.prefix or planmod.default_prefix(), args.output)
    print(
        f"{out['wheel']} ({out['size'] / 1e6:.1f} MB, {len(out['files'])} files, module "
        f"{out['module']}, tag {out['tag']}: auditwheel --plat auto)"
    )
    print(f"  grafted by auditwheel: {', '.join(out['grafted'])}")
    print("  requires: " + ", ".join(out["requires"]))
    for library, requirement in out["from_pip"].items():
        print(
            f"  {library}: from {requirement} (loaded from its directory in site-packages by the "
            "preload)"
        )
    print(f"  UCX's compiled-in directories (modules, configuration) made to name "
          f"{ucxdirs.NOWHERE.decode()}: {out['repointed']} strings in libucs")
    return 0


def _compare(args) -> int:
    result = buildcompare.compare(args.a, args.b)
    print(
        json.dumps(result.to_dict(), indent=2)
        if args.json
        else buildcompare.render(result, args.a, args.b)
    )
    return 0 if result.identical else 1


# The verbs, in the order --help lists them. A new verb is one entry here.
VERBS: dict[str, Verb] = {
    "install": Verb(
        "build the stack for this host into --prefix and verify it (the default verb)",
        _install_parser,
        _install,
    ),
    "mirror": Verb(
        "fill a directory with every pinned source and build-tool wheel, for air-gapped installs",
        _mirror_parser,
        _mirror,
    ),
    "verify": Verb(
        "re-run the verification levels (built, loaded, moved) on an installed prefix",
        _verify_parser,
        _verify,
    ),
    "publish": Verb(
        "store the verified build of --prefix in a binary cache under its build id, for install "
        "--binary-cache",
        _publish_parser,
        _publish,
    ),
    "wheel": Verb(
        "make a relocatable wheel of NIXL's module with a private UCX from the verified build of "
        "--prefix",
        _wheel_parser,
        _wheel,
    ),
    "compare": Verb(
        "compare two builds byte for byte (the same build id must give the same libraries)",
        _compare_parser,
        _compare,
    ),
    "image": Verb(
        "build the container image of a platform through the Docker SDK (DOCKER_HOST)",
        image_cli.parser,
        image_cli.run,
    ),
}
