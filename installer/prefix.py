"""The prefix: `P` is a symbolic link to `P.builds/<build id>/`, switched by one rename once a
build passed verification; the previous build stays until then (and one more time after, for a
rollback). A lock beside the prefix serializes installers."""
from __future__ import annotations

import json
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import filelock

from .errors import HostError, PrefixError

COMPLETE = "manifest.json"


def check_placeable(prefix: Path) -> None:
    """Before anything is built: the prefix can become a link to a build. Its parent is (or can be
    made) a writable directory where a link can be made, beside room for P.builds; the prefix
    itself is absent, one of our links, or an empty directory that is not a mount point (the
    switch replaces it by the link, which a mount point refuses with EBUSY after the build)."""
    for p in [prefix, *prefix.parents]:
        if p.exists() or p.is_symlink():
            if p != prefix and not p.is_dir():
                raise PrefixError(f"--prefix {prefix}: {p} is a file, not a directory",
                                  fix="choose a --prefix whose parent directories are directories")
            break
    try:
        prefix.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise HostError.from_oserror(e, f"--prefix {prefix}: cannot make {prefix.parent}") from None
    if prefix.is_symlink():
        if not made_by_us(prefix):
            raise PrefixError(
                f"--prefix {prefix} is a symbolic link to {os.readlink(prefix)}, "
                f"which is not one of kvstack's builds ({prefix.name}.builds/<build id>)",
                fix="choose another --prefix, or remove that link if it is not needed",
            )
    elif prefix.is_dir() and is_mount_point(prefix):
        raise PrefixError(
            f"--prefix {prefix} is a mount point: the prefix becomes a link to its build, and a "
            "mount point cannot be replaced by one",
            fix=f"give a path inside it, e.g. --prefix {prefix / 'kvstack'}",
        )
    current(prefix)  # a file or a directory with something in it is refused here
    probe = prefix.parent / f".{prefix.name}.probe-{os.getpid()}"
    try:
        probe.unlink(missing_ok=True)
        os.symlink(f"{prefix.name}.builds", probe)
        probe.unlink()
        (prefix.parent / f"{prefix.name}.builds").mkdir(exist_ok=True)
    except OSError as e:
        raise HostError.from_oserror(
            e, f"--prefix {prefix}: cannot make its link or builds in {prefix.parent}"
        ) from None


def made_by_us(link: Path) -> bool:
    """A link kvstack's switch made: it points to `<name>.builds/<id>` beside it (relative, as
    switch writes it, or the same place absolute), whether or not that build still exists."""
    target = Path(os.readlink(link))
    builds = (link.parent / f"{link.name}.builds").absolute()
    where = Path(os.path.normpath(link.parent.absolute() / target))  # an absolute target wins
    return where.parent == builds and where.name not in ("", ".", "..")


def is_mount_point(path: Path, mountinfo: Path = Path("/proc/self/mountinfo")) -> bool:
    """A mount point by its device (another file system than its parent's) or by the mount table:
    a bind mount of the same file system has its parent's st_dev, and os.path.ismount misses it."""
    if os.path.ismount(path):
        return True
    real = os.path.realpath(path)
    try:
        if os.stat(real).st_dev != os.stat(os.path.dirname(real)).st_dev:
            return True
        lines = os.fsdecode(mountinfo.read_bytes()).splitlines()
    except OSError:
        return False
    # mountinfo: "id parent major:minor root MOUNT_POINT options ..."; spaces etc. octal-escaped
    return any(len(f) > 4 and _unescape(f[4]) == real for f in (line.split() for line in lines))


def _unescape(field: str) -> str:
    raw = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), os.fsencode(field))
    return os.fsdecode(raw)


def drop_stale(prefix: Path) -> list[Path]:
    """What a killed run left beside the prefix: its half-made switch link, a binary cache entry
    half-extracted or half-downloaded. Called with the prefix locked, so none is another run's."""
    found = [*prefix.parent.glob(f".{prefix.name}.switch-*"),
             *(prefix.parent / f"{prefix.name}.builds").glob(".*.incoming-*"),
             *(prefix.parent / f"{prefix.name}.builds").glob(".*.download-*")]
    for p in found:
        if p.is_symlink() or not p.is_dir():
            p.unlink(missing_ok=True)
        else:
            shutil.rmtree(p, ignore_errors=True)
    return found


def lock_path(prefix: Path) -> Path:
    return prefix.parent / f".{prefix.name}.lock"


@contextmanager
def locked(prefix: Path) -> Iterator[None]:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(str(lock_path(prefix)))
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        raise PrefixError(
            f"another installer is working on {prefix} (lock {lock_path(prefix)})",
            fix="wait for it to finish; if none runs, the lock frees itself",
        ) from None
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
        raise PrefixError(
            f"{prefix} exists and is not a kvstack prefix (not a symbolic link to a build)",
            fix="choose another --prefix, or move that directory away",
        )
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
