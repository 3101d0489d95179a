"""Prefixes the installer cannot use are refused before anything is built, each with one line
and its exit code; and what a killed run leaves beside a prefix or in the download cache is
removed by the next one. Real file systems where this host allows mounting them (tmpfs, as
root: CI runs as root; skipped, saying why, elsewhere); the small real projects of
test_build_phases.py as what would be built."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.integration.installer.test_build_phases import ROOT, _cmd, _install

pytestmark = pytest.mark.integration


def _mount_tmpfs(at: Path, *options: str) -> None:
    at.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", ",".join(["size=1m", *options]), "tmpfs", str(at)],
        capture_output=True,
        text=True,
    )
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")


@pytest.fixture
def mounts(tmp_path):
    made = []

    def mount(at: Path, *options: str) -> Path:
        _mount_tmpfs(at, *options)
        made.append(at)
        return at
    yield mount
    for at in reversed(made):
        subprocess.run(["umount", "-l", str(at)], check=False)


def _nothing_built(world, prefix: Path) -> None:
    plan = json.loads(
        subprocess.run(
            _cmd(world, prefix, "--dry-run", "--json"),
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    logs = Path(plan["work_dir"]) / "logs"
    assert not (logs.exists() and [p for p in logs.iterdir() if p.name.startswith("hello-")]), list(
        logs.iterdir()
    )


def _one_line(r) -> str:
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    return r.stderr.strip().splitlines()[-1]


def test_a_prefix_on_a_read_only_file_system(world, mounts, tmp_path):
    ro = mounts(tmp_path / "ro", "ro")
    r = _install(world, ro / "kv")
    assert r.returncode == 11, r.stderr
    last = _one_line(r)
    assert last.startswith(
        f"host error: --prefix {ro / 'kv'}: cannot make its link or builds in {ro}: Read-only file "
        "system"
    )
    assert "choose a writable --prefix" in last
    _nothing_built(world, ro / "kv")


def test_a_prefix_under_a_file(world, tmp_path):
    (tmp_path / "file").write_text("not a directory\n")
    prefix = tmp_path / "file" / "sub" / "kv"
    r = _install(world, prefix)
    assert r.returncode == 10, r.stderr
    assert _one_line(r) == (
        f"prefix: --prefix {prefix}: {tmp_path / 'file'} is a file, not a directory; "
        "choose a --prefix whose parent directories are directories"
    )
    _nothing_built(world, prefix)


def test_a_prefix_that_is_an_empty_read_only_mount_point(world, mounts, tmp_path):
    prefix = mounts(tmp_path / "mnt", "ro")
    r = _install(world, prefix)
    assert r.returncode == 10, r.stderr
    last = _one_line(r)
    assert (
        last.startswith(f"prefix: --prefix {prefix} is a mount point: ")
        and f"--prefix {prefix / 'kvstack'}" in last
    )
    _nothing_built(world, prefix)


def test_what_a_killed_run_left_is_removed_at_the_next_start(world, tmp_path):
    prefix = tmp_path / "kv"
    stale_link = tmp_path / ".kv.switch-99999999"
    os.symlink("kv.builds/gone", stale_link)
    cache_tmp = Path(world["cache"]) / "tmp"
    cache_tmp.mkdir(parents=True, exist_ok=True)
    part = cache_tmp / "tmpkilled.part"
    part.write_bytes(b"half a download")
    r = _install(world, prefix)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not stale_link.is_symlink() and not part.exists()
    assert f"removed what a killed run left: {stale_link}" in r.stderr
    assert "removed downloads a killed run left unfinished: tmpkilled.part" in r.stderr


def _refused(world, prefix: Path) -> str:
    r = _install(world, prefix)
    assert r.returncode == 10, r.stderr[-2000:]
    _nothing_built(world, prefix)
    return _one_line(r)


def test_a_dangling_symbolic_link_that_kvstack_did_not_make(world, tmp_path):
    prefix = tmp_path / "kv"
    os.symlink(tmp_path / "nowhere", prefix)
    assert _refused(world, prefix) == (
        f"prefix: --prefix {prefix} is a symbolic link to {tmp_path / 'nowhere'}, which is not one "
        "of kvstack's builds (kv.builds/<build id>); choose another --prefix, or remove that link "
        "if it is not needed")
    assert os.readlink(prefix) == str(tmp_path / "nowhere")


def test_a_symbolic_link_to_the_users_own_directory(world, tmp_path):
    own = tmp_path / "mine"
    own.mkdir()
    (own / "notes.txt").write_text("the user's\n")
    prefix = tmp_path / "kv"
    os.symlink("mine", prefix)
    assert _refused(world, prefix).startswith(
        f"prefix: --prefix {prefix} is a symbolic link to mine, which is not")
    assert os.readlink(prefix) == "mine" and (own / "notes.txt").read_text() == "the user's\n"


def test_a_directory_with_something_in_it(world, tmp_path):
    prefix = tmp_path / "kv"
    prefix.mkdir()
    (prefix / "bin").mkdir()
    assert _refused(world, prefix).startswith(
        f"prefix: {prefix} exists and is not a kvstack prefix")
    assert [p.name for p in prefix.iterdir()] == ["bin"]


def test_a_link_kvstack_made_is_taken_even_when_its_build_is_gone(world, tmp_path):
    prefix = tmp_path / "kv"
    os.symlink("kv.builds/0123456789ab", prefix)
    r = _install(world, prefix)
    assert r.returncode == 0, r.stderr[-2000:]
    assert os.readlink(prefix).startswith("kv.builds/") and (prefix / "manifest.json").is_file()


@pytest.fixture
def bind_mounts():
    made = []

    def bind(source: Path, at: Path, *options: str) -> Path:
        at.mkdir(parents=True, exist_ok=True)
        remount = ["mount", "-o", ",".join(["remount", "bind", *options]), str(at)]
        for cmd in (["mount", "--bind", str(source), str(at)], *([remount] if options else [])):
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                if made and made[-1] == at:
                    subprocess.run(["umount", str(at)], check=False)
                pytest.skip(f"cannot bind-mount here ({' '.join(cmd)}): {r.stderr.strip()}")
            if cmd[1] == "--bind":
                made.append(at)
        return at
    yield bind
    for at in reversed(made):
        subprocess.run(["umount", "-l", str(at)], check=False)


def test_a_read_only_bind_mount_of_the_same_file_system(world, bind_mounts, tmp_path):
    """os.path.ismount is False for it (same st_dev as its parent): the mount table names it."""
    (tmp_path / "empty").mkdir()
    prefix = bind_mounts(tmp_path / "empty", tmp_path / "kv", "ro")
    assert not os.path.ismount(prefix)
    last = _refused(world, prefix)
    assert last.startswith(f"prefix: --prefix {prefix} is a mount point: ")
    assert f"--prefix {prefix / 'kvstack'}" in last
