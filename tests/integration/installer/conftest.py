"""Fixtures: a local HTTP server (see localserver.py) and a real bare git repository."""
from __future__ import annotations

import subprocess

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
