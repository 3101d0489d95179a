"""Runs a component's steps: each external command with its own log file, in its own process
group under a supervising shell (so Ctrl-C, a kill — of the installer too, even SIGKILL — or
another component's failure stops the whole build tree), and the
log's tail in the error. Components may build side by side (installer/schedule.py): each running
step leaves its own marker, `running-step.<component>.pid`."""
from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

from .buildsys.step import Step
from .errors import BuildError

log = logging.getLogger("kvstack.installer")
TAIL_LINES = 25
PR_SET_PDEATHSIG = 1
RUNNING = "running-step.{component}.pid"
POLL_S = 0.25  # how soon a running step notices that it was asked to stop
# Each step runs under a small shell that leads the step's process group: told the installer is
# gone (PR_SET_PDEATHSIG: SIGTERM, even after a SIGKILL of the installer) or asked to stop, it
# kills the whole group — ninja, sub-makes, compilers, autoreconf's children — not only itself.
SUPERVISOR = ("/bin/sh", "-c", 'trap "kill -KILL 0" TERM HUP INT; "$@" & wait $!', "kvstack-step")


class Stopped(Exception):
    """A step was stopped because the run is ending (another component failed, or Ctrl-C)."""


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_step(step: Step, *, component: str, env: dict[str, str], log_dir: Path,
             actions: dict[str, Callable[..., str | None]], stop: threading.Event | None = None) -> dict:
    log_path = log_dir / f"{component}.{step.name}.log"
    record = {"step": step.name, "phase": step.phase, "log": str(log_path)}
    if step.unless_exists is not None and step.unless_exists.exists():
        record["skipped"] = f"{step.unless_exists.name} exists"
        return record
    start = time.monotonic()
    log_dir.mkdir(parents=True, exist_ok=True)
    if step.action:
        said = actions[step.action](**step.args)
        log_path.write_text(f"[{step.action}] {step.args}\n" + (f"{said}\n" if said else ""))
        if said:
            record["result"] = said
    else:
        record["argv"] = list(step.argv)
        _run(step, component, env, log_path, stop or threading.Event())
    record["seconds"] = round(time.monotonic() - start, 3)
    log.info("    %s %s: %.1fs", component, step.name, record["seconds"])
    return record


def _run(step: Step, component: str, env: dict[str, str], log_path: Path, stop: threading.Event) -> None:
    if step.cwd is not None:
        step.cwd.mkdir(parents=True, exist_ok=True)
    tool = step.argv[0]
    if not (os.sep in tool or shutil.which(tool, path=env.get("PATH"))):
        raise BuildError(f"{component}: `{tool}` is not installed (needed by step {step.name})",
                         fix="install it (see the recipe's system_packages / build_tools) and run again")
    with open(log_path, "w") as logf:
        logf.write(f"$ cd {step.cwd or os.getcwd()}\n$ {' '.join([*(f'{k}={v}' for k, v in step.env.items()), *step.argv])}\n")
        logf.flush()
        proc = subprocess.Popen([*SUPERVISOR, *step.argv], cwd=step.cwd, env={**env, **step.env}, stdout=logf,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_die_with_parent)
        marker = log_path.parent / RUNNING.format(component=component)
        # so a run after a SIGKILL can stop what this one left; whole or absent (renamed into
        # place), never empty: a marker read between its creation and its write named no group
        partial = marker.with_name(f".{marker.name}.partial")
        partial.write_text(f"{proc.pid}\n")
        os.replace(partial, marker)
        try:
            rc = _wait(proc, stop)
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            marker.unlink(missing_ok=True)
    if rc != 0:
        raise BuildError(f"{component}: step {step.name} failed with exit code {rc}: {' '.join(step.argv)[:200]}",
                         log=str(log_path), fix="the tail of the log is above; the previous install is untouched",
                         detail=tail(log_path))


def _wait(proc: subprocess.Popen, stop: threading.Event) -> int:
    while True:
        try:
            return proc.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            if stop.is_set():
                raise Stopped() from None


def stop_leftovers(log_dir: Path) -> list[int]:
    """A SIGKILLed installer could not stop its build steps itself; their supervising shells
    kill their groups as it dies, and this stops whatever of a group still runs (a process that
    left the group keeps running: nothing finds it) before this run reuses the build trees. One
    group per component that was building; returns the ids of those that were still running."""
    stopped = []
    for marker in sorted(log_dir.glob(RUNNING.format(component="*"))):
        try:
            pgid = int(marker.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        finally:
            marker.unlink(missing_ok=True)
        if _stop_group(pgid):
            stopped.append(pgid)
    return stopped


def _stop_group(pgid: int) -> bool:
    try:
        members = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _pgid(p) == pgid]
    except OSError:
        return False
    if not members:
        return False
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    log.warning("stopped %d leftover build processes of an earlier, killed run (process group %d)",
                len(members), pgid)
    return True


def _pgid(proc_dir: Path) -> int | None:
    """The process group of a live process; None for a zombie (dead, only not reaped yet)."""
    try:
        # /proc/PID/stat: "pid (comm) state ppid pgrp ..."; comm may hold spaces, so split after ')'
        fields = proc_dir.joinpath("stat").read_text().rsplit(")", 1)[1].split()
        return None if fields[0] == "Z" else int(fields[2])
    except (OSError, ValueError, IndexError):
        return None


def _libc_prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Looked up here, in the parent: steps start from several threads, and between fork and exec the
# child must do no more than this one call (no dlopen, no imports, no locks another thread held).
_PRCTL = _libc_prctl()


def _die_with_parent() -> None:
    """In the child, before exec: a SIGKILLed installer (no chance to clean up) takes its build
    step down with it: the supervising shell gets SIGTERM and kills the step's process group
    (Linux PR_SET_PDEATHSIG; it fires when the thread that started the step ends, and that thread
    waits for the step)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)


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
