"""Private UCX names: SONAMEs of their own per library content, module file names that UCX's
loader (src/ucs/sys/module.c: the ending of libucs' file name from its first dot) still finds,
and the version the wheel takes from the build's manifest."""
from __future__ import annotations

import pytest

from installer import privateucx, wheel


def test_private_soname_keeps_stem_and_ending():
    assert privateucx.private_soname("libucp.so.0", "0123456789abcdef") == "libucp-kvstack-01234567.so.0"
    assert privateucx.private_soname("libucs_signal.so.0", "ffffffff00") == "libucs_signal-kvstack-ffffffff.so.0"
    assert privateucx.private_soname("libnixl.so", "abcdef0123") == "libnixl-kvstack-abcdef01.so"


@pytest.mark.parametrize("bad", ["ucp.so.0", "libucp", "libucp.so.x", "../libucp.so.0"])
def test_private_soname_refuses_what_is_no_soname(bad):
    with pytest.raises(ValueError):
        privateucx.private_soname(bad, "00000000")


def test_soname_map_is_per_library_content():
    m = privateucx.soname_map({"libucs.so.0": "aa" * 32, "libucp.so.0": "bb" * 32})
    assert m == {"libucp.so.0": "libucp-kvstack-bbbbbbbb.so.0", "libucs.so.0": "libucs-kvstack-aaaaaaaa.so.0"}


def test_module_names_follow_the_private_libucs_ending():
    ending = privateucx.module_ending("libucs-kvstack-aaaaaaaa.so.0")
    assert ending == ".so.0"
    assert privateucx.module_filename("libuct_cma.so.0.0.0", ending) == "libuct_cma.so.0"
    assert privateucx.module_filename("libuct_cma.so", ending) == "libuct_cma.so.0"
    # UCX skips a module whose name after lib<framework>_ holds another '_': the name must stay as it is
    assert privateucx.module_filename("libucm_cuda.so", ending) == "libucm_cuda.so.0"


def test_leaks_names_public_ucx_still_needed():
    m = {"libucp.so.0": "libucp-kvstack-1.so.0", "libucs.so.0": "libucs-kvstack-2.so.0"}
    assert privateucx.leaks(("libucs.so.0", "libc.so.6", "libucp-kvstack-1.so.0"), m) == ["libucs.so.0"]


@pytest.mark.parametrize("tag, build_id, want", [
    ("v1.4.0", "cpu-9cd985e552e4", "1.4.0+cpu.9cd985e552e4"),
    ("1.4.0", "cuda-673d0b4c6f66", "1.4.0+cuda.673d0b4c6f66"),
    (None, "xpu-1", "0+xpu.1"),
    ("", "tpu-2", "0+tpu.2"),
])
def test_wheel_version_is_nixl_release_plus_build_id(tag, build_id, want):
    src = {"url": "x"} if tag is None else {"tag": tag}
    manifest = {"build_id": build_id, "recipe": {"components": {"nixl": {"source": "nixl"}}, "sources": {"nixl": src}}}
    assert wheel.version(manifest) == want


def test_preload_goes_after_future_imports(tmp_path):
    init = tmp_path / "__init__.py"
    init.write_text("# license\nfrom __future__ import annotations\nfrom ._api import x\n")
    wheel._import_preload_first(init)
    lines = init.read_text().splitlines()
    assert lines[1] == "from __future__ import annotations" and lines[2].startswith("from . import _kvstack_preload")
    plain = tmp_path / "plain.py"
    plain.write_text("from ._api import x\n")
    wheel._import_preload_first(plain)
    assert plain.read_text().splitlines()[0].startswith("from . import _kvstack_preload")
