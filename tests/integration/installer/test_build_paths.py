"""No build path in a pinned build's binaries (ci/pinned-builds.sh: cpu, xpu, xpu ze-ipc): every
compile ran with the build's directory mapped to "." (installer/buildsys/filemap.py), so `strings`
over each of its ELF files (UCX's libraries, modules and ucx_info, NIXL's libraries, plugins and
Python extension; Abseil is linked into NIXL's) names no path of its source and build trees, and
names the build's own directory only where something looks it up: a RUNPATH of that file, UCX's
compiled-in module and configuration directories (the wheel and the binary cache repoint those:
installer/ucxdirs.py), and UCX's record of its configure line (its --prefix): in ucx_info, and
in libucp too for the ze-ipc variant's newer UCX (`ucx_info -b` reads it there). Before the
maps, libucs alone named the build's trees 140 times (debug information's directories, UCX's
__FILE__s), and NIXL's libraries named Abseil's sources. What verification builds for itself
(verify/: UCX's ibmock, the Level Zero null driver) is no part of the stack and is left out."""
from __future__ import annotations

import subprocess

import pytest

from installer import elf, ucxdirs
from installer.plan import WORK
from tests.integration.installer.test_pinned_builds import _build

pytestmark = [pytest.mark.integration, pytest.mark.build]
STACK = ("ucx", "nixl")  # the build's directories its users load from


def _strings(path) -> list[str]:
    out = subprocess.run(["strings", "-a", str(path)], capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def _records_configure(name: str) -> bool:
    """UCX's files that keep its configure line as a string: ucx_info, and libucp in the UCX of
    the ze-ipc pin (a newer UCX than the release's)."""
    return name == "ucx_info" or name.startswith("libucp.so")


@pytest.mark.parametrize("name", ["CPU", "XPU", "XPU_IPC"])
def test_strings_of_every_binary_name_no_build_path(name):
    build = _build(name)
    root = str(build["dir"])
    patchelf = elf.Patchelf(elf.find_patchelf())
    compiled_in = {d.decode() for d in ucxdirs.compiled_in(root)}
    elves = sorted(p for top in STACK for p in (build["dir"] / top).rglob("*") if elf.is_elf(p))
    assert len(elves) >= 15, elves
    named = {}
    for f in elves:
        allowed = compiled_in | set(patchelf.rpath(f).split(":"))
        # a path list (a RUNPATH, or what meson's install left of the build's one in .dynstr)
        # passes when each of its entries that names the build is one of this file's RUNPATH
        bad = [s for s in _strings(f) if any(root in p and p not in allowed for p in s.split(":"))
               and not (_records_configure(f.name)
                        and s.lstrip('"').startswith(f"--prefix={root}/ucx "))]
        if bad:
            named[str(f.relative_to(build["dir"]))] = bad[:3] + [f"... {len(bad)} in all"]
    assert not named, named
    trees = f"{root}/{WORK}"
    assert not [f for f in elves if any(trees in s for s in _strings(f))]
