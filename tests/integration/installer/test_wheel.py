"""`python -m installer wheel` on a real, full build (UCX + NIXL), then the wheel alone in a fresh
virtual environment: no env.sh, no LD_LIBRARY_PATH, the build directory out of reach.

It runs on the build named by KVSTACK_WHEEL_PREFIX (a prefix from `python -m installer --prefix
P`: CI's pinned cpu build from ../shared/mirror) and skips, saying so, without one. The unit tests
cover the pure parts everywhere; ci/containers.sh installs the same wheel in a container that
never held the build.

What must hold: RECORD hashes every file; the layout UCX and NIXL look for (<libs>/ucx beside
libucs, <libs>/plugins beside libnixl); every RUNPATH $ORIGIN-relative and no NEEDED naming a
public UCX; no file naming the build directory where UCX or NIXL read it (libucs' compiled-in
module and config directories name /dev/null). In the fresh venv, made from an interpreter whose
executable holds `environ` by copy relocation where the host has one (Debian's python3: under
RTLD_DEEPBIND, which the wheel used to load UCX's plugin with, libucs then read libc's unused
copy and NIXL's create_backend died of SIGSEGV on every host but the builder's): an agent comes
up; two agents in two processes move 8 MiB bit-exact with another UCX loaded RTLD_LOCAL first
in each (as Python loads another extension's UCX), while /proc/self/maps shows both copies; a
UCX loaded RTLD_GLOBAL first (its symbols would come first for ours too) stops the import with
one line naming it, never a crash. (kvruntime's selftest, every mode, from the same wheel in a
fresh venv: ci/second-host.sh, on a host that never held the build.)"""
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

pytestmark = [pytest.mark.integration, pytest.mark.build]
ROOT = Path(__file__).resolve().parents[3]
PREFIX = os.environ.get("KVSTACK_WHEEL_PREFIX")
DEBIAN_UCP = Path("/usr/lib/x86_64-linux-gnu/libucp.so.0")


def _run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if not PREFIX:
        pytest.skip(
            "KVSTACK_WHEEL_PREFIX names no full UCX + NIXL build (CI cannot build NIXL; see the "
            "docstring)"
        )
    manifest = json.loads((Path(PREFIX) / "manifest.json").read_text())
    out = tmp_path_factory.mktemp("wheels")
    r = _run(
        [sys.executable, "-m", "installer", "wheel", "--prefix", PREFIX, "-o", str(out)], cwd=ROOT
    )
    assert r.returncode == 0, r.stderr
    whl = next(out.glob("*.whl"))
    return {
        "wheel": whl,
        "manifest": manifest,
        "tmp": tmp_path_factory.mktemp("wheel-use"),
        "out": r.stdout,
    }


def test_wheel_is_well_formed_private_and_relocatable(built, tmp_path):
    whl, manifest = built["wheel"], built["manifest"]
    module = manifest["recipe"]["verify"]["nixl"]["module"]
    cp = "cp" + manifest["python"]["version"].replace(".", "")
    # manylinux_2_X (after any older alias auditwheel adds:
    # manylinux2014_x86_64.manylinux_2_17_x86_64),
    # X no newer than this host's glibc (pip installs it here, refuses it on older hosts)
    tag = re.search(
        rf"-({cp}-{cp}-(?:\w+\.)*manylinux_2_(\d+)_{platform.machine()})\.whl$", whl.name
    )
    assert tag and int(tag[2]) <= int(os.confstr("CS_GNU_LIBC_VERSION").split(".")[1]), whl.name
    assert f"tag {tag[1]}: auditwheel --plat auto" in built["out"]
    with zipfile.ZipFile(whl) as zf:
        names = [
            n for n in zf.namelist() if not n.endswith("/")
        ]  # auditwheel writes directory entries too
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        rows = list(csv.reader(io.StringIO(zf.read(record).decode())))
        assert sorted(r[0] for r in rows) == sorted(names)
        for path, digest, size in rows:
            if path != record:
                assert (digest, int(size)) == (
                    wheelformat.record_hash(zf.read(path)),
                    len(zf.read(path)),
                ), path
        dist = record.rsplit("/", 1)[0]
        assert (
            json.loads(zf.read(f"{dist}/kvstack-manifest.json"))["build_id"] == manifest["build_id"]
        )
        assert (
            zf.read(f"{module}/__init__.py")
            .decode()
            .splitlines()[0]
            .startswith("from . import _kvstack_preload")
        )
        zf.extractall(tmp_path)
    libs = tmp_path / (dist.split("-")[0] + ".libs")  # where auditwheel grafts: <distribution>.libs
    grafted = {p.name for p in libs.iterdir() if p.is_file()}
    private = {m[1] for n in grafted if (m := re.fullmatch(r"(lib\w+)-[0-9a-f]{8}(\.so(\.0)?)", n))}
    assert private >= {"libucp", "libuct", "libucs", "libucm", "libnixl", "libserdes"}, grafted
    assert (libs / "plugins" / "libplugin_UCX.so").is_file()
    assert (libs / "ucx" / "libuct_cma.so.0").is_file()  # the ending of libucs-<hash>.so.0
    patchelf = elf.Patchelf(elf.find_patchelf())
    elves = [p for p in tmp_path.rglob("*") if elf.is_elf(p)]
    assert len(elves) >= 10
    for f in elves:
        dyn = patchelf.dynamic(f)
        assert all(p.startswith("$ORIGIN") for p in dyn.runpath.split(":") if p), (f, dyn.runpath)
        public = (
            "libucp.so.0",
            "libuct.so.0",
            "libucs.so.0",
            "libucm.so.0",
            "libnixl.so",
            "libserdes.so",
            "libnixl_build.so",
        )
        assert not [n for n in dyn.needed if n in public], (f, dyn.needed)
        assert manifest["install_dir"] not in dyn.runpath
    libucs = next(libs.glob("libucs-*.so.0")).read_bytes()
    rodata = next(s for s in elf.sections(libucs) if s.name == ".rodata")
    rodata = libucs[rodata.offset:rodata.offset + rodata.size]
    assert (
        manifest["install_dir"].encode() not in rodata
    )  # compiled-in module and config directories
    assert rodata.count(b"\0/dev/null\0") >= 2


def test_strings_of_the_wheels_files_name_no_build_path(built, tmp_path):
    """The build compiled with file-prefix maps (installer/buildsys/filemap.py), so `installer
    wheel` only repoints UCX's two compiled-in directories in libucs (a build taken from a binary
    cache has them repointed already) and says how many, not which; then `strings` over every
    library and module of the wheel names neither where the build lies nor where it was built
    (its kvstack-manifest.json says both, as the build's record)."""
    m = built["manifest"]
    count = 0 if "binary_cache" in m else 2
    assert f"made to name /dev/null: {count} strings in libucs" in built["out"], built["out"]
    assert "compiled-in /" not in built["out"]  # no string is listed
    with zipfile.ZipFile(built["wheel"]) as zf:
        zf.extractall(tmp_path)
    dirs = {m["install_dir"], m.get("binary_cache", {}).get("built_in") or m["install_dir"]}
    elves = [p for p in tmp_path.rglob("*") if elf.is_elf(p)]
    assert len(elves) >= 10
    named = {}
    for f in elves:
        out = _run(["strings", "-a", str(f)]).stdout.splitlines()
        if hits := [s for s in out if any(d in s for d in dirs)]:
            named[str(f.relative_to(tmp_path))] = hits[:3]
    assert not named, named


def test_the_same_build_gives_the_same_wheel(built, tmp_path):
    """The grafted names come from the staged libraries' bytes and the zip's dates from
    SOURCE_DATE_EPOCH: a second wheel of the build is the first, byte for byte."""
    r = _run(
        [sys.executable, "-m", "installer", "wheel", "--prefix", PREFIX, "-o", str(tmp_path)],
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / built["wheel"].name).read_bytes() == built["wheel"].read_bytes()


def _copies_environ(python: str) -> bool:
    """Whether the interpreter's executable holds `environ` by copy relocation (R_X86_64_COPY)."""
    r = _run(["readelf", "-rW", os.path.realpath(python)])
    return r.returncode == 0 and any(
        "_COPY" in line and "environ@" in line for line in r.stdout.splitlines()
    )


@pytest.fixture(scope="module")
def venv(built):
    version = built["manifest"]["python"]["version"]
    candidates = [
        f"/usr/bin/python{version}",
        getattr(sys, "_base_executable", sys.executable),
        sys.executable,
    ]
    base = next((c for c in candidates if os.path.exists(c) and _copies_environ(c)), sys.executable)
    v = built["tmp"] / "fresh"
    r = _run([base, "-m", "venv", str(v)])
    assert r.returncode == 0, r.stderr
    py = v / "bin" / "python"
    r = _run(
        [
            str(py),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            str(built["wheel"]),
        ]
    )
    assert r.returncode == 0, r.stderr[-2000:]
    print(f"fresh venv from {base} (environ by copy relocation: {_copies_environ(base)})")
    return py


def _clean_env():
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("UCX_", "NIXL_", "KVRUNTIME_", "KVSTACK_"))
    }
    for k in ("LD_LIBRARY_PATH", "PYTHONPATH", "LD_PRELOAD", "VIRTUAL_ENV"):
        env.pop(k, None)
    return env


@pytest.fixture(scope="module")
def foreign(pypi_ucx):
    """Debian's libucx0 (UCX 1.13.1) where installed, else PyPI's libucx-cu12."""
    return DEBIAN_UCP if DEBIAN_UCP.exists() else pypi_ucx


def test_an_agent_comes_up_where_deepbind_crashed(built, venv):
    base = (venv.parent.parent / "pyvenv.cfg").read_text()
    module = built["manifest"]["recipe"]["verify"]["nixl"]["module"]
    code = (
        f"import faulthandler; faulthandler.enable()\nfrom {module}._api import nixl_agent, "
        "nixl_agent_config\nnixl_agent('a', nixl_agent_config(backends=['UCX']))\nprint('AGENT UP')"
    )
    r = _run([str(venv), "-c", code], env=_clean_env(), cwd=built["tmp"], timeout=120)
    assert r.returncode == 0 and "AGENT UP" in r.stdout, (base, r.returncode, r.stderr[-3000:])


def test_import_nixl_is_the_wheels_backend_as_engines_import_it(built, venv):
    """vLLM, SGLang and Dynamo `from nixl._api import nixl_agent`: the wheel is the distribution
    `nixl` (kvstack's local version) and its `nixl` is the backend's modules, not copies."""
    module = built["manifest"]["recipe"]["verify"]["nixl"]["module"]
    code = (f"import nixl, {module}\nfrom nixl._api import nixl_agent, nixl_agent_config\n"
            f"assert nixl._api is {module}._api and nixl._bindings is {module}._bindings\n"
            f"assert nixl.logging is {module}.logging\n"
            f"nixl_agent('a', nixl_agent_config(backends=['UCX']))\n"
            f"from importlib.metadata import version\nprint('NIXL', version('nixl'))")
    r = _run([str(venv), "-W", "error::RuntimeWarning", "-c", code], env=_clean_env(),
             cwd=built["tmp"], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"^NIXL \d+\.\d+\.\d+\+kvstack\.", r.stdout, re.M), r.stdout


def _pair(built, venv, foreign, scope: str) -> tuple[str, dict]:
    """nixl_pair.py in the fresh venv with the other UCX loaded first in `scope`: (module, its
    JSON)."""
    module = built["manifest"]["recipe"]["verify"]["nixl"]["module"]
    r = _run(
        [str(venv), str(Path(__file__).with_name("nixl_pair.py")), module, str(foreign), scope],
        env=_clean_env(),
        cwd=built["tmp"],
        timeout=180,
    )
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    return module, json.loads(
        next(line for line in r.stdout.splitlines() if line.startswith("PAIR "))[5:]
    )


def test_two_agents_move_bytes_beside_another_ucx(built, venv, foreign):
    _, out = _pair(built, venv, foreign, "local")
    assert out["state"] == "DONE" and out["match"] and out["target_rc"] == 0
    site = str(venv.parent.parent / "lib")
    for side, maps in out["maps"].items():
        assert any(
            m.startswith(site) and re.search(r"\.libs/libucp-[0-9a-f]{8}\.so\.0$", m) for m in maps
        ), (side, maps)
        assert any(m.startswith(site) and m.endswith("/ucx/libuct_cma.so.0") for m in maps), (
            side,
            maps,
        )
        assert any(os.path.realpath(m) == os.path.realpath(foreign) for m in maps), (side, maps)
        assert not [m for m in maps if m.startswith(built["manifest"]["install_dir"])], (side, maps)


def test_a_ucx_loaded_globally_first_stops_the_import_with_one_line(built, venv, foreign):
    module, out = _pair(built, venv, foreign, "global")
    assert out["refused"] == (
        f"ImportError: {module}: another UCX is loaded with RTLD_GLOBAL in this process "
        f"({os.path.realpath(foreign)}) and would take the place of this wheel's own; load that "
        f"one RTLD_LOCAL (not by LD_PRELOAD), or not at all, before importing {module}"
    ), out
    assert not [m for m in out["maps"] if "/nixl.libs/" in m], out["maps"]  # nothing of ours loaded
