"""What a wheel's files may say about the build they came from. UCX compiles its install's module
and configuration directories into libucs' read-only data; the wheel (and a binary-cache install
elsewhere) makes those two name /dev/null (same length, NUL-padded, nothing in the file moves),
and nothing else: every other path of a build is kept out by the file-prefix maps, so the wheel
refuses a file that still names the build where something reads it at run time. The shared
library here is compiled with the host's C compiler (a real ELF file, as UCX's are); patchelf's
leftovers in .dynstr and anything in symbols or notes do not count."""
from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from installer import ucxdirs, wheel
from installer.errors import PrefixError

BUILD = "/opt/kvstack.builds/cpu-0123456789ab"


@pytest.fixture
def libucs(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler on this host")
    src = tmp_path / "ucs.c"
    src.write_text(textwrap.dedent(f"""
        const char *module_dir(void) {{ return "{BUILD}/ucx/lib/ucx"; }}
        const char *config_dir(void) {{ return "{BUILD}/ucx/etc/ucx"; }}
        const char *other(void) {{ return "kept: {BUILD}"; }}
    """))
    so = tmp_path / "libucs.so.0"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(so), str(src)], check=True)
    return so


def _strings(so: Path) -> dict[str, bytes]:
    lib = ctypes.CDLL(str(so))
    out = {}
    for name in ("module_dir", "config_dir", "other"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_char_p
        out[name] = fn()
    return out


def test_ucxs_compiled_in_directories_come_to_name_nowhere_and_nothing_else(libucs, tmp_path):
    size = libucs.stat().st_size
    assert ucxdirs.repoint(libucs, ["/elsewhere", BUILD]) == 2
    assert libucs.stat().st_size == size
    copy = tmp_path / "loaded.so"  # a fresh name: this process may hold the first one already
    shutil.copy(libucs, copy)
    got = _strings(copy)
    assert got["module_dir"] == got["config_dir"] == b"/dev/null"
    assert got["other"] == f"kept: {BUILD}".encode()  # a string that only holds the path further on
    assert ucxdirs.repoint(libucs, [BUILD]) == 0


def test_a_file_still_naming_the_build_is_refused_with_its_place(libucs, tmp_path):
    root = tmp_path / "wheel"
    (root / "pkg.libs").mkdir(parents=True)
    shutil.copy(libucs, root / "pkg.libs" / "libucs.so.0")
    with pytest.raises(PrefixError) as e:
        wheel._check_build_named(root, ["pkg.libs"], [BUILD])
    assert "pkg.libs/libucs.so.0 names the build directory in .rodata: " in e.value.line()
    ucxdirs.repoint(root / "pkg.libs" / "libucs.so.0", [BUILD])
    with pytest.raises(PrefixError, match="in .rodata: 'kept: "):
        wheel._check_build_named(root, ["pkg.libs"], [BUILD])


def test_text_naming_the_build_is_refused_and_other_files_pass(tmp_path):
    root = tmp_path / "wheel"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("import os\n")
    wheel._check_build_named(root, ["pkg"], [BUILD])
    (root / "pkg" / "paths.py").write_text(f"PLUGINS = '{BUILD}/nixl/lib/plugins'\n")
    with pytest.raises(PrefixError, match=r"pkg/paths.py names the build directory in its text: "):
        wheel._check_build_named(root, ["pkg"], [BUILD])


def test_preload_never_deep_binds(monkeypatch):
    """NIXL_UCX_DEEPBIND=1 in the environment is overridden: deep-bound, libucs reads libc's own
    `environ` instead of the executable's copy and UCX faults in ucp_worker_create."""
    # set first, then deleted: monkeypatch then restores each to what it was (absent too),
    # although the preload sets them; a bare delenv of an absent name records nothing, and the
    # variables leaked into later tests' NIXL (its UCX plugin then refused to load)
    for name in ("NIXL_UCX_EXPECTED_SONAME", "KVRUNTIME_KV_BUFFER"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("NIXL_UCX_DEEPBIND", "1")
    spec = importlib.util.spec_from_file_location(
        "kvstack_preload_under_test", wheel.PRELOAD_SOURCE
    )
    preload = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(preload)  # as the wheel's import does, with CONFIG = {}
    assert os.environ["NIXL_UCX_DEEPBIND"] == "0"
    monkeypatch.setenv("NIXL_UCX_DEEPBIND", "1")
    preload.setup(
        {"ucp_soname": "libucp-kvstack-01234567.so.0", "env": {"KVRUNTIME_KV_BUFFER": "device"}}
    )
    assert os.environ["NIXL_UCX_DEEPBIND"] == "0"
    assert os.environ["NIXL_UCX_EXPECTED_SONAME"] == "libucp-kvstack-01234567.so.0"
    assert os.environ["KVRUNTIME_KV_BUFFER"] == "device"
    code = wheel.PRELOAD_SOURCE.read_text().split('"""')[2]
    assert (
        "RTLD_DEEPBIND" not in code and "mode=" not in code
    )  # what it loads (from_pip), it loads plainly


def test_what_a_runpath_rewrite_left_in_dynstr_is_blanked_and_the_library_still_loads(tmp_path):
    """meson's install leaves the tail of the build's RUNPATH in .dynstr (`./utils/serdes:<build>/
    ucx/lib`): the wheel zeroes it from the build's path on. Here the live RUNPATH stands in for
    such a tail (the bytes are the same kind); nothing moves and the library loads."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler on this host")
    from installer import elf
    (tmp_path / "x.c").write_text("int x(void) { return 7; }\n")
    so = tmp_path / "libx.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(so), str(tmp_path / "x.c"),
                    f"-Wl,-rpath,./utils/serdes:{BUILD}/ucx/lib"], check=True)
    size = so.stat().st_size
    assert elf.blank_dead_paths(so, [BUILD.encode()]) == 1
    assert so.stat().st_size == size and BUILD.encode() not in so.read_bytes()
    patchelf = elf.find_patchelf()
    if patchelf:
        assert elf.Patchelf(patchelf).rpath(so) == "./utils/serdes:"
    assert ctypes.CDLL(str(so)).x() == 7
    assert elf.blank_dead_paths(so, [BUILD.encode()]) == 0
