"""Runs a component's steps: each external command with its own log file, in its own process
session under a supervising shell (so Ctrl-C, a kill — of the installer too, even SIGKILL — or
another component's failure stops the whole build tree, every process group of it), and the
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
# Each step runs under a small shell that leads the step's session: told the installer is gone
# (PR_SET_PDEATHSIG: SIGTERM, even after a SIGKILL of the installer) or asked to stop, it kills
# every process of its session — ninja, sub-makes, compilers, autoreconf's children — not only its
# process group: ninja starts each compile job in a process group of its own, and an orphaned
# job stays in the session (its id in /proc/PID/stat) though its parent is gone. Passes repeat
# until a pass finds none alive (a process forked during one is killed by the next), at most 100.
_KILL_SESSION = r"""
kill_session() {
  # its output may be a pipe to the dead installer: a message there (a process that ended
  # between the glob and the read) would end this shell by SIGPIPE half way through the session
  trap '' PIPE
  exec >/dev/null 2>&1
  n=0
  while [ $n -lt 100 ]; do
    n=$((n + 1)); found=
    for f in /proc/[0-9]*/stat; do
      pid=${f#/proc/}; pid=${pid%/stat}
      [ "$pid" = $$ ] && continue
      read -r line 2>/dev/null < "$f" || continue
      set -- ${line##*) }
      if [ "$4" = $$ ] && [ "$1" != Z ]; then kill -KILL "$pid" 2>/dev/null; found=1; fi
    done
    [ -z "$found" ] && break
  done
  exit 137
}
trap kill_session TERM HUP INT
"$@" & wait $!
"""
SUPERVISOR = ("/bin/sh", "-c", _KILL_SESSION, "kvstack-step")


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


def run_step(
    step: Step,
    *,
    component: str,
    env: dict[str, str],
    log_dir: Path,
    actions: dict[str, Callable[..., str | None]],
    stop: threading.Event | None = None,
) -> dict:
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


def _run(
    step: Step, component: str, env: dict[str, str], log_path: Path, stop: threading.Event
) -> None:
    if step.cwd is not None:
        step.cwd.mkdir(parents=True, exist_ok=True)
    tool = step.argv[0]
    if not (os.sep in tool or shutil.which(tool, path=env.get("PATH"))):
        raise BuildError(
            f"{component}: `{tool}` is not installed (needed by step {step.name})",
            fix="install it (see the recipe's system_packages / build_tools) and run again",
        )
    with open(log_path, "w") as logf:
        logf.write(
            f"$ cd {step.cwd or os.getcwd()}\n$ "
            f"{' '.join([*(f'{k}={v}' for k, v in step.env.items()), *step.argv])}\n"
        )
        logf.flush()
        proc = subprocess.Popen(
            [*SUPERVISOR, *step.argv],
            cwd=step.cwd,
            env={**env, **step.env},
            stdout=logf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        marker = log_path.parent / RUNNING.format(component=component)
        # so a run after a SIGKILL can stop what this one left; whole or absent (renamed into
        # place), never empty: a marker read between its creation and its write named no group
        partial = marker.with_name(f".{marker.name}.partial")
        partial.write_text(f"{proc.pid}\n")
        os.replace(partial, marker)
        try:
            rc = _wait(proc, stop)
        except BaseException:
            _stop_step(proc)
            raise
        finally:
            marker.unlink(missing_ok=True)
    if rc != 0:
        raise BuildError(
            f"{component}: step {step.name} failed with exit code {rc}: "
            f"{' '.join(step.argv)[:200]}",
            log=str(log_path),
            fix="the tail of the log is above; the previous install is untouched",
            detail=tail(log_path),
        )


def run_supervised(cmd: list[str], env: dict[str, str],
                   timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, timeout=...) under the supervising
    shell, in a session of its own: a timeout, a Ctrl-C or the installer's death (even SIGKILL)
    kills every process it started (verification's selftests start peers of their own)."""
    proc = start_supervised(cmd, env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        stop_supervised(proc)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def start_supervised(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    """run_supervised's process, left running (its output read with communicate()): for a
    command that runs beside others, stopped by stop_supervised. Start it from a thread that
    outlives it (PR_SET_PDEATHSIG fires when the starting thread ends)."""
    return subprocess.Popen([*SUPERVISOR, *cmd], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            start_new_session=True, preexec_fn=_die_with_parent)


def stop_supervised(proc: subprocess.Popen) -> None:
    """Kill a supervised command's whole session and reap it."""
    _stop_step(proc)
    proc.communicate()


def _wait(proc: subprocess.Popen, stop: threading.Event) -> int:
    while True:
        try:
            return proc.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            if stop.is_set():
                raise Stopped() from None


def stop_leftovers(log_dir: Path) -> list[int]:
    """A SIGKILLed installer could not stop its build steps itself; their supervising shells
    kill their sessions as it dies, and this stops whatever of a session still runs (the shell
    itself may have been killed first, leaving its orphans) before this run reuses the build
    trees. One session per component that was building; returns the ids of those that were still
    running."""
    stopped = []
    for marker in sorted(log_dir.glob(RUNNING.format(component="*"))):
        try:
            sid = int(marker.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        finally:
            marker.unlink(missing_ok=True)
        killed = kill_session(sid)
        if killed:
            log.warning("stopped %d leftover build processes of an earlier, killed run "
                        "(session %d)", killed, sid)
            stopped.append(sid)
    return stopped


def kill_session(sid: int, passes: int = 100) -> int:
    """SIGKILL every live process of session `sid` (a step's, whatever process group each is in),
    pass after pass until one finds none; how many were killed."""
    killed = 0
    for _ in range(passes):
        members = session_members(sid)
        if not members:
            break
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
    return killed


def session_members(sid: int) -> list[int]:
    """The live processes (no zombies: dead, only not reaped yet) of session `sid`."""
    try:
        procs = [p for p in Path("/proc").iterdir() if p.name.isdigit()]
    except OSError:
        return []
    return [int(p.name) for p in procs if int(p.name) != os.getpid() and _session(p) == sid]


def _session(proc_dir: Path) -> int | None:
    """The session of a live process; None for a zombie."""
    try:
        # /proc/PID/stat: "pid (comm) state ppid pgrp session ..."; comm may hold spaces
        fields = proc_dir.joinpath("stat").read_text().rsplit(")", 1)[1].split()
        return None if fields[0] == "Z" else int(fields[3])
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
    step down with it: the supervising shell gets SIGTERM and kills the step's session
    (Linux PR_SET_PDEATHSIG; it fires when the thread that started the step ends, and that thread
    waits for the step)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)


def _stop_step(proc: subprocess.Popen) -> None:
    """Stop a step: its supervising shell kills its session; whatever of the session is left
    (the shell gone first, or slow to act) is killed from here, then the shell is reaped."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=5)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    kill_session(proc.pid)
    proc.wait()
