"""Runs a component's steps: each external command with its own log file, in its own process
group (so Ctrl-C or a kill stops the whole build tree), and the log's tail in the error."""
from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

from .buildsys.step import Step
from .errors import BuildError

log = logging.getLogger("kvstack.installer")
TAIL_LINES = 25
PR_SET_PDEATHSIG = 1
RUNNING = "running-step.pid"


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_step(step: Step, *, component: str, env: dict[str, str], log_dir: Path,
             actions: dict[str, Callable[..., None]]) -> dict:
    log_path = log_dir / f"{component}.{step.name}.log"
    record = {"step": step.name, "phase": step.phase, "log": str(log_path)}
    if step.unless_exists is not None and step.unless_exists.exists():
        record["skipped"] = f"{step.unless_exists.name} exists"
        return record
    start = time.monotonic()
    log_dir.mkdir(parents=True, exist_ok=True)
    if step.action:
        actions[step.action](**step.args)
        log_path.write_text(f"[{step.action}] {step.args}\n")
    else:
        record["argv"] = list(step.argv)
        _run(step, component, env, log_path)
    record["seconds"] = round(time.monotonic() - start, 3)
    log.info("    %s %s: %.1fs", component, step.name, record["seconds"])
    return record


def _run(step: Step, component: str, env: dict[str, str], log_path: Path) -> None:
    if step.cwd is not None:
        step.cwd.mkdir(parents=True, exist_ok=True)
    tool = step.argv[0]
    if not (os.sep in tool or shutil.which(tool, path=env.get("PATH"))):
        raise BuildError(f"{component}: `{tool}` is not installed (needed by step {step.name})",
                         fix="install it (see the recipe's system_packages / build_tools) and run again")
    with open(log_path, "w") as logf:
        logf.write(f"$ cd {step.cwd or os.getcwd()}\n$ {' '.join(step.argv)}\n")
        logf.flush()
        proc = subprocess.Popen(step.argv, cwd=step.cwd, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)
        marker = log_path.parent / RUNNING
        marker.write_text(f"{proc.pid}\n")  # so a run after a SIGKILL can stop what this one left
        try:
            rc = proc.wait()
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            marker.unlink(missing_ok=True)
    if rc != 0:
        raise BuildError(f"{component}: step {step.name} failed with exit code {rc}: {' '.join(step.argv)[:200]}",
                         log=str(log_path), fix="the tail of the log is above; the previous install is untouched",
                         detail=tail(log_path))


def stop_leftovers(log_dir: Path) -> int | None:
    """A SIGKILLed installer could not stop its build step: make or ninja die with it
    (PR_SET_PDEATHSIG), but compilers they started may still run and write into the build tree
    this run is about to reuse. Stop that process group; return its id if one was running."""
    marker = log_dir / RUNNING
    try:
        pgid = int(marker.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    marker.unlink(missing_ok=True)
    try:
        members = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _pgid(p) == pgid]
    except OSError:
        return None
    if not members:
        return None
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return None
    log.warning("stopped %d leftover build processes of an earlier, killed run (process group %d)",
                len(members), pgid)
    return pgid


def _pgid(proc_dir: Path) -> int | None:
    try:
        # /proc/PID/stat: "pid (comm) state ppid pgrp ..."; comm may hold spaces, so split after ')'
        return int(proc_dir.joinpath("stat").read_text().rsplit(")", 1)[1].split()[2])
    except (OSError, ValueError, IndexError):
        return None


def _die_with_parent() -> None:
    """In the child, before exec: a SIGKILLed installer (no chance to clean up) takes its build
    step down with it instead of leaving make or ninja running (Linux PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue
