"""File-prefix maps: every compile of a build runs with the build's own directory mapped to
".", so no path of it is compiled into a binary. What the compilers would otherwise write there:
__FILE__ in log and assertion messages (UCX's, and Abseil's inside NIXL's libraries), the source
and build trees in debug information, the headers of components installed before (NIXL includes
UCX's and Abseil's from the build). With the map they read ./.work/src/ucx/src/ucs/async/async.c
or ./ucx/include/ucs/type/status.h: the same in every build whatever its prefix and id, which is
reproducible-builds practice, and UCX's messages keep their file names in a wheel.

UCX's module and configuration directories are no file names but configure's install directories,
compiled in as strings: the wheel and the binary cache repoint those (installer/ucxdirs.py)."""
from __future__ import annotations

import shlex
from pathlib import Path

MAPPED_TO = "."


def flags(build_root: Path) -> list[str]:
    """-ffile-prefix-map implies the macro (__FILE__) and debug-information maps in GCC >= 8 and
    Clang >= 10; the macro map is also given on its own, for compilers that take only that one."""
    return [f"-f{kind}-prefix-map={build_root}={MAPPED_TO}" for kind in ("file", "macro")]


def joined(build_root: Path, before: str | None = None) -> str:
    """The flags as one shell-quoted string, after what a variable held before (CPPFLAGS, ...)."""
    return " ".join(filter(None, [before, shlex.join(flags(build_root))]))
