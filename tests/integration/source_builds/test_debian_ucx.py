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
import tarfile
from pathlib import Path

import pytest

from installer import buildcompare
from installer.syspkgs import distro_family
from tests.integration.installer.localserver import sha256

pytestmark = [pytest.mark.build, pytest.mark.integration,
              pytest.mark.skipif(distro_family() != "debian" or not shutil.which("dpkg-source"),
                                 reason="needs a Debian/Ubuntu host with dpkg-dev")]
ROOT = Path(__file__).resolve().parents[3]


def _debian_source(package: str, work: Path, mirror: Path) -> tuple[str, str, str]:
    """apt-get source PACKAGE, unpacked with its patches, as a tarball in the mirror."""
    dl = work / package
    dl.mkdir(parents=True)
    r = subprocess.run(["apt-get", "source", "--download-only", package], cwd=dl, capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"apt-get source {package} failed (deb-src lines missing?): {r.stderr.strip()[-300:]}")
    dsc = next(dl.glob("*.dsc"))
    tree = dl / "tree"
    subprocess.run(["dpkg-source", "--no-check", "-x", dsc.name, str(tree)], cwd=dl, check=True, capture_output=True)
    version = dsc.stem.split("_", 1)[1]
    top = f"{package}-{version}"
    name = f"{top}-debian.tar.gz"
    with tarfile.open(mirror / name, "w:gz") as tf:
        tf.add(tree, arcname=top)
    return name, sha256((mirror / name).read_bytes()), version


@pytest.fixture(scope="module")
def debian(tmp_path_factory):
    base = tmp_path_factory.mktemp("debian")
    mirror = base / "mirror"
    mirror.mkdir()
    ucx = _debian_source("ucx", base / "src", mirror)
    lz = _debian_source("level-zero", base / "src", mirror)
    overlay = base / "debian-ucx.toml"
    overlay.write_text(f"""
# UCX from Debian's source package instead of the pinned upstream release (CI cannot reach GitHub).
[sources.ucx-debian]
url = "https://debian.invalid/ucx_{ucx[2]}.dsc"
filename = "{ucx[0]}"
sha256 = "{ucx[1]}"

[sources.level-zero-debian]
url = "https://debian.invalid/level-zero_{lz[2]}.dsc"
filename = "{lz[0]}"
sha256 = "{lz[1]}"

[components.ucx]
source = "ucx-debian"
# UCX 1.13 has no config/ directory to install (no etc/ucx/ucx.conf yet)
install_dirs = ["src/ucm", "src/ucs", "src/uct", "src/ucp", "src/tools/info", "cmake"]

[components.abseil]
enabled = false
[components.asio]
enabled = false
[components.nixl]
enabled = false

[build_tools]
python = []
target = []
""")
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
