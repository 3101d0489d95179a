"""Build steps as real processes: a missing tool, a failing command with its log's tail, a full
disk turned into one line."""
from __future__ import annotations

import errno

import pytest

from installer.buildsys.step import Step
from installer.errors import BuildError, HostError
from installer.runner import run_step

pytestmark = pytest.mark.integration


def test_missing_tool_is_named(tmp_path):
    step = Step("build", "make", ("kvstack-no-such-tool", "-j2"), cwd=tmp_path)
    with pytest.raises(BuildError) as e:
        run_step(
            step,
            component="ucx",
            env={"PATH": "/usr/bin:/bin"},
            log_dir=tmp_path / "logs",
            actions={},
        )
    assert "`kvstack-no-such-tool` is not installed (needed by step make)" in e.value.line()


def test_failing_step_keeps_its_log_and_shows_the_tail(tmp_path):
    script = (
        "for i in $(seq 1 40); do echo line $i; done; echo 'fatal: the real reason' >&2; exit 3"
    )
    step = Step("configure", "configure", ("sh", "-c", script), cwd=tmp_path)
    with pytest.raises(BuildError) as e:
        run_step(
            step,
            component="ucx",
            env={"PATH": "/usr/bin:/bin"},
            log_dir=tmp_path / "logs",
            actions={},
        )
    log = tmp_path / "logs" / "ucx.configure.log"
    assert log.exists() and "line 1\n" in log.read_text()
    assert (
        "fatal: the real reason" in e.value.detail
        and "line 40" in e.value.detail
        and "line 1\n" not in e.value.detail
    )
    assert f"log: {log}" in e.value.line() and "exit code 3" in e.value.line()


def test_step_skipped_when_its_output_exists(tmp_path):
    (tmp_path / "configure").write_text("#!/bin/sh\n")
    step = Step(
        "configure",
        "autogen",
        ("./autogen.sh",),
        cwd=tmp_path,
        unless_exists=tmp_path / "configure",
    )
    rec = run_step(step, component="ucx", env={}, log_dir=tmp_path / "logs", actions={})
    assert rec["skipped"] == "configure exists"


def test_full_disk_becomes_one_line():
    err = HostError.from_oserror(
        OSError(errno.ENOSPC, "No space left on device", "/cache/work/x"), "during build"
    )
    assert err.line() == (
        "host error: during build: No space left on device (/cache/work/x); free space there (the "
        "download and build cache can go: --cache-dir) and run again; the previous install is "
        "untouched"
    )
    assert err.exit_code == 11
