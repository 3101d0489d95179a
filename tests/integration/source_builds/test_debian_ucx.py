"""A real UCX built and proven by the installer in CI, which cannot reach GitHub: Debian
bookworm's UCX source package (1.13.1, its debian/ dir and quilt patches applied by dpkg-source,
as its autogen needs) replaces the pinned UCX through a recipe overlay; the NIXL side is
disabled. Then the xpu recipe on the same UCX: 1.13.1 has no Level Zero support (configure only
warns about --with-ze), and verification — with the Level Zero null driver built from Debian's
level-zero source — must say so instead of passing. No ze-capable UCX source is reachable from
CI; the ze path itself is proven outside CI (BENCHMARKS.md)."""
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
    """Debian's ucx and level-zero sources in a mirror (ci/debian-sources.sh, as CI's image
    takes them), and the overlay that builds UCX from them (ci/debian-ucx.toml)."""
    base = tmp_path_factory.mktemp("debian")
    r = subprocess.run(["bash", str(ROOT / "ci/debian-sources.sh"), str(base), "ucx", "level-zero"],
                       capture_output=True, text=True)
    if r.returncode == 3:
        pytest.skip(r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, r.stderr[-2000:]
    mirror = base / "mirror"
    overlay = base / "debian-ucx.toml"
    overlay.write_text((base / "debian-sources.toml").read_text() + (ROOT / "ci/debian-ucx.toml").read_text())
    xpu_overlay = base / "debian-level-zero.toml"
    xpu_overlay.write_text('[verify.level_zero]\nnull_driver_source = "level-zero-debian"\n')
    return {"mirror": mirror, "overlay": overlay, "xpu_overlay": xpu_overlay, "cache": base / "cache", "base": base}


def _install(debian, platform, *extra):
    prefix = debian["base"] / f"prefix-{platform}"
    cmd = [sys.executable, "-m", "installer", "--platform", platform, "--recipe-overlay", str(debian["overlay"]),
           *extra, "--mirror", str(debian["mirror"]), "--cache-dir", str(debian["cache"]), "--prefix", str(prefix)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                       env=dict(os.environ, PYTHONUNBUFFERED="1"))
    print(r.stdout[-3000:], r.stderr[-3000:])  # shown with -rA / on failure: per-phase times
    return prefix, r


def test_debian_ucx_builds_and_proves_itself_on_cpu(debian):
    prefix, r = _install(debian, "cpu")
    assert r.returncode == 0, r.stderr[-2000:]
    manifest = json.loads((prefix / "manifest.json").read_text())
    levels = manifest["verification"]["levels"]
    assert levels["built"]["status"] == "passed"
    assert levels["loaded"]["status"] == "passed"
    assert {c["check"] for c in levels["loaded"]["checks"]} >= {"transport cma", "transport tcp", "memory domain posix"}
    assert levels["moved"] == {"status": "skipped", "reason": "this recipe builds no NIXL", "checks": []}
    version = subprocess.run([str(prefix / "ucx/bin/ucx_info"), "-v"], capture_output=True, text=True).stdout
    assert "1.13.1" in version
    configure = next(s for s in manifest["phases"]["configure"]["components"]["ucx"]["steps"] if s["step"] == "configure")
    assert "--without-java" in configure["argv"] and "--without-cuda" in configure["argv"]


def test_the_same_build_id_gives_the_same_bytes_and_the_autoconf_cache_changes_none(debian):
    """Build the cpu UCX of the test above again from nothing but the cache directory (sources and
    the autoconf results that build kept), into the same prefix: configure answers from the cache
    and every installed file — libucs, which holds the configure flags, UCX's modules, ucx_info —
    has the same bytes."""
    prefix = debian["base"] / "prefix-cpu"
    if not prefix.exists():
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


def test_xpu_verification_refuses_a_ucx_without_level_zero(debian):
    prefix, r = _install(debian, "xpu", "--recipe-overlay", str(debian["xpu_overlay"]))
    assert r.returncode == 9, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith("verification failed: ")
    assert not prefix.exists()  # nothing was switched
    failed = json.loads(next((debian["cache"] / "work").glob("*/manifest.failed.json")).read_text())
    report = failed["verification"]
    bad = {c["check"] for lvl in report["levels"].values() for c in lvl["checks"] if not c["ok"]}
    assert {"define HAVE_ZE", "uct_MODULES has ze"} <= bad
    assert any("Level Zero null driver" in c["detail"] for c in report["levels"]["loaded"]["checks"]) or \
        report["levels"]["loaded"]["status"] in ("failed", "skipped")
