"""A stopped or killed build step takes every process of it down, also those in process groups of
their own (as ninja starts each compile job) and their orphans; and the next run's leftover sweep
finds what a killed run's supervisor could not stop. Real processes: a step that forks a job into
a process group of its own, which forks one more process, all sleeping until killed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from installer.buildsys.step import Step
from installer.runner import RUNNING, Stopped, run_step, stop_leftovers

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[3]
ENV = {"PATH": "/usr/bin:/bin"}
# argv[1]: where the job writes "JOB GRANDCHILD" once both run
NINJA_LIKE = """
import os, sys, time
out = sys.argv[1]
if os.fork() == 0:
    os.setpgid(0, 0)  # a process group of its own, as ninja gives each job
    child = os.fork()
    if child == 0:
        time.sleep(3600)
        os._exit(0)
    with open(out + ".part", "w") as f:
        f.write(f"{os.getpid()} {child}\\n")
    os.rename(out + ".part", out)
    time.sleep(3600)
    os._exit(0)
time.sleep(3600)
"""
WAIT_S = 120  # how long a process may take to appear or to die on a busy host before this fails


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _job_pids(out: Path) -> list[int]:
    deadline = time.monotonic() + WAIT_S
    while not out.exists():
        assert time.monotonic() < deadline, f"the step's job never wrote {out}"
        time.sleep(0.05)
    pids = [int(x) for x in out.read_text().split()]
    assert all(_alive(p) for p in pids)
    assert os.getpgid(pids[0]) not in (os.getpgid(0), os.getsid(pids[0]))  # left the step's group
    return pids


def _still_alive(pids: list[int]) -> list[int]:
    deadline = time.monotonic() + WAIT_S
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in pids if _alive(p)]
    for p in left:  # leave nothing behind, whatever the outcome
        os.kill(p, signal.SIGKILL)
    return left


def _step(tmp_path: Path) -> tuple[Step, Path]:
    out = tmp_path / "job-pids"
    return Step("build", "build", (sys.executable, "-c", NINJA_LIKE, str(out)), cwd=tmp_path), out


def test_a_stopped_step_kills_its_jobs_in_other_process_groups(tmp_path):
    step, out = _step(tmp_path)
    stop, raised = threading.Event(), []

    def build():
        try:
            run_step(step, component="ucx", env=ENV, log_dir=tmp_path / "logs", actions={},
                     stop=stop)
        except BaseException as e:  # noqa: BLE001 (recorded for the assertion below)
            raised.append(e)
    t = threading.Thread(target=build)
    t.start()
    pids = _job_pids(out)
    stop.set()
    t.join()
    assert len(raised) == 1 and isinstance(raised[0], Stopped)
    assert _still_alive(pids) == []


def test_a_sigkilled_installer_takes_its_steps_jobs_down(tmp_path):
    step, out = _step(tmp_path)
    code = ("import sys; from pathlib import Path; from installer.buildsys.step import Step; "
            "from installer.runner import run_step; "
            f"run_step(Step('build', 'build', {step.argv!r}, cwd=Path({str(tmp_path)!r})), "
            f"component='ucx', env={ENV!r}, log_dir=Path({str(tmp_path / 'logs')!r}), "
            "actions={})")
    installer = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    pids = _job_pids(out)
    installer.kill()
    installer.wait()
    assert _still_alive(pids) == []


def test_the_next_runs_sweep_finds_jobs_whose_supervisor_died_first(tmp_path):
    """The step's session leader is SIGKILLed before it could act (as the OOM killer might):
    its job, in a process group of its own, and the job's child are still running."""
    out = tmp_path / "job-pids"
    leader = subprocess.Popen([sys.executable, "-c", NINJA_LIKE, str(out)], start_new_session=True)
    pids = _job_pids(out)
    leader.kill()
    leader.wait()
    assert all(_alive(p) for p in pids) and {os.getsid(p) for p in pids} == {leader.pid}
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / RUNNING.format(component="ucx")).write_text(f"{leader.pid}\n")
    assert stop_leftovers(logs) == [leader.pid]
    assert _still_alive(pids) == []
    assert not list(logs.iterdir())


def test_a_sigkilled_installer_takes_verifications_processes_down(tmp_path):
    """Verification's commands (the moved level's selftest starts peers of its own) run under the
    same supervisor, in a session of their own."""
    out = tmp_path / "job-pids"
    code = ("import sys; from installer.runner import run_supervised; "
            f"run_supervised([sys.executable, '-c', {NINJA_LIKE!r}, {str(out)!r}], {ENV!r}, 3600)")
    installer = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    pids = _job_pids(out)
    installer.kill()
    installer.wait()
    assert _still_alive(pids) == []


def test_a_supervised_command_gives_its_output_and_exit_code(tmp_path):
    from installer.runner import run_supervised
    r = run_supervised(["sh", "-c", "echo out; echo err >&2; exit 3"], ENV, 60)
    assert (r.returncode, r.stdout, r.stderr) == (3, "out\n", "err\n")
