"""A private UCX: the bundled UCX libraries carry SONAMEs of their own, so a process that already
holds another UCX (a distribution's libucx0, another wheel's) loads this copy beside it instead of
taking the one it has by SONAME. auditwheel gives them those names when it grafts them
(libucp-<first 8 hex of sha256>.so.0, installer/repair.py); what it cannot do is below.

UCX loads its transport modules with dlopen, so nothing names them for auditwheel to find: they
go into the wheel before the repair, in `<directory of libucs as loaded>/ucx` where UCX looks, and
UCX takes their file ending from libucs' own file name from its first dot on (src/ucs/sys/module.c):
with libucs grafted as libucs-<hash>.so.0, modules must be named lib<framework>_<name>.so.0."""
from __future__ import annotations

import hashlib
from pathlib import Path


def module_ending(libucs: str) -> str:
    """The file ending UCX's module loader wants beside this libucs: from the first dot on."""
    return libucs[libucs.index("."):]


def module_filename(name: str, ending: str) -> str:
    """libuct_cma.so / libuct_cma.so.0.0.0 -> libuct_cma + ending"""
    return name[:name.index(".so")] + ending


def grafted_name(path: Path) -> str:
    """The name `auditwheel repair` gives the library at path when it grafts it (its copylib:
    the file name's stem, the first 8 hex digits of the file's sha256, the rest of the name); the
    wheel checks that the repaired wheel holds it."""
    base, ending = path.name.split(".", 1)
    return f"{base}-{hashlib.sha256(path.read_bytes()).hexdigest()[:8]}.{ending}"
