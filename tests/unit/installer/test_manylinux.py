"""The wheel's platform tag from what its files need of the host (installer/manylinux.py): the
ELF reader checked against binutils' readelf on this host's own libraries, and the verdict as a
table of cases over manylinux.toml."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from installer import manylinux
from installer.manylinux import FromPip, Needs, decide, from_pip

POLICY = tomllib.loads(manylinux.POLICY.read_text())


def _system_elves() -> list[Path]:
    exe = Path(sys.executable).resolve()
    libs = [Path(p) for p in ("/lib/x86_64-linux-gnu/libstdc++.so.6", "/usr/lib64/libstdc++.so.6",
                              "/lib/x86_64-linux-gnu/libc.so.6") if Path(p).exists()]
    return [exe, *(p.resolve() for p in libs)]


@pytest.mark.skipif(not shutil.which("readelf"), reason="needs binutils' readelf to compare with")
@pytest.mark.parametrize("path", _system_elves(), ids=lambda p: p.name)
def test_reader_agrees_with_readelf(path):
    out = subprocess.run(["readelf", "-V", "-d", "--wide", str(path)], capture_output=True, text=True,
                         check=True).stdout
    needs = manylinux.read_needs(path)
    assert needs.libraries == re.findall(r"\(NEEDED\).*\[(.*)\]", out)
    readelf = set(re.findall(r"Name: (\S+)\s+Flags", out))
    assert set().union(*needs.versions.values()) == readelf
    assert needs.arch in ("x86_64", "aarch64")


def test_reader_refuses_what_is_not_elf64(tmp_path):
    p = tmp_path / "x.so"
    p.write_bytes(b"#!/bin/sh\n")
    with pytest.raises(ValueError, match="not a 64-bit little-endian ELF"):
        manylinux.read_needs(p)


def _needs(libs=("libc.so.6",), arch="x86_64", **versions) -> Needs:
    return Needs(arch, list(libs), {lib: set(v) for lib, v in versions.items()})


@pytest.mark.parametrize("needs, bundled, platform, why", [
    # glibc alone sets it
    ([_needs(**{"libc.so.6": {"GLIBC_2.2.5", "GLIBC_2.28"}})], set(), "manylinux_2_28_x86_64", "GLIBC_2.28"),
    # nothing newer than 2.17 needed: the oldest manylinux
    ([_needs(**{"libc.so.6": {"GLIBC_2.2.5"}})], set(), "manylinux_2_17_x86_64", "GLIBC_2.17"),
    # the C++ runtime raises it: GLIBCXX_3.4.30 first shipped with glibc 2.35's distributions
    ([_needs(("libc.so.6", "libstdc++.so.6"), **{"libc.so.6": {"GLIBC_2.34"},
                                                  "libstdc++.so.6": {"GLIBCXX_3.4.30", "CXXABI_1.3.13"}})],
     set(), "manylinux_2_35_x86_64", "GLIBCXX_3.4.30"),
    # ... but not past glibc's own need
    ([_needs(("libc.so.6", "libstdc++.so.6"), **{"libc.so.6": {"GLIBC_2.38"},
                                                  "libstdc++.so.6": {"GLIBCXX_3.4.25"}})],
     set(), "manylinux_2_38_x86_64", "GLIBC_2.38"),
    # CXXABI alone can set it
    ([_needs(("libstdc++.so.6",), **{"libstdc++.so.6": {"CXXABI_1.3.15"}})], set(), "manylinux_2_39_x86_64",
     "CXXABI_1.3.15"),
    # a library from outside the wheel that manylinux does not promise
    ([_needs(("libc.so.6", "libnuma.so.1"))], set(), "linux_x86_64", "libnuma.so.1"),
    # ... unless the wheel carries it
    ([_needs(("libc.so.6", "libnuma.so.1"))], {"libnuma.so.1"}, "manylinux_2_17_x86_64", "GLIBC_2.17"),
    # the GPU driver's libraries are the host's by design
    ([_needs(("libc.so.6", "libcuda.so.1")), _needs(("libze_loader.so.1",))], set(), "manylinux_2_17_x86_64", ""),
    # a C++ runtime newer than any listed distribution ships
    ([_needs(("libstdc++.so.6",), **{"libstdc++.so.6": {"GLIBCXX_3.4.99"}})], set(), "linux_x86_64",
     "GLIBCXX_3.4.99"),
    # files of two architectures
    ([_needs(), _needs(arch="aarch64")], set(), "linux_unknown", "architectures"),
    ([_needs(arch="aarch64", **{"libc.so.6": {"GLIBC_2.31"}})], set(), "manylinux_2_31_aarch64", "GLIBC_2.31"),
])
def test_verdict(needs, bundled, platform, why):
    verdict = decide(needs, bundled, POLICY)
    assert verdict.platform == platform
    assert why in verdict.why


def test_policy_rows_are_oldest_first_and_never_go_backwards():
    rows = POLICY["cxx"]
    for a, b in zip(rows, rows[1:]):
        for key in ("glibc", "glibcxx", "cxxabi"):
            assert tuple(map(int, a[key].split("."))) <= tuple(map(int, b[key].split("."))), (a, b)
    assert not set(POLICY["system"]) & set(POLICY["drivers"])


def test_the_cuda_runtime_comes_from_nvidias_wheel_and_then_the_tag_is_manylinux():
    """libcudart.so.13 is neither the host's nor bundled: nvidia-cuda-runtime provides it, into
    site-packages/nvidia/cu13/lib (the layout of its 13.x wheels on PyPI)."""
    needs = [_needs(("libcudart.so.13", "libcuda.so.1", "libc.so.6")), _needs(("libc.so.6",))]
    assert decide(needs, set(), POLICY).platform == "linux_x86_64"
    found = from_pip(needs, set())
    assert found == [FromPip("libcudart.so.13", "nvidia-cuda-runtime==13.*", "nvidia/cu13/lib")]
    assert decide(needs, {d.library for d in found}, POLICY).platform == "manylinux_2_17_x86_64"
    assert from_pip(needs, {"libcudart.so.13"}) == []          # bundled: nothing to require
    assert from_pip([_needs(("libc.so.6",))], set()) == []     # the cpu build needs none
