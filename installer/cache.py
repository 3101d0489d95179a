"""A content-addressed download cache: files live under sha256/<first two>/<hash>, so a hit is
found by the pin alone and re-hashed before every reuse (a corrupted entry is dropped, not
trusted). The directory carries CACHEDIR.TAG and one file lock for writers."""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import filelock

CACHEDIR_TAG = ("Signature: 8a477f597d28d172789f06886806bc55\n"
                "# This file is a cache directory tag created by kvstack.\n"
                "# For information about cache directory tags see https://bford.info/cachedir/\n")
CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


class Cache:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        tag = self.root / "CACHEDIR.TAG"
        if not tag.exists():
            tag.write_text(CACHEDIR_TAG)
        (self.root / "tmp").mkdir(exist_ok=True)

    def path_for(self, sha256: str) -> Path:
        return self.root / "sha256" / sha256[:2] / sha256

    @contextmanager
    def locked(self, timeout: float = 600) -> Iterator[None]:
        with filelock.FileLock(str(self.root / ".lock"), timeout=timeout):
            yield

    def get(self, sha256: str) -> Path | None:
        """The cached file with this hash, re-hashed now; None when absent or corrupted."""
        path = self.path_for(sha256)
        if not path.is_file():
            return None
        if sha256_file(path) != sha256:
            path.unlink()
            return None
        return path

    def temp_file(self, suffix: str = ".part") -> Path:
        fd, name = tempfile.mkstemp(dir=self.root / "tmp", suffix=suffix)
        os.close(fd)
        return Path(name)

    def drop_partial(self) -> list[Path]:
        """Downloads a killed run left half-written (tmp/*.part, git/*.git.part). Call with the
        cache locked: every download happens under that lock, so none of these is in progress."""
        found = [*(self.root / "tmp").glob("*.part"), *(self.root / "git").glob("*.part")]
        for p in found:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        return found

    def put(self, tmp: Path, sha256: str) -> Path:
        """Move a verified temporary file into place (atomic rename on one filesystem)."""
        dest = self.path_for(sha256)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, dest)
        return dest

    def git_dir(self, url: str) -> Path:
        return self.root / "git" / (hashlib.sha256(url.encode()).hexdigest()[:24] + ".git")
