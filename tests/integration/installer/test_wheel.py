"""`python -m installer wheel` on a real, full build (UCX + NIXL), then the wheel alone in a fresh
virtual environment: no env.sh, no LD_LIBRARY_PATH, the build directory out of reach.

CI cannot make such a build (it cannot reach GitHub for NIXL; its real build is Debian's UCX with
NIXL disabled, which test_wheel_ucx.py covers for the private UCX). So this test runs on the
build named by KVSTACK_WHEEL_PREFIX (a prefix from `python -m installer --prefix P`, e.g. from a
mirror made from clones, README "Offline") and skips, saying so, without one; BENCHMARKS.md
records its run on the pinned cpu stack. The unit tests cover the pure parts everywhere.

What must hold: RECORD hashes every file; the layout UCX and NIXL look for (<libs>/ucx beside
libucs, <libs>/plugins beside libnixl); every RUNPATH $ORIGIN-relative and no NEEDED naming a
public UCX; and in the fresh venv, with Debian's libucp.so.0 (libucx0, UCX 1.13.1) loaded
RTLD_GLOBAL first in each process, two NIXL agents in two processes move 8 MiB bit-exact while
/proc/self/maps shows both UCX copies; kvruntime's selftest passes there too with that UCX
preloaded into every process it starts."""
from __future__ import annotations

import csv
import io
import json
import os
import platform
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from installer import elf, wheelformat

pytestmark = [pytest.mark.integration]
ROOT = Path(__file__).resolve().parents[3]
PREFIX = os.environ.get("KVSTACK_WHEEL_PREFIX")
DEBIAN_UCP = Path("/usr/lib/x86_64-linux-gnu/libucp.so.0")


def _run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if not PREFIX:
        pytest.skip("KVSTACK_WHEEL_PREFIX names no full UCX + NIXL build (CI cannot build NIXL; see the docstring)")
    manifest = json.loads((Path(PREFIX) / "manifest.json").read_text())
    out = tmp_path_factory.mktemp("wheels")
    r = _run([sys.executable, "-m", "installer", "wheel", "--prefix", PREFIX, "-o", str(out)], cwd=ROOT)
    assert r.returncode == 0, r.stderr
    whl = next(out.glob("*.whl"))
    return {"wheel": whl, "manifest": manifest, "tmp": tmp_path_factory.mktemp("wheel-use"), "out": r.stdout}


def test_wheel_is_well_formed_private_and_relocatable(built, tmp_path):
    whl, manifest = built["wheel"], built["manifest"]
    module = manifest["recipe"]["verify"]["nixl"]["module"]
    cp = "cp" + manifest["python"]["version"].replace(".", "")
    # manylinux_2_X, X no newer than this host's glibc (pip installs it here, refuses it on older hosts)
    tag = re.search(rf"-{cp}-{cp}-manylinux_2_(\d+)_{platform.machine()}\.whl$", whl.name)
    assert tag and int(tag[1]) <= int(os.confstr("CS_GNU_LIBC_VERSION").split(".")[1]), whl.name
    assert f"tag {cp}-{cp}-manylinux_2_{tag[1]}_{platform.machine()}: " in built["out"]
    with zipfile.ZipFile(whl) as zf:
        names = zf.namelist()
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        rows = list(csv.reader(io.StringIO(zf.read(record).decode())))
        assert sorted(r[0] for r in rows) == sorted(names)
        for path, digest, size in rows:
            if path != record:
                assert (digest, int(size)) == (wheelformat.record_hash(zf.read(path)), len(zf.read(path))), path
        dist = record.rsplit("/", 1)[0]
        assert json.loads(zf.read(f"{dist}/kvstack-manifest.json"))["build_id"] == manifest["build_id"]
        assert zf.read(f"{module}/__init__.py").decode().splitlines()[0].startswith("from . import _kvstack_preload")
        zf.extractall(tmp_path)
    libs = tmp_path / f"{module}.libs"
    assert (libs / "plugins" / "libplugin_UCX.so").is_file() and list(libs.glob("libnixl-kvstack-*.so"))
    private = {p.name for p in libs.glob("libuc*-kvstack-*.so.0")}
    assert {n.split("-kvstack-")[0] for n in private} >= {"libucp", "libuct", "libucs", "libucm"}
    assert (libs / "ucx" / "libuct_cma.so.0").is_file()  # the ending of libucs-kvstack-*.so.0
    patchelf = elf.Patchelf(elf.find_patchelf())
    elves = [p for p in tmp_path.rglob("*") if elf.is_elf(p)]
    assert len(elves) >= 10
    for f in elves:
        dyn = patchelf.dynamic(f)
        assert dyn.runpath and all(p.startswith("$ORIGIN") for p in dyn.runpath.split(":")), (f, dyn.runpath)
        public = ("libucp.so.0", "libuct.so.0", "libucs.so.0", "libucm.so.0", "libnixl.so", "libserdes.so", "libnixl_build.so")
        assert not [n for n in dyn.needed if n in public], (f, dyn.needed)
        assert manifest["install_dir"] not in dyn.runpath


@pytest.fixture(scope="module")
def venv(built):
    v = built["tmp"] / "fresh"
    assert _run([sys.executable, "-m", "venv", str(v)]).returncode == 0
    py = v / "bin" / "python"
    r = _run([str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(built["wheel"])])
    assert r.returncode == 0, r.stderr[-2000:]
    return py


def _clean_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "NIXL_", "KVRUNTIME_", "KVSTACK_"))}
    for k in ("LD_LIBRARY_PATH", "PYTHONPATH", "LD_PRELOAD", "VIRTUAL_ENV"):
        env.pop(k, None)
    return env


def test_two_agents_move_bytes_beside_debians_ucx(built, venv):
    if not DEBIAN_UCP.exists():
        pytest.skip(f"{DEBIAN_UCP} is missing: apt-get install libucx0 (Debian's UCX, the other copy)")
    module = built["manifest"]["recipe"]["verify"]["nixl"]["module"]
    r = _run([str(venv), str(Path(__file__).with_name("nixl_pair.py")), module, str(DEBIAN_UCP)],
             env=_clean_env(), cwd=built["tmp"], timeout=180)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    out = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("PAIR "))[5:])
    assert out["state"] == "DONE" and out["match"] and out["target_rc"] == 0
    site = str(venv.parent.parent / "lib")
    for side, maps in out["maps"].items():
        assert any(m.startswith(site) and "/libucp-kvstack-" in m for m in maps), (side, maps)
        assert any(m.startswith(site) and m.endswith("/ucx/libuct_cma.so.0") for m in maps), (side, maps)
        assert any(os.path.realpath(m) == os.path.realpath(DEBIAN_UCP) for m in maps), (side, maps)
        assert not [m for m in maps if m.startswith(built["manifest"]["install_dir"])], (side, maps)


def test_kvruntime_selftest_in_the_fresh_venv(built, venv):
    """torch (kvruntime needs it) installed there; kvruntime from this checkout on PYTHONPATH."""
    import torch
    r = _run([str(venv), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
              f"torch=={torch.__version__.split('+')[0]}"])
    if r.returncode:
        pytest.skip(f"cannot install torch into the fresh venv: {r.stderr.strip()[-200:]}")
    env = dict(_clean_env(), PYTHONPATH=str(ROOT))
    if DEBIAN_UCP.exists():
        env["LD_PRELOAD"] = str(DEBIAN_UCP)  # every process the selftest starts holds Debian's UCX first
    r = _run([str(venv), "-m", "kvruntime", "selftest", "--tp-pairs", "none", "--json", "--compact"],
             env=env, cwd=built["tmp"], timeout=600)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    module = built["manifest"]["recipe"]["verify"]["nixl"]["module"]
    assert module in r.stdout
