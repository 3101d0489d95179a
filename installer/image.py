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
CONTAINERFILE = "Containerfile"
MIRROR_DIR = "_work/image-mirror"  # inside the build context; the Containerfile copies it when present
CA_FILE = "_work/image-ca.crt"
_TAG_RE = re.compile(r"^[a-z0-9]+(?:[._/:@-][a-zA-Z0-9._-]+)*$")


@dataclass
class ImageRequest:
    platform: str
    tag: str
    base_image: str
    mirror: Path | None = None
    ca_bundle: Path | None = None
    extra_args: dict[str, str] = field(default_factory=dict)


def request(platform: str, tag: str | None = None, base_image: str | None = None,
            mirror: str | None = None, ca_bundle: str | None = None) -> ImageRequest:
    """Check the options; every bad one is one clear line saying which option to fix."""
    if platform not in BASE_IMAGES:
        raise UsageError(f"no base image for platform {platform!r}",
                         fix=f"use --platform {'|'.join(PLATFORMS)}, or name one with --base-image")
    tag = tag or f"kvstack:{platform}"
    if not _TAG_RE.match(tag) or len(tag) > 255:
        raise UsageError(f"bad image tag {tag!r}", fix="use --tag NAME[:TAG] (lowercase name)")
    base = base_image or BASE_IMAGES[platform]
    if not _TAG_RE.match(base.lower()) or len(base) > 512:
        raise UsageError(f"bad base image reference {base!r}", fix="use --base-image NAME[:TAG][@sha256:...]")
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
    return ImageRequest(platform, tag, base, m, ca)


def build_args(req: ImageRequest) -> dict[str, str]:
    """The Containerfile's ARGs for this request (the mapping unit tests check)."""
    args = {"PLATFORM": req.platform, "BASE_IMAGE": req.base_image,
            "WITH_MIRROR": "1" if req.mirror else "0", "WITH_CA": "1" if req.ca_bundle else "0"}
    args.update(req.extra_args)
    return args


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
        raise HostError(f"no container daemon reachable ({type(e).__name__})",
                        fix="start dockerd or podman's API service and set DOCKER_HOST "
                            "(e.g. unix:///run/docker.sock or unix:///run/podman/podman.sock)") from None
    return client


def base_is_local(client, ref: str) -> bool:
    import docker.errors  # noqa: PLC0415
    try:
        client.images.get(ref)
        return True
    except docker.errors.ImageNotFound:
        return False


def stage_context(req: ImageRequest, checkout: Path) -> None:
    """Copy the optional mirror and CA bundle to where the Containerfile looks for them."""
    import shutil  # noqa: PLC0415
    mdir, ca = checkout / MIRROR_DIR, checkout / CA_FILE
    shutil.rmtree(mdir, ignore_errors=True)
    mdir.mkdir(parents=True)
    if req.mirror:
        shutil.copytree(req.mirror, mdir, dirs_exist_ok=True)
    ca.write_text(req.ca_bundle.read_text() if req.ca_bundle else "")


def build(client, req: ImageRequest, checkout: Path, log: Callable[[str], None]) -> dict:
    """Build through the low-level API so the log streams; intermediate containers are removed
    even on failure (rm + forcerm); the base is pulled only when it is not local."""
    import docker.errors  # noqa: PLC0415
    pull = not base_is_local(client, req.base_image)
    stage_context(req, checkout)
    tail: list[str] = []
    image_id = None
    try:
        stream = client.api.build(path=str(checkout), dockerfile=CONTAINERFILE, tag=req.tag,
                                  buildargs=build_args(req), rm=True, forcerm=True, pull=False,
                                  decode=True, network_mode="host")
        for chunk in _chunks(stream):
            if "error" in chunk:
                raise BuildError(f"image build failed: {chunk['error'].strip()}", detail="\n".join(tail[-30:]),
                                 fix=("the base image is not local and no registry is reachable: "
                                      "docker import one and pass --base-image" if pull else None))
            text = chunk.get("stream") or chunk.get("status") or ""
            if "aux" in chunk and "ID" in chunk["aux"]:
                image_id = chunk["aux"]["ID"]
            for line in text.splitlines():
                if line.strip():
                    tail.append(line)
                    log(line)
    except docker.errors.APIError as e:
        raise BuildError(f"image build failed: {e.explanation or e}", detail="\n".join(tail[-30:])) from None
    if image_id is None:
        raise BuildError("image build gave no image id", detail="\n".join(tail[-30:]))
    img = client.images.get(image_id)
    manifest = _manifest(client, image_id)
    return {"id": image_id, "tag": req.tag, "size": img.attrs.get("Size"), "manifest": manifest}


def _chunks(stream) -> Iterable[dict]:
    for chunk in stream:
        if isinstance(chunk, dict):
            yield chunk


def _manifest(client, image_id: str) -> dict | None:
    """The stack's manifest.json from inside the image (the prefix link's target)."""
    out = client.containers.run(image_id, ["sh", "-c", "cat /opt/kvstack/manifest.json"], remove=True,
                                network_mode="none")
    try:
        return json.loads(out)
    except ValueError:
        return None
