"""Autotools (UCX): autogen.sh when the tree has no configure (git archives; what it writes kept
per source and autotools, installer/configcache.py), an out-of-tree
configure with every feature stated explicitly — its check results kept per toolchain
(installer/configcache.py) — then make and make install, of the whole tree, or only of the
recipe's `make_dirs` / `install_dirs` / `install_targets`."""
from __future__ import annotations

from ..configcache import SITE_FILE
from ..options import flags
from . import filemap
from .step import Step


def steps(comp) -> list[Step]:
    src, build, spec = comp.src_dir, comp.build_dir, comp.spec
    configure = [str(src / "configure"), f"--prefix={comp.install_dir}",
                 *flags("with", spec.get("with", {})), *flags("enable", spec.get("enable", {})),
                 *spec.get("configure_args", [])]
    out = [
        Step("configure", "autogen-cache", action="autogen-cache-restore", args={"src_dir": src}),
        Step("configure", "autogen", ("./autogen.sh",), cwd=src, unless_exists=src / "configure"),
        Step("configure", "autogen-cache-keep", action="autogen-cache-keep", args={"src_dir": src}),
        Step(
            "configure",
            "autoconf-cache",
            action="autoconf-cache-restore",
            args={"build_dir": build},
        ),
        Step("configure", "configure", tuple(configure), cwd=build, env=_configure_env(comp)),
        Step(
            "configure",
            "autoconf-cache-keep",
            action="autoconf-cache-keep",
            args={"build_dir": build},
        ),
    ]
    make_dirs = spec.get("make_dirs", [])
    out += [
        Step("build", _name("make", d), ("make", f"-j{comp.jobs}", "-C", d), cwd=build)
        for d in make_dirs
    ] or [Step("build", "make", ("make", f"-j{comp.jobs}"), cwd=build)]
    install_dirs = spec.get("install_dirs", [])
    out += [
        Step("install", _name("install", d), ("make", "-C", d, "install"), cwd=build)
        for d in install_dirs
    ] or [Step("install", "make-install", ("make", "install"), cwd=build)]
    out += [
        Step("install", _name("install", t), ("make", t), cwd=build)
        for t in spec.get("install_targets", [])
    ]
    return out


def _configure_env(comp) -> dict[str, str]:
    """The site script that names the autoconf cache, and the file-prefix maps (filemap.py) in
    CPPFLAGS, which every C and C++ compile of the tree gets. From the environment, not the command
    line: UCX compiles its command line into ucx_info (UCX_CONFIGURE_FLAGS), and not in CFLAGS:
    given CFLAGS, autoconf drops its default -g -O2, which is what UCX compiled with."""
    maps = filemap.joined(comp.install_dir.parent, comp.env.get("CPPFLAGS"))
    return {"CONFIG_SITE": str(comp.build_dir / SITE_FILE), "CPPFLAGS": maps}


def _name(verb: str, what: str) -> str:
    return f"{verb}-{what.replace('/', '-')}"
