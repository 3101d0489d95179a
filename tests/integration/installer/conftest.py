"""Fixtures: a local HTTP server (see localserver.py), a real bare git repository, another
UCX to load beside the wheel's, and `world` (recipes and a mirror of small real projects, one per
module, for the build tests)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.integration.installer.localserver import Server, sha256


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
        return subprocess.run(
            ["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True
        ).stdout.strip()

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


def pip_download(dest: Path, *requirements: str, deps: bool = False
                 ) -> subprocess.CompletedProcess:
    """`pip download` of ``requirements`` as wheels only, into ``dest``, quietly (``deps``:
    their dependencies too); the caller skips on a failure, with what failed."""
    return subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
         *([] if deps else ["--no-deps"]), "--only-binary=:all:", "-d", str(dest),
         *requirements],
        capture_output=True,
        text=True,
    )


@pytest.fixture(scope="session")
def pypi_ucx(tmp_path_factory):
    """libucp.so.0 of PyPI's libucx-cu12 (UCX 1.22.0 without CUDA's own libraries): a UCX that is
    not the wheel's, as a distribution's libucx0 or another wheel's would be."""
    d = tmp_path_factory.mktemp("foreign-ucx")
    r = pip_download(d, FOREIGN_UCX)
    if r.returncode:
        pytest.skip(
            f"cannot download {FOREIGN_UCX} from PyPI (the other UCX): {r.stderr.strip()[-200:]}"
        )
    with zipfile.ZipFile(next(d.glob("*.whl"))) as zf:
        zf.extractall(d / "tree")
    return next((d / "tree").rglob("libucp.so.0"))


ROOT = Path(__file__).resolve().parents[3]
PROJECTS = Path(__file__).parent / "projects"
TOOLS = ["meson==1.12.1", "ninja==1.13.2"]


def _tarball(project: str, dest: Path) -> tuple[str, str]:
    name = f"{project}-1.0.tar.gz"
    with tarfile.open(dest / name, "w:gz") as tf:
        tf.add(PROJECTS / project, arcname=f"{project}-1.0")
    return name, sha256((dest / name).read_bytes())


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A recipes dir (the real schema) and a mirror with the four projects and the tools' wheels."""
    base = tmp_path_factory.mktemp("world")
    recipes, mirror = base / "recipes", base / "mirror"
    recipes.mkdir()
    mirror.mkdir()
    shutil.copy(ROOT / "recipes" / "schema.json", recipes)
    r = pip_download(mirror / "wheels", *TOOLS, deps=True)
    if r.returncode:
        pytest.skip(f"cannot download the build tools' wheels from PyPI: {r.stderr.strip()[-200:]}")
    lines = ["schema_version = 1", 'description = "tests: small real projects"', ""]
    for project in (
        "hello-autotools",
        "hello-headers",
        "hello-meson",
        "hello-cmake",
        "hello-parts",
    ):
        name, digest = _tarball(project, mirror)
        lines += [
            f"[sources.{project}]",
            f'url = "https://example.invalid/{name}"',
            f'filename = "{name}"',
            f'sha256 = "{digest}"',
            "",
        ]
    lines += [
        """
[components.hello-autotools]
source = "hello-autotools"
build = "autotools"
enable = { shout = true, static = false }

[components.hello-headers]
source = "hello-headers"
build = "headers"
pkgconfig_name = "hello_headers"
version = "1.0"

[components.hello-meson]
source = "hello-meson"
build = "meson"
depends = ["hello-headers"]

[components.hello-cmake]
source = "hello-cmake"
build = "cmake"
defines = { CMAKE_BUILD_TYPE = "Release", HELLO_FAIL = false, HELLO_SLOW = false }

[components.hello-parts]
source = "hello-parts"
build = "cmake"
pkgconfig_modules = ["hello_greet"]

[system_packages.debian]
make = "autotools project"
cmake = "cmake project"
autoconf = "autoreconf"
automake = "autoreconf"
libtool = "autoreconf"

[build_tools]
python = %s
target = []

[runtime]
kv_buffer = "host"

[verify]
files = ["hello-autotools/lib/libhowdy.so", "hello-headers/include/hello.h",
         "hello-meson/bin/greet", "hello-cmake/lib/libhello.so", "hello-parts/lib/libhello_greet.a"]
"""
        % json.dumps(TOOLS)
    ]
    (recipes / "defaults.toml").write_text("\n".join(lines))
    (recipes / "cpu.toml").write_text('platform = "cpu"\n')
    return {"recipes": recipes, "mirror": mirror, "cache": base / "cache"}
