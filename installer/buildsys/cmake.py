"""CMake (Abseil, the Level Zero null driver): configure with Ninja, build, install."""
from __future__ import annotations

from ..options import flags
from .step import Step


def steps(comp) -> list[Step]:
    src, build = comp.src_dir, comp.build_dir
    configure = ["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja",
                 f"-DCMAKE_INSTALL_PREFIX={comp.install_dir}", "-DCMAKE_INSTALL_LIBDIR=lib",
                 *flags("cmake", comp.spec.get("defines", {}))]
    targets = comp.spec.get("cmake_targets", [])
    build_cmd = ["cmake", "--build", str(build), "-j", str(comp.jobs)]
    for t in targets:
        build_cmd += ["--target", t]
    out = [Step("configure", "cmake-configure", tuple(configure)),
           Step("build", "cmake-build", tuple(build_cmd))]
    if not targets:
        out.append(Step("install", "cmake-install", ("cmake", "--install", str(build))))
    return out
