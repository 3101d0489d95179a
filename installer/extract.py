"""The extract phase: a checked archive (or a pinned git commit) into a fresh source directory,
top-level directory stripped, nothing written outside it."""
from __future__ import annotations

import errno
import shutil
import subprocess
import tarfile
from pathlib import Path

from .errors import BuildError
from .sources import Fetched


def extract_safely(tf: tarfile.TarFile, members: list[tarfile.TarInfo], dest: Path) -> None:
    """No absolute or escaping names or link targets, no devices or fifos: checked here for every
    Python, then tarfile's "data" filter where this Python has it (3.11.4+; Debian 12's own
    python3, 3.11.2, has not)."""
    root = dest.resolve()
    for m in members:
        target = (root / m.name).resolve()
        if m.name.startswith("/") or not (target == root or root in target.parents):
            raise tarfile.TarError(
                f"member {m.name!r} would land outside the directory it is extracted into"
            )
        if m.isdev() or m.isfifo():
            raise tarfile.TarError(f"member {m.name!r} is a device or fifo")
        if m.issym() or m.islnk():
            base = target.parent if m.issym() else root
            link = (base / m.linkname).resolve()
            if m.linkname.startswith("/") or not (link == root or root in link.parents):
                raise tarfile.TarError(
                    f"link {m.name!r} -> {m.linkname!r} points outside the directory it is "
                    "extracted into"
                )
    if hasattr(tarfile, "data_filter"):
        tf.extractall(dest, filter="data")
    else:
        tf.extractall(dest)  # noqa: S202 - members checked above


def extract(fetched: Fetched, dest: Path) -> Path:
    tmp = dest.with_name(dest.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.mkdir(parents=True)
    if fetched.kind == "git":
        archive = subprocess.run(
            ["git", "--git-dir", str(fetched.path), "archive", "--format=tar", fetched.commit],
            capture_output=True,
            check=False,
        )
        if archive.returncode:
            raise BuildError(
                f"{fetched.name}: git archive {fetched.commit} failed: "
                f"{archive.stderr.decode()[-300:]}"
            )
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive.stdout, check=True)
        tmp.rename(dest)
        return dest
    try:
        with tarfile.open(fetched.path, "r:*") as tf:
            members = tf.getmembers()
            tops = {m.name.split("/", 1)[0] for m in members if m.name not in ("", ".")}
            extract_safely(tf, members, tmp)
    except (tarfile.TarError, OSError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise  # the host's, not the archive's: the install says so (no space left)
        raise BuildError(f"{fetched.name}: cannot extract {fetched.path}: {e}",
                         fix="delete the cached file and run again") from None
    root = tmp / next(iter(tops)) if len(tops) == 1 and (tmp / next(iter(tops))).is_dir() else tmp
    if root == tmp:
        tmp.rename(dest)
    else:
        root.rename(dest)
        shutil.rmtree(tmp)
    return dest
