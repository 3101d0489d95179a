"""The prefix: `P` is a symbolic link to `P.builds/<build id>/`, switched by one rename once a
build passed verification; the previous build stays until then (and one more time after, for a
rollback). A lock beside the prefix serializes installers."""
from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import filelock

from .errors import PrefixError

COMPLETE = "manifest.json"


def lock_path(prefix: Path) -> Path:
    return prefix.parent / f".{prefix.name}.lock"


@contextmanager
def locked(prefix: Path) -> Iterator[None]:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(str(lock_path(prefix)))
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        raise PrefixError(f"another installer is working on {prefix} (lock {lock_path(prefix)})",
                          fix="wait for it to finish; if none runs, the lock frees itself") from None
    try:
        yield
    finally:
        lock.release()


def current(prefix: Path) -> Path | None:
    """The build directory the prefix points to now, if it is one of ours."""
    if prefix.is_symlink():
        return (prefix.parent / os.readlink(prefix)).resolve()
    if prefix.exists():
        if prefix.is_dir() and not any(prefix.iterdir()):
            return None
        raise PrefixError(f"{prefix} exists and is not a kvstack prefix (not a symbolic link to a build)",
                          fix="choose another --prefix, or move that directory away")
    return None


def is_complete(build_dir: Path) -> bool:
    try:
        return json.loads((build_dir / COMPLETE).read_text()).get("complete") is True
    except (OSError, ValueError):
        return False


def switch(prefix: Path, build_dir: Path) -> Path | None:
    """Point prefix at build_dir atomically; return the build it pointed to before."""
    previous = current(prefix)
    if prefix.is_dir() and not prefix.is_symlink():
        prefix.rmdir()  # empty (current() refused anything else)
    tmp = prefix.parent / f".{prefix.name}.switch-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(os.path.relpath(build_dir, prefix.parent), tmp)
    os.replace(tmp, prefix)
    return previous


def prune(prefix: Path, keep: list[Path]) -> list[Path]:
    """Remove finished builds other than `keep`; unfinished ones of other runs are left alone."""
    builds = prefix.parent / f"{prefix.name}.builds"
    removed = []
    keep_resolved = {k.resolve() for k in keep if k}
    for d in builds.iterdir() if builds.is_dir() else []:
        if d.resolve() not in keep_resolved and is_complete(d):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed
