"""A library the wheel's files need that a wheel on PyPI provides (wheeldeps.toml's [pip] table:
the cuda build's libcudart.so.13 from nvidia-cuda-runtime, in site-packages/nvidia/cu13/lib).
auditwheel leaves it out (--exclude) and resets the RUNPATH of what it grafts to the wheel's own
directory, so the wheel's preload loads it from that wheel's directory first. No CUDA here: a
stand-in libcudart.so.13 is compiled with the host's C compiler (SONAME and all), with a library
that needs it and has no RUNPATH at all, as a grafted one; in a fresh interpreter the preload runs
with the wheel's config and that library must then reach the stand-in, not a libcudart the host
may have (a CUDA toolkit in ld.so.cache)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import pytest

from installer import wheel, wheeldeps


def test_the_table_names_the_cuda_runtime_and_what_auditwheel_leaves_out():
    outside = wheeldeps.load()
    found = outside.from_pip({"libc.so.6", "libcudart.so.13", "libucp.so.0"})
    assert found == [
        wheeldeps.FromPip("libcudart.so.13", "nvidia-cuda-runtime==13.*", "nvidia/cu13/lib")
    ]
    assert found[0].path == "nvidia/cu13/lib/libcudart.so.13"
    # the drivers and the host's rdma-core stay the host's (wheeldeps.toml says why)
    assert outside.excluded(found) == [
        "libcuda.so.1",
        "libnvidia-ml.so.1",
        "libze_loader.so.1",
        "libgdrapi.so.2",
        "libibverbs.so.1",
        "librdmacm.so.1",
        "libmlx5.so.1",
        "libefa.so.1",
        "libcudart.so.13",
    ]
    assert outside.from_pip({"libc.so.6", "libucp.so.0"}) == []  # the cpu build's files


@pytest.fixture
def site(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler")
    site = tmp_path / "site-packages"
    cudart = site / "nvidia/cu13/lib/libcudart.so.13"   # as pip installs nvidia-cuda-runtime 13.x
    cudart.parent.mkdir(parents=True)
    (tmp_path / "cudart.c").write_text(
        "int cudaRuntimeGetVersion(int *v) { *v = 13050; return 0; }\n"
    )
    subprocess.run(
        [
            cc,
            "-shared",
            "-fPIC",
            "-Wl,-soname,libcudart.so.13",
            "-o",
            str(cudart),
            str(tmp_path / "cudart.c"),
        ],
        check=True,
    )
    (tmp_path / "user.c").write_text(textwrap.dedent("""
        int cudaRuntimeGetVersion(int *v);
        int runtime_version(void) { int v = 0; cudaRuntimeGetVersion(&v); return v; }
    """))
    libs = site / "kvstack_nixl_cu13.libs"
    libs.mkdir()
    subprocess.run(
        [
            cc,
            "-shared",
            "-fPIC",
            "-o",
            str(libs / "libnixl-00000000.so"),
            str(tmp_path / "user.c"),
            f"-L{cudart.parent}",
            "-l:libcudart.so.13",
        ],
        check=True,
    )
    return site


def _run(site, config, path=()) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        import ctypes, importlib.util, sys
        sys.path += {[str(p) for p in path]!r}
        spec = importlib.util.spec_from_file_location(
            "preload_under_test", {str(wheel.PRELOAD_SOURCE)!r})
        preload = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(preload)
        preload.setup({config!r}, libs_dir={str(site / "kvstack_nixl_cu13.libs")!r},
                      site={str(site)!r})
        lib = ctypes.CDLL({str(site / "kvstack_nixl_cu13.libs/libnixl-00000000.so")!r})
        print(lib.runtime_version())
        print([l.split()[-1] for l in open("/proc/self/maps") if "libcudart" in l][0])
    """)
    env = {
        "PATH": "/usr/bin:/bin"
    }  # no LD_LIBRARY_PATH: the stand-in is reached only through the preload
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)


def test_the_preload_loads_the_cuda_runtime_from_its_wheel_for_a_file_without_runpath(site):
    r = _run(site, {"from_pip": ["nvidia/cu13/lib/libcudart.so.13"]})
    assert r.returncode == 0, r.stderr
    version, loaded = r.stdout.split()
    assert version == "13050" and loaded == str(site / "nvidia/cu13/lib/libcudart.so.13")


def test_the_runtime_is_found_in_another_site_packages_on_sys_path(site, tmp_path):
    """A venv that sees another's site-packages through a .pth (ci/cuda-wheel-check.sh's fresh venv
    over the host's torch venv): nvidia-cuda-runtime is there, not beside the wheel."""
    other = tmp_path / "torch-venv-site-packages"
    other.mkdir()
    (site / "nvidia").rename(other / "nvidia")
    r = _run(site, {"from_pip": ["nvidia/cu13/lib/libcudart.so.13"]}, path=[other])
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["13050", str(other / "nvidia/cu13/lib/libcudart.so.13")]


def test_without_the_preload_the_file_does_not_reach_the_wheels_runtime(site):
    """What the first test shows is the preload's doing: without it the loader fails, or takes a
    CUDA toolkit's libcudart the host lists in ld.so.cache (this one has /usr/local/cuda-13.0)."""
    r = _run(site, {"from_pip": []})
    assert (
        r.returncode != 0
        and "libcudart.so.13: cannot open shared object file" in r.stderr
        or r.returncode == 0
        and r.stdout.split()[1] != str(site / "nvidia/cu13/lib/libcudart.so.13")
    ), (r.stdout, r.stderr)
