"""Recipe option tables to command-line flags: one table-driven helper for every build system.

    with     {ze = "yes", java = false}       -> --with-ze=yes --without-java
    enable   {mt = true, debug = false}       -> --enable-mt --disable-debug
    meson    {build_tests = false, x = "UCX"} -> -Dbuild_tests=false -Dx=UCX
    cmake    {BUILD_TESTING = false}          -> -DBUILD_TESTING=OFF
"""
from __future__ import annotations

from typing import Callable, Mapping

Value = bool | str

# style -> (render True, render False, render a string)
FLAG_STYLES: dict[
    str, tuple[Callable[[str], str], Callable[[str], str], Callable[[str, str], str]]
] = {
    "with": (lambda k: f"--with-{k}", lambda k: f"--without-{k}", lambda k, v: f"--with-{k}={v}"),
    "enable": (
        lambda k: f"--enable-{k}",
        lambda k: f"--disable-{k}",
        lambda k, v: f"--enable-{k}={v}",
    ),
    "meson": (lambda k: f"-D{k}=true", lambda k: f"-D{k}=false", lambda k, v: f"-D{k}={v}"),
    "cmake": (lambda k: f"-D{k}=ON", lambda k: f"-D{k}=OFF", lambda k, v: f"-D{k}={v}"),
}


def flags(style: str, table: Mapping[str, Value]) -> list[str]:
    on, off, valued = FLAG_STYLES[style]
    out = []
    for key, value in table.items():
        if value is True:
            out.append(on(key))
        elif value is False:
            out.append(off(key))
        else:
            out.append(valued(key, value))
    return out
