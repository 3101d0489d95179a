"""Container image builds through the Docker SDK (`docker` on PyPI), against whatever daemon
DOCKER_HOST names: dockerd, or podman's Docker-compatible API.

Library code: it returns results and raises InstallerError; installer/image_cli.py prints.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from .errors import BuildError, HostError, UsageError

# Per-platform base images (tpu stages KV through host memory like cpu). Still tags: no registry
# is reachable where this was written, so their digests could not be read; pin them (NAME@sha256:)
# from a connected host before relying on a pull.
BASE_IMAGES = {
    "cpu": "debian:12-slim",
    "tpu": "debian:12-slim",
    "cuda": "nvidia/cuda:12.8.1-devel-ubuntu24.04",
    "xpu": "intel/oneapi-basekit:2025.1.0-0-devel-ubuntu24.04",  # carries the Level Zero loader
}
PLATFORMS = tuple(BASE_IMAGES)
# What a platform's build loads at run time from the distribution, for a base that lacks it (the
# Debian base CI makes; intel/oneapi-basekit carries its own loader): Debian's packages, and the
# library whose presence (ldconfig -p) makes them unneeded. The build stage's verification runs it
# too.
# Every platform's UCX has RDMA modules that link the host's rdma-core (installer/rdma.py): an image
# made to move KV between hosts carries its user-space libraries and providers.
RDMA_CORE = ("libibverbs1 librdmacm1 ibverbs-providers", "libibverbs.so.1")
RUNTIME_PACKAGES = {
    "xpu": [
        ("libze1", "libze_loader.so.1"),
        RDMA_CORE,
    ],  # Level Zero's loader: UCX's ze modules link it
}
CONTAINERFILE = "Containerfile"
MIRROR_DIR = (
    "_work/image-mirror"  # inside the build context; the Containerfile copies it when present
)
CA_FILE = "_work/image-ca.crt"
OVERLAY_DIR = "_work/image-overlays"  # --recipe-overlay files, in order (NN-name.toml)
WHEEL_DIR = "_work/image-wheels"      # --wheels: installed into the image's venv as given
BINARY_CACHE_DIR = (
    "_work/image-binary-cache"  # --binary-cache: the installer takes the build from it
)
STAGED = (MIRROR_DIR, CA_FILE, OVERLAY_DIR, WHEEL_DIR, BINARY_CACHE_DIR)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the daemon colours a RUN step's stderr
_TAG_RE = re.compile(r"^[a-z0-9]+(?:[._/:@-][a-zA-Z0-9._-]+)*$")


@dataclass
class ImageRequest:
    platform: str
    tag: str
    base_image: str
    mirror: Path | None = None
    ca_bundle: Path | None = None
    overlays: tuple[Path, ...] = ()
    wheels: Path | None = None
    variant: str | None = None
    binary_cache: Path | None = None
    offline: bool = False  # no network in the build (network mode none): nothing may reach out
    runtime_base_image: str | None = None  # the runtime stage's base; None: base_image
    extra_args: dict[str, str] = field(default_factory=dict)


def request(platform: str, tag: str | None = None, base_image: str | None = None,
            mirror: str | None = None, ca_bundle: str | None = None,
            overlays: Iterable[str] = (), wheels: str | None = None, variant: str | None = None,
            binary_cache: str | None = None, offline: bool = False,
            runtime_base_image: str | None = None) -> ImageRequest:
    """Check the options; every bad one is one clear line saying which option to fix."""
    if platform not in BASE_IMAGES:
        raise UsageError(f"no base image for platform {platform!r}",
                         fix=f"use --platform {'|'.join(PLATFORMS)}, or name one with --base-image")
    tag = tag or f"kvstack:{platform}" + (f"-{variant}" if variant else "")
    if not _TAG_RE.match(tag) or len(tag) > 255:
        raise UsageError(f"bad image tag {tag!r}", fix="use --tag NAME[:TAG] (lowercase name)")
    base = base_image or BASE_IMAGES[platform]
    for option, ref in (
        ("--base-image", base),
        ("--runtime-base-image", runtime_base_image or base),
    ):
        if not _TAG_RE.match(ref.lower()) or len(ref) > 512:
            raise UsageError(f"bad base image reference {ref!r}",
                             fix=f"use {option} NAME[:TAG][@sha256:...]")
    m = Path(mirror).resolve() if mirror else None
    if m is not None and not (m / "SHA256SUMS").is_file():
        raise UsageError(f"--mirror {mirror}: no SHA256SUMS there",
                         fix="make one with: python -m installer mirror DIR --platform " + platform)
    ca = Path(ca_bundle).resolve() if ca_bundle else None
    if ca is not None:
        try:
            head = ca.read_text(errors="replace")[:4096]
        except OSError as e:
            raise UsageError(f"--ca-bundle {ca_bundle}: cannot read it ({e.strerror})") from None
        if "-----BEGIN CERTIFICATE-----" not in head:
            raise UsageError(f"--ca-bundle {ca_bundle}: not a PEM certificate bundle",
                             fix="pass a file holding -----BEGIN CERTIFICATE----- blocks")
    ov = tuple(_overlays(platform, overlays, variant))
    w = Path(wheels).resolve() if wheels else None
    if w is not None and not any(w.glob("*.whl")):
        raise UsageError(
            f"--wheels {wheels}: no .whl files there",
            fix="fill it with: python -m pip download -d DIR --only-binary=:all: REQUIREMENT...",
        )
    bc = Path(binary_cache).resolve() if binary_cache else None
    if bc is not None and not any(bc.glob("*/manifest.json")):
        raise UsageError(f"--binary-cache {binary_cache}: no published build there",
                         fix="fill it with: python -m installer publish DIR --prefix PREFIX")
    if offline and w is None:
        raise UsageError(
            "--offline: pip has no index in an offline build, so it needs --wheels",
            fix="pass --wheels DIR with every wheel the image's venv and the installer "
            "need (ci/image-wheels.sh fills one)",
        )
    return ImageRequest(platform, tag, base, m, ca, ov, w, variant, bc, offline, runtime_base_image)


def _overlays(platform: str, overlays: Iterable[str], variant: str | None) -> list[Path]:
    """Each --recipe-overlay (and the --variant) must lay over the platform's recipe here as it will
    in the build: a bad one fails now, in one line, not minutes into the image build."""
    from . import recipe as recipemod  # noqa: PLC0415 - jsonschema is only needed when overlays are given

    paths = [Path(o).resolve() for o in overlays]
    for o, path in zip(overlays, paths):
        if not path.is_file():
            raise UsageError(f"--recipe-overlay {o}: no such file", fix="pass a TOML file")
    if paths or variant:
        recipemod.load(platform, paths, variant=variant)
    return paths


def build_args(req: ImageRequest) -> dict[str, str]:
    """The Containerfile's ARGs for this request (the mapping unit tests check)."""
    args = {
        "PLATFORM": req.platform,
        "VARIANT": req.variant or "",
        "BASE_IMAGE": req.base_image,
        "RUNTIME_BASE_IMAGE": req.runtime_base_image or req.base_image,
        "WITH_MIRROR": "1" if req.mirror else "0",
        "WITH_CA": "1" if req.ca_bundle else "0",
        "WITH_OVERLAYS": "1" if req.overlays else "0",
        "WITH_WHEELS": "1" if req.wheels else "0",
        "WITH_BINARY_CACHE": "1" if req.binary_cache else "0",
        "KVSTACK_STAGED": "1",
        "OFFLINE": "1" if req.offline else "0",
    }
    rows = RUNTIME_PACKAGES.get(req.platform, [RDMA_CORE])
    args.update(
        RUNTIME_PACKAGES=" ".join(p for p, _ in rows),
        RUNTIME_LIBRARY=" ".join(lib for _, lib in rows),
    )
    args.update(req.extra_args)
    return args


def network_mode(req: ImageRequest) -> str:
    """The builder's network for this request: none offline (a RUN that reaches out fails), else
    the host's (CI's dockerd has no bridge)."""
    return "none" if req.offline else "host"


def connect(env: dict[str, str] | None = None):
    """A Docker SDK client, or one line saying which variable to set."""
    try:
        import docker  # noqa: PLC0415 - optional dependency, only this verb needs it
    except ImportError:
        raise HostError("the Docker SDK is not installed",
                        fix="run: .venv/bin/python -m pip install docker") from None
    try:
        client = docker.from_env(environment=env)
        client.ping()
    except Exception as e:  # the SDK raises DockerException, requests' errors, or OSError
        raise HostError(
            f"no container daemon reachable ({type(e).__name__})",
            fix="start dockerd or podman's API service and set DOCKER_HOST "
            "(e.g. unix:///run/docker.sock or unix:///run/podman/podman.sock)",
        ) from None
    return client


def base_is_local(client, ref: str) -> bool:
    import docker.errors  # noqa: PLC0415
    try:
        client.images.get(ref)
        return True
    except docker.errors.ImageNotFound:
        return False


def stage_context(req: ImageRequest, checkout: Path) -> None:
    """Put the optional mirror, overlays, wheels, binary cache and CA bundle where the Containerfile
    looks for them (the CA file and the wheels' directory always: it copies them by name) (wheels,
    mirror and cache files hard-linked where the filesystem allows: no copy of GBs)."""
    import shutil  # noqa: PLC0415
    unstage_context(checkout)
    mdir, ca = checkout / MIRROR_DIR, checkout / CA_FILE
    mdir.mkdir(parents=True)
    if req.mirror:
        shutil.copytree(req.mirror, mdir, dirs_exist_ok=True, copy_function=_link_or_copy)
    ca.write_text(req.ca_bundle.read_text() if req.ca_bundle else "")
    if req.overlays:
        odir = checkout / OVERLAY_DIR
        odir.mkdir(parents=True)
        for i, o in enumerate(req.overlays):
            shutil.copyfile(o, odir / f"{i:02d}-{o.name}")
    wdir = checkout / WHEEL_DIR  # the Containerfile copies it before the checkout, empty or not
    wdir.mkdir(parents=True)
    if req.wheels:
        for w in sorted(req.wheels.glob("*.whl")):
            _link_or_copy(w, wdir / w.name)
    if req.binary_cache:
        shutil.copytree(req.binary_cache, checkout / BINARY_CACHE_DIR, copy_function=_link_or_copy)


def unstage_context(checkout: Path) -> None:
    import shutil  # noqa: PLC0415
    for rel in STAGED:
        path = checkout / rel
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def _link_or_copy(src, dst) -> None:
    import os  # noqa: PLC0415
    import shutil  # noqa: PLC0415
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def build(client, req: ImageRequest, checkout: Path, log: Callable[[str], None]) -> dict:
    """Build through the low-level API so the log streams; intermediate containers are removed
    even on failure (rm + forcerm); the base is pulled only when it is not local."""
    bases = {req.base_image, req.runtime_base_image or req.base_image}
    pull = not all(base_is_local(client, b) for b in bases)
    stage_context(req, checkout)
    try:
        context = _context(checkout)
    finally:
        unstage_context(checkout)
    with context:
        # the build stage first, tagged TAG-build (its size is reported beside the runtime's);
        # the full build, from the same context, then takes every build-stage layer from the cache
        build_id = _build(client, req, context, log, pull, target="build", tag=build_tag(req.tag))
        context.seek(0)
        image_id = _build(client, req, context, log, pull, target=None, tag=req.tag)
    img = client.images.get(image_id)
    base = client.images.get(req.runtime_base_image or req.base_image)  # what the image is over
    inside = inspect(client, image_id)
    return {
        "id": image_id,
        "tag": req.tag,
        "size": img.attrs.get("Size"),
        "build_stage": {
            "id": build_id,
            "tag": build_tag(req.tag),
            "size": client.images.get(build_id).attrs.get("Size"),
        },
        "base_size": base.attrs.get("Size"),
        "manifest": inside.get("manifest"),
        "parts": parts(inside.get("manifest"), inside.get("dists", {}), inside.get("nixl_module")),
    }


def build_tag(tag: str) -> str:
    """The build stage's tag beside TAG: NAME:T-build (NAME:build when TAG has no tag part)."""
    name, _, t = tag.rpartition(":") if ":" in tag.rsplit("/", 1)[-1] else (tag, "", "")
    return f"{name}:{t}-build" if t else f"{tag}:build"


def _context(checkout: Path):
    """The build context as one tar file (.dockerignore applied, as the daemon's CLI would), made
    once: both builds see the same bytes even if the checkout changes meanwhile."""
    from docker import utils  # noqa: PLC0415
    ignore = checkout / ".dockerignore"
    exclude = (
        [
            line.strip()
            for line in ignore.read_text().splitlines()
            if line.strip() and not line.startswith("#")
        ]
        if ignore.is_file()
        else None
    )
    return utils.tar(str(checkout), exclude=exclude, dockerfile=(CONTAINERFILE, None))


def _build(
    client, req: ImageRequest, context, log, pull: bool, target: str | None, tag: str
) -> str:
    import docker.errors  # noqa: PLC0415
    tail: list[str] = []
    image_id = None
    try:
        stream = client.api.build(
            fileobj=context,
            custom_context=True,
            dockerfile=CONTAINERFILE,
            tag=tag,
            target=target,
            buildargs=build_args(req),
            rm=True,
            forcerm=True,
            pull=False,
            decode=True,
            network_mode=network_mode(req),
        )
        for chunk in _chunks(stream):
            if "error" in chunk:
                raise BuildError(
                    f"image build failed: {chunk['error'].strip()}",
                    detail="\n".join(tail[-30:]),
                    fix=(
                        "the base image is not local and no registry is reachable: "
                        "docker import one and pass --base-image"
                        if pull
                        else None
                    ),
                )
            text = _ANSI.sub("", chunk.get("stream") or chunk.get("status") or "")
            if "aux" in chunk and "ID" in chunk["aux"]:
                image_id = chunk["aux"]["ID"]
            for line in text.splitlines():
                if line.strip():
                    tail.append(line)
                    log(line)
    except docker.errors.APIError as e:
        raise BuildError(
            f"image build failed: {e.explanation or e}", detail="\n".join(tail[-30:])
        ) from None
    if image_id is None:
        raise BuildError("image build gave no image id", detail="\n".join(tail[-30:]))
    return image_id


def _chunks(stream) -> Iterable[dict]:
    for chunk in stream:
        if isinstance(chunk, dict):
            yield chunk


# Run inside the runtime image (env.sh sourced): the stack's manifest, the venv's distributions and
# the NIXL module kvruntime would load (KVRUNTIME_NIXL_MODULE, else its search order).
INSPECT = r"""
import importlib.metadata as md, importlib.util as iu, json, os
try:
    manifest = json.load(open("/opt/kvstack/manifest.json"))
except (OSError, ValueError):
    manifest = None
names = [os.environ["KVRUNTIME_NIXL_MODULE"]] if os.environ.get("KVRUNTIME_NIXL_MODULE") else \
    ["nixl_cpu", "nixl_xpu", "nixl_cu13", "nixl_cu12", "nixl"]
found = next((n for n in names if iu.find_spec(n)), None)
module = found and {"name": found, "file": iu.find_spec(found).origin}
dists = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in md.distributions()}
print(json.dumps({"manifest": manifest, "nixl_module": module, "dists": dists}))
"""


def inspect(client, image_id: str) -> dict:
    """What the runtime image holds (manifest, distributions, NIXL module), read from inside it."""
    out = client.containers.run(
        image_id,
        ["bash", "-c", 'source /opt/kvstack/env.sh && exec python -c "$0"', INSPECT],
        remove=True,
        network_mode="none",
    )
    try:
        return json.loads(out.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {}


def parts(manifest: dict | None, dists: dict[str, str], nixl_module: dict | None) -> list[dict]:
    """Where each part of the stack in an image came from: built by the installer (its recipe
    source: file, sha256, url; where the install took that build from a binary cache, the directory
    it was built in) or a wheel in the venv (NIXL where no NIXL source was built)."""
    out = []
    recipe = (manifest or {}).get("recipe", {})
    comps = recipe.get("components", {})
    sources = recipe.get("sources", {})
    for name in ("ucx", "nixl"):
        comp = comps.get(name)
        if comp:
            src = sources.get(comp.get("source"), {})
            out.append(
                {
                    "part": name,
                    "from": "source",
                    "source": comp.get("source"),
                    "file": src.get("filename"),
                    "sha256": src.get("sha256"),
                    "url": src.get("url"),
                    "version": _version_of(src.get("filename") or ""),
                    "binary_cache": (manifest.get("binary_cache") or {}).get("built_in"),
                }
            )
        elif name == "nixl" and nixl_module:
            dist = nixl_module["name"].replace("_", "-")
            out.append(
                {
                    "part": name,
                    "from": "wheel",
                    "distribution": dist,
                    "version": dists.get(dist),
                    "module": nixl_module["name"],
                    "file": nixl_module.get("file"),
                }
            )
        else:
            out.append({"part": name, "from": None})
    return out


def _version_of(filename: str) -> str | None:
    m = re.search(r"-(\d+(?:\.\d+)+)", filename)
    return m.group(1) if m else None


def render_parts(res: dict) -> list[str]:
    """One line per part, and the two stages' sizes (what CI's log shows)."""
    lines = []
    for p in res["parts"]:
        if p["from"] == "source":
            lines.append(
                f"{p['part']}: {p['version'] or '?'} built from source {p['source']} "
                f"({p['file']}, sha256 {p['sha256']}, {p['url']})"
                + (
                    f", taken from a binary cache (built in {p['binary_cache']})"
                    if p.get("binary_cache")
                    else ""
                )
            )
        elif p["from"] == "wheel":
            lines.append(
                f"{p['part']}: {p['distribution']} {p['version']} wheel in the image's venv "
                f"(module {p['module']}, not built from source)"
            )
        else:
            lines.append(f"{p['part']}: none in this image")
    mib = 2 ** 20
    lines.append(f"sizes: runtime stage {res['tag']} {res['size'] / mib:.0f} MiB, build stage "
                 f"{res['build_stage']['tag']} {res['build_stage']['size'] / mib:.0f} MiB "
                 f"(base {res['base_size'] / mib:.0f} MiB)")
    return lines
