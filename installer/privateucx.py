"""A private UCX: the bundled UCX libraries get SONAMEs of their own (libucp-kvstack-<hash>.so.0,
as auditwheel names what it grafts) and every bundled file that needs one of them names the
private one, so a process that already holds another UCX (a distribution's libucx0, another
wheel's) loads this copy beside it instead of taking the one it has by SONAME.

UCX finds its transport modules in `<directory of libucs as loaded>/ucx` and takes their file
ending from libucs' own file name from its first dot on (src/ucs/sys/module.c): with libucs named
libucs-kvstack-<hash>.so.0, modules must be named lib<framework>_<name>.so.0 there.

The naming (private_soname, soname_map, privatize) is not UCX's own: the wheel gives NIXL's
libraries private SONAMEs the same way."""
from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

from .elf import Patchelf

TAG = "kvstack"
_SONAME = re.compile(r"^(?P<stem>lib[A-Za-z0-9_+]+)(?P<ending>\.so(?:\.\d+)*)$")


def private_soname(soname: str, digest: str) -> str:
    """libucp.so.0 + digest -> libucp-kvstack-<first 8 of digest>.so.0"""
    m = _SONAME.match(soname)
    if m is None:
        raise ValueError(f"not a library SONAME: {soname!r}")
    return f"{m['stem']}-{TAG}-{digest[:8]}{m['ending']}"


def module_ending(private_libucs: str) -> str:
    """The file ending UCX's module loader wants beside this libucs: from the first dot on."""
    return private_libucs[private_libucs.index("."):]


def module_filename(name: str, ending: str) -> str:
    """libuct_cma.so / libuct_cma.so.0.0.0 -> libuct_cma + ending"""
    return name[:name.index(".so")] + ending


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def soname_map(libraries: dict[str, str]) -> dict[str, str]:
    """{soname: content sha256} of the UCX libraries -> {soname: private soname}"""
    return {soname: private_soname(soname, digest) for soname, digest in sorted(libraries.items())}


def privatize(files: list[Path], mapping: dict[str, str], own_soname: dict[Path, str], rpaths: dict[Path, str],
              patchelf: Patchelf) -> None:
    """Rewrite each file once: its private SONAME (own_soname: the UCX libraries), NEEDED entries
    through mapping, and its RUNPATH (rpaths)."""
    for f in files:
        needed = patchelf.dynamic(f).needed
        patchelf.rewrite(f, soname=own_soname.get(f), replace_needed={n: mapping[n] for n in needed if n in mapping},
                         rpath=rpaths.get(f))


def bundle(libraries: list[Path], modules: list[Path], into: Path, patchelf: Patchelf) -> dict[str, str]:
    """Copy UCX's libraries into `into` under private SONAMEs and its modules into `into`/ucx,
    each NEEDED entry rewritten to the private names and every RUNPATH $ORIGIN-relative.
    Returns {public soname: private soname} for the files that link against this UCX."""
    sonames = {patchelf.dynamic(p).soname or p.name: p for p in libraries}
    mapping = soname_map({s: file_digest(p) for s, p in sonames.items()})
    libucs = next((mapping[s] for s in mapping if s.startswith("libucs.")), None)
    if libucs is None:
        raise ValueError(f"no libucs among {sorted(sonames)}")
    ending = module_ending(libucs)
    sources = {**{into / mapping[s]: p for s, p in sonames.items()},
               **{into / "ucx" / module_filename(p.name, ending): p for p in modules}}
    for dst, src in sources.items():
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        os.chmod(dst, 0o755)
    own = {into / private: private for private in mapping.values()}
    rpaths = {dst: "$ORIGIN" if dst.parent == into else "$ORIGIN/.." for dst in sources}
    privatize(sorted(sources), mapping, own, rpaths, patchelf)
    return mapping


def leaks(dyn_needed: tuple[str, ...], mapping: dict[str, str]) -> list[str]:
    """NEEDED entries that still name a public UCX library."""
    return [n for n in dyn_needed if n in mapping]
