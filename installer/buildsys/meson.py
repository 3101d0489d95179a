"""Meson/ninja (NIXL): the pinned subproject archives go into subprojects/packagecache first,
then meson runs with --wrap-mode=nodownload, so nothing downloads after the fetch phase."""
from __future__ import annotations

from ..options import flags
from . import filemap
from .step import Step

# meson's compiler-argument options, for C and C++ (its subprojects get them too)
COMPILER_ARGS = ("c_args", "cpp_args")


def steps(comp) -> list[Step]:
    src, build = comp.src_dir, comp.build_dir
    options = dict(comp.spec.get("options", {}))
    # the file-prefix maps (filemap.py) after what the recipe gives these options
    root = comp.install_dir.parent
    options.update({k: filemap.joined(root, options.get(k)) for k in COMPILER_ARGS})
    setup = ["meson", "setup", str(build), str(src), f"--prefix={comp.install_dir}", "--libdir=lib",
             "--wrap-mode=nodownload", *flags("meson", options), *comp.spec.get("meson_args", [])]
    out = []
    if comp.subprojects:
        out.append(Step("configure", "subprojects", action="stage-subprojects",
                        args={"into": src / "subprojects" / "packagecache",
                              "files": ", ".join(comp.subprojects)}))
    out += [
        Step("configure", "meson-setup", tuple(setup), cwd=src),
        Step(
            "build", "meson-compile", ("meson", "compile", "-C", str(build), "-j", str(comp.jobs))
        ),
        Step("install", "meson-install", ("meson", "install", "-C", str(build), "--quiet")),
    ]
    return out
