"""Fixtures: a local HTTP server (see localserver.py), a real bare git repository, and another
UCX to load beside the wheel's."""
from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest

from tests.integration.installer.localserver import Server


@pytest.fixture
def server():
    s = Server()
    yield s
    s.stop()


@pytest.fixture
def git_repo(tmp_path):
    """A real bare repository with two commits; tag v1 on the first, then moved to the second."""
    work = tmp_path / "work"
    bare = tmp_path / "lib.git"
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}

    def git(*args, cwd=work):
        return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout.strip()

    work.mkdir()
    git("init", "-q", "-b", "main")
    (work / "a.txt").write_text("one\n")
    git("add", ".")
    git("commit", "-qm", "one")
    first = git("rev-parse", "HEAD")
    git("tag", "v1")
    (work / "a.txt").write_text("two\n")
    git("commit", "-qam", "two")
    second = git("rev-parse", "HEAD")
    git("clone", "-q", "--bare", str(work), str(bare), cwd=tmp_path)
    return {"url": f"file://{bare}", "path": bare, "first": first, "second": second, "git": git}


FOREIGN_UCX = "libucx-cu12==1.22.0"


@pytest.fixture(scope="session")
def pypi_ucx(tmp_path_factory):
    """libucp.so.0 of PyPI's libucx-cu12 (UCX 1.22.0 without CUDA's own libraries): a UCX that is
    not the wheel's, as a distribution's libucx0 or another wheel's would be."""
    d = tmp_path_factory.mktemp("foreign-ucx")
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
                        "--only-binary=:all:", "-d", str(d), FOREIGN_UCX], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot download {FOREIGN_UCX} from PyPI (the other UCX): {r.stderr.strip()[-200:]}")
    with zipfile.ZipFile(next(d.glob("*.whl"))) as zf:
        zf.extractall(d / "tree")
    return next((d / "tree").rglob("libucp.so.0"))
