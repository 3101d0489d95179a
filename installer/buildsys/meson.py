"""Meson/ninja (NIXL): the pinned subproject archives go into subprojects/packagecache first,
then meson runs with --wrap-mode=nodownload, so nothing downloads after the fetch phase."""
from __future__ import annotations

from ..options import flags
from .step import Step


def steps(comp) -> list[Step]:
    src, build = comp.src_dir, comp.build_dir
    setup = ["meson", "setup", str(build), str(src), f"--prefix={comp.install_dir}", "--libdir=lib",
             "--wrap-mode=nodownload", *flags("meson", comp.spec.get("options", {})),
             *comp.spec.get("meson_args", [])]
    out = []
    if comp.subprojects:
        out.append(Step("configure", "subprojects", action="stage-subprojects",
                        args={"into": src / "subprojects" / "packagecache",
                              "files": ", ".join(comp.subprojects)}))
    out += [
        Step("configure", "meson-setup", tuple(setup), cwd=src),
        Step("build", "meson-compile", ("meson", "compile", "-C", str(build), "-j", str(comp.jobs))),
        Step("install", "meson-install", ("meson", "install", "-C", str(build), "--quiet")),
    ]
    return out
