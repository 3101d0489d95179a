"""`python -m installer mirror DIR`: fill a directory with every pinned source of the chosen
platforms, so an air-gapped host can install with --mirror DIR. Archives keep their recipe
filename, git sources become bare repositories `<name>.git` holding the pinned commit, and
SHA256SUMS lists the archives. Every file is checked against its pin on the way in, and the
installer checks it again on the way out."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

from .cache import sha256_file
from .errors import RecipeError
from .recipe import Recipe
from .sources import Fetcher

log = logging.getLogger("kvstack.installer")


def fill(dest: Path, recipes: list[Recipe], fetcher: Fetcher) -> list[dict]:
    dest.mkdir(parents=True, exist_ok=True)
    pins: dict[str, str] = {}
    records = []
    for recipe in recipes:
        for name, src in recipe.sources.items():
            key = src.get("filename", f"{name}.git")
            pin = src.get("sha256") or src["commit"]
            if pins.get(key, pin) != pin:
                raise RecipeError(
                    f"two recipes pin {key} differently ({pins[key]} and {pin})",
                    fix="a mirror holds one file per name: give one of them another filename",
                )
            if key in pins:
                continue
            pins[key] = pin
            fetched = fetcher.fetch(name, src)
            fetcher.check(fetched, src)
            if fetched.kind == "git":
                _push_commit(fetched.path, dest / key, src)
            else:
                _place(fetched.path, dest / key, src["sha256"])
            records.append({"name": name, "file": key, "pin": pin})
            log.info("mirror: %s", key)
    sums = sorted((r["file"], r["pin"]) for r in records if not r["file"].endswith(".git"))
    existing = _read_sums(dest / "SHA256SUMS")
    existing.update(dict(sums))
    (dest / "SHA256SUMS").write_text("".join(f"{h}  {f}\n" for f, h in sorted(existing.items())))
    return records


def fill_wheels(dest: Path, requirements: list[str], python: str, log_path: Path) -> None:
    """The build tools' wheels for this host's Python, for `pip --no-index --find-links`."""
    if not requirements:
        return
    wheels = dest / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [
        python,
        "-m",
        "pip",
        "download",
        "--disable-pip-version-check",
        "--quiet",
        "--only-binary=:all:",
        "-d",
        str(wheels),
        *requirements,
    ]
    with open(log_path, "w") as logf:
        rc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT).returncode
    if rc:
        from .errors import DownloadError

        raise DownloadError(
            f"pip download of {' '.join(requirements)} failed (exit {rc})", log=str(log_path)
        )
    log.info("mirror: wheels for %s", ", ".join(requirements))


def _place(src: Path, dest: Path, sha256: str) -> None:
    if dest.is_file() and sha256_file(dest) == sha256:
        return
    tmp = dest.with_name(dest.name + ".part")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dest)


def _push_commit(cache_repo: Path, dest: Path, src: dict) -> None:
    if not dest.exists():
        subprocess.run(["git", "init", "--quiet", "--bare", str(dest)], check=True)
        # the cache holds shallow (depth 1) fetches; the mirror must accept them as they are
        subprocess.run(
            ["git", "--git-dir", str(dest), "config", "receive.shallowUpdate", "true"], check=True
        )
    ref = f"refs/tags/{src['tag']}" if "tag" in src else f"refs/kvstack/{src['commit']}"
    subprocess.run(["git", "--git-dir", str(cache_repo), "push", "--quiet", "--force", str(dest),
                    f"{src['commit']}:{ref}"], check=True, capture_output=True)


def _read_sums(path: Path) -> dict[str, str]:
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            out[parts[1]] = parts[0]
    return out
