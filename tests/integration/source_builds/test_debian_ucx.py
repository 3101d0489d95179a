"""A real UCX built by the installer from Debian bookworm's UCX source package (1.13.1, its debian/
dir and quilt patches applied by dpkg-source, as its autogen needs) through a recipe overlay, the
NIXL side disabled: the `debian` fixture and `_install` serve test_wheel_ucx.py and
test_binary_cache_ucx.py, and the test here proves that one build id gives the same bytes twice.
What this file also tested before CI built the pinned stacks — that a UCX build proves itself on
cpu, and that xpu's verification refuses a UCX without Level Zero — is now proven on the pinned
builds themselves (tests/integration/installer/test_pinned_builds.py)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from installer import buildcompare
from installer.syspkgs import distro_family

pytestmark = [pytest.mark.build, pytest.mark.integration,
              pytest.mark.skipif(distro_family() != "debian" or not shutil.which("dpkg-source"),
                                 reason="needs a Debian/Ubuntu host with dpkg-dev")]
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def debian(tmp_path_factory):
    """Debian's ucx source in a mirror (ci/debian-sources.sh, as CI's image
    takes them), and the overlay that builds UCX from them (ci/debian-ucx.toml)."""
    base = tmp_path_factory.mktemp("debian")
    r = subprocess.run(["bash", str(ROOT / "ci/debian-sources.sh"), str(base), "ucx"],
                       capture_output=True, text=True)
    if r.returncode == 3:
        pytest.skip(r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, r.stderr[-2000:]
    mirror = base / "mirror"
    overlay = base / "debian-ucx.toml"
    overlay.write_text((base / "debian-sources.toml").read_text() + (ROOT / "ci/debian-ucx.toml").read_text())
    return {"mirror": mirror, "overlay": overlay, "cache": base / "cache", "base": base}


def _install(debian, platform, *extra):
    prefix = debian["base"] / f"prefix-{platform}"
    cmd = [sys.executable, "-m", "installer", "--platform", platform, "--recipe-overlay", str(debian["overlay"]),
           *extra, "--mirror", str(debian["mirror"]), "--cache-dir", str(debian["cache"]), "--prefix", str(prefix)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                       env=dict(os.environ, PYTHONUNBUFFERED="1"))
    print(r.stdout[-3000:], r.stderr[-3000:])  # shown with -rA / on failure: per-phase times
    return prefix, r


def test_the_same_build_id_gives_the_same_bytes_and_the_autoconf_cache_changes_none(debian):
    """Build the cpu UCX, then again from nothing but the cache directory (sources and the autoconf
    results the first build kept), into the same prefix: configure answers from the cache
    and every installed file — libucs, which holds the configure flags, UCX's modules, ucx_info —
    has the same bytes."""
    prefix = debian["base"] / "prefix-cpu"
    if not prefix.exists():  # another module's test may have built it with this fixture
        prefix, r = _install(debian, "cpu")
        assert r.returncode == 0, r.stderr[-2000:]
    first = json.loads((prefix / "manifest.json").read_text())
    kept = debian["base"] / "first-build"
    os.rename(prefix.resolve(), kept)
    prefix.unlink()
    shutil.rmtree(first["kvstack_plan"]["work_dir"])
    prefix, r = _install(debian, "cpu")
    assert r.returncode == 0, r.stderr[-2000:]
    second = json.loads((prefix / "manifest.json").read_text())
    assert second["build_id"] == first["build_id"]
    steps = {s["step"]: s for s in second["phases"]["configure"]["components"]["ucx"]["steps"]}
    assert steps["autoconf-cache"]["result"].startswith("cached results from ")
    assert "(cached)" in Path(steps["configure"]["log"]).read_text()
    same = buildcompare.compare(kept, prefix)
    assert same.identical, buildcompare.render(same, kept, prefix)
    assert {"ucx/lib/libucs.so.0.0.0", "ucx/lib/ucx/libuct_cma.so.0.0.0", "ucx/bin/ucx_info"} <= set(same.same)

