"""pypa's auditwheel, as `python -m installer wheel` uses it: `auditwheel repair` grafts every
library the wheel's files need from outside it (under SONAMEs made from each file's content:
libucp-<8 hex>.so.0), points their NEEDED entries and RUNPATHs inside the wheel, checks the result
against the manylinux policies and tags the wheel with the best one that fits (`--plat auto`).

It runs after the build, on its files, so it is not a build input: no build id depends on it.
Its command line is the interface used (its Python API is internal and changes between minor
versions); REQUIREMENT is the range whose command line this was written against."""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

from .errors import PrefixError, SystemPackagesError

REQUIREMENT = "auditwheel>=6.4,<7"
_LOWEST, _BEYOND = (6, 4), (7,)
SOURCE_DATE = 315532800  # 1980-01-01, zip's earliest date


def _in_range(version: str) -> bool:
    release = tuple(int(p) for p in version.split(".")[:3] if p.isdigit())
    return _LOWEST <= release < _BEYOND


def check_installed() -> str:
    """auditwheel's version, or one line saying how to get it."""
    try:
        found = importlib.metadata.version("auditwheel")
    except importlib.metadata.PackageNotFoundError:
        found = None
    if found is None or not _in_range(found):
        what = f"auditwheel {found} is installed" if found else "auditwheel is not installed"
        raise SystemPackagesError(
            f"making a wheel needs {REQUIREMENT} ({what} for {sys.executable})",
            fix=f"{sys.executable} -m pip install '{REQUIREMENT}' (pip install -e '.[installer]' "
            "has it)",
        )
    return found


def repair(
    wheel: Path, out: Path, exclude: list[str], library_path: list[Path], patchelf: str
) -> Path:
    """`auditwheel repair` of wheel into out (empty); returns the repaired wheel. exclude: SONAMEs
    left to the host or to another wheel (the accelerator's driver, the CUDA runtime);
    library_path: where auditwheel looks for what the files need before the system's directories
    (after each file's RUNPATH)."""
    # absolute: auditwheel works in a folder of its own, where relative paths name nothing
    wheel, out, library_path = wheel.resolve(), out.resolve(), [p.resolve() for p in library_path]
    cmd = [
        sys.executable,
        "-m",
        "auditwheel",
        "repair",
        "--plat",
        "auto",
        "-w",
        str(out),
        str(wheel),
    ]
    for soname in exclude:
        cmd[4:4] = ["--exclude", soname]
    # auditwheel runs patchelf by name: the one the build checked comes first
    env = {
        **os.environ,
        "PATH": os.pathsep.join([os.path.dirname(patchelf), os.environ.get("PATH", os.defpath)]),
        "SOURCE_DATE_EPOCH": str(SOURCE_DATE),
        "AUDITWHEEL_LD_LIBRARY_PATH": os.pathsep.join(map(str, library_path)),
    }  # zip dates: the same files give the same wheel bytes
    r = subprocess.run(
        cmd, capture_output=True, text=True, env=env, umask=0o022
    )  # the directories' modes go into the zip
    made = sorted(out.glob("*.whl"))
    if r.returncode != 0 or len(made) != 1:
        said = [line for line in (r.stderr + r.stdout).splitlines() if line.strip()]
        raise PrefixError(
            f"auditwheel repair refused the wheel (exit {r.returncode}): "
            f"{said[-1] if said else 'no output'}",
            fix="see auditwheel's message; a too-recent symbol means building on an older "
            "distribution",
        )
    return made[0]
