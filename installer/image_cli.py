"""`python -m installer image`: the verb's parser and the printing side of installer/image.py."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import image
from .usage import Parser


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m installer image",
                                description="Build the kvstack container image for a platform.")
    p.add_argument("--platform", required=True, choices=image.PLATFORMS)
    p.add_argument(
        "--variant",
        metavar="NAME",
        help="a named choice within the platform, as for install "
        "(xpu: ze-ipc); default tag kvstack:PLATFORM-VARIANT",
    )
    p.add_argument("--tag")
    p.add_argument(
        "--base-image",
        help="default: " + ", ".join(f"{k}={v}" for k, v in image.BASE_IMAGES.items()),
    )
    p.add_argument("--runtime-base-image", metavar="IMAGE",
                   help="the runtime stage's base (default: --base-image's), e.g. one without the "
                        "compilers an offline build stage's base holds")
    p.add_argument(
        "--mirror", help="a mirror made by `python -m installer mirror`, for offline builds"
    )
    p.add_argument(
        "--ca-bundle", help="extra CA certificates (PEM) for hosts behind an intercepting proxy"
    )
    p.add_argument("--recipe-overlay", action="append", default=[], metavar="TOML",
                   help="lay this TOML over the platform recipe in the build (repeatable)")
    p.add_argument(
        "--wheels",
        metavar="DIR",
        help="a complete set of wheels installed into the image's venv as given "
        "(--no-deps), e.g. PyPI's nixl-cu12 where NIXL is not built from source",
    )
    p.add_argument(
        "--binary-cache",
        metavar="DIR",
        help="a directory `python -m installer publish` filled: the "
        "build stage takes the build of its plan's build id from there instead of compiling",
    )
    p.add_argument(
        "--offline",
        action="store_true",
        help="build with no network (the builder's network mode none): the base image must "
        "hold the Debian packages the stages want (the build says which it lacks) and "
        "pip takes everything from --wheels, which it then needs",
    )
    p.add_argument(
        "--json", action="store_true", help="also print the result (parts, sizes, manifest) as JSON"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log every detail")
    return p


def run(args: argparse.Namespace) -> int:
    """Build the image (errors are InstallerErrors: the CLI prints their one line)."""
    req = image.request(args.platform, args.tag, args.base_image, args.mirror, args.ca_bundle,
                        args.recipe_overlay, args.wheels, args.variant, args.binary_cache,
                        args.offline, args.runtime_base_image)
    client = image.connect()
    n = 0

    def log(line: str) -> None:
        nonlocal n
        n += 1
        print(f"[{n:5d}] {line}", flush=True)

    res = image.build(client, req, Path(__file__).resolve().parent.parent, log)
    print(f"image {res['tag']}: id {res['id']}")
    for line in image.render_parts(res):
        print(line)
    if args.json:
        print(json.dumps(res, indent=2))
    return 0
