"""`python -m installer wheel` refuses bad input with one line and its exit code, and writes
nothing: a prefix that does not exist, one that is no finished install (no manifest, a manifest
not marked complete, a build that failed verification), and an -o that cannot be a directory.
Real CLI processes; the wheel made from a real build is
tests/integration/installer/test_wheel.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _wheel(*args):
    return subprocess.run([sys.executable, "-m", "installer", "wheel", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def _one_line(r, code, text):
    assert r.returncode == code, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and text in lines[0], r.stderr
    assert r.stdout == ""


def test_missing_prefix(tmp_path):
    _one_line(_wheel("--prefix", tmp_path / "nope", "-o", tmp_path / "out"), 10, "does not exist")
    assert not (tmp_path / "out").exists()


def test_prefix_without_manifest(tmp_path):
    (tmp_path / "p" / "ucx").mkdir(parents=True)
    _one_line(
        _wheel("--prefix", tmp_path / "p", "-o", tmp_path / "out"),
        10,
        "holds no manifest.json: not a finished kvstack install",
    )


@pytest.mark.parametrize(
    "manifest, text",
    [
        ({"complete": False}, "is not a finished install"),
        ({"complete": True, "verification": {"ok": False}}, "did not pass verification"),
        (
            {"complete": True, "verification": {"ok": True}},
            "has no NIXL Python module (a UCX-only build)",
        ),
    ],
)
def test_prefix_that_is_no_verified_nixl_build(tmp_path, manifest, text):
    build = tmp_path / "p.builds" / "cpu-1"
    build.mkdir(parents=True)
    (build / "manifest.json").write_text(json.dumps({"build_id": "cpu-1", **manifest}))
    (tmp_path / "p").symlink_to(build)
    _one_line(_wheel("--prefix", tmp_path / "p", "-o", tmp_path / "out"), 10, text)
    assert not (tmp_path / "out").exists()


def test_unreadable_manifest(tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "manifest.json").write_text("{not json")
    _one_line(_wheel("--prefix", tmp_path / "p", "-o", tmp_path / "out"), 10, "is unreadable")


def test_output_that_cannot_be_a_directory(tmp_path):
    (tmp_path / "file").write_text("x")
    _one_line(
        _wheel("--prefix", tmp_path / "nope", "-o", tmp_path / "file" / "out"),
        11,
        "is not a directory",
    )


def test_bad_option_is_a_usage_error(tmp_path):
    _one_line(_wheel("--nope"), 2, "unrecognized arguments")


def test_an_abbreviated_option_is_a_usage_error(tmp_path):
    """--pre is not taken for --prefix: a command line means what it says, whatever options
    are added later."""
    _one_line(_wheel("--pre", tmp_path / "p"), 2, "unrecognized arguments: --pre")
