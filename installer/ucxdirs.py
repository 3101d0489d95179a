"""UCX's compiled-in directories. configure compiles two of its install's directories into
libucs' read-only data: the module directory (searched after the one beside libucs) and the
system-wide configuration directory (<sysconfdir>/ucx, whose ucx.conf is read first). Wherever a
build goes that is not where it was built (a wheel, a binary-cache install on another host), they
name a path that is missing there or, worse, holds another build whose modules and settings UCX
would take. They are made to name /dev/null, under which nothing can exist; UCX still finds its
modules beside libucs (<libucs' directory>/ucx) and its own ucx.conf beside it too
(<libucs' directory>/../etc/ucx/ucx.conf), so a build loses nothing by it. Every other path of
the build is kept out of its binaries by the file-prefix maps (installer/buildsys/filemap.py)."""
from __future__ import annotations

from pathlib import Path

from . import elf

NOWHERE = b"/dev/null"
UCX = "ucx"  # the UCX component's directory in a build
COMPILED_IN = ("lib/ucx", "etc/ucx")  # under UCX's install directory: modules, configuration


def compiled_in(build_dir: str | Path) -> list[bytes]:
    """The directories a build in build_dir compiled into its libucs."""
    return [f"{build_dir}/{UCX}/{d}".encode() for d in COMPILED_IN]


def repoint(libucs: Path, build_dirs: list[str]) -> int:
    """Make libucs' compiled-in directories of any of build_dirs name /dev/null (same length,
    NUL-padded: nothing in the file moves). Returns how many strings were rewritten."""
    dirs = [p for d in build_dirs for p in compiled_in(d)]
    return len(elf.replace_strings(libucs, dirs, ".rodata", NOWHERE))


def libucs_files(build_dir: Path) -> list[Path]:
    """The build's libucs, each file once (libucs.so -> libucs.so.0 -> libucs.so.0.0.0)."""
    lib = build_dir / UCX / "lib"
    return sorted({p.resolve() for p in lib.glob("libucs.so*") if elf.is_elf(p)})
