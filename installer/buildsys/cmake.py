"""CMake (Abseil, the Level Zero null driver): configure with Ninja, build, install. With
`pkgconfig_modules`, only those modules and what they require are built and installed
(installer/buildsys/pkgconfig.py)."""
from __future__ import annotations

from ..options import flags
from . import filemap
from .pkgconfig import TARGETS_FILE
from .step import Step

COMPILER_FLAGS = ("CMAKE_C_FLAGS", "CMAKE_CXX_FLAGS")


def steps(comp) -> list[Step]:
    src, build = comp.src_dir, comp.build_dir
    defines = dict(comp.spec.get("defines", {}))
    # the file-prefix maps (filemap.py) after what the recipe gives these
    root = comp.install_dir.parent
    defines.update({k: filemap.joined(root, defines.get(k)) for k in COMPILER_FLAGS})
    configure = ["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja",
                 f"-DCMAKE_INSTALL_PREFIX={comp.install_dir}", "-DCMAKE_INSTALL_LIBDIR=lib",
                 *flags("cmake", defines)]
    out = [Step("configure", "cmake-configure", tuple(configure))]
    modules = comp.spec.get("pkgconfig_modules", [])
    if modules:
        args = {"build_dir": build, "modules": ",".join(modules)}
        return out + [
            Step("configure", "pkgconfig-closure", action="pkgconfig-closure", args=args),
            Step(
                "build",
                "cmake-build",
                (
                    "sh",
                    "-c",
                    f'exec cmake --build "$0" -j "$1" --target $(cat "$0/{TARGETS_FILE}")',
                    str(build),
                    str(comp.jobs),
                ),
            ),
            # the top directory's rules only (headers and the like); the libraries come next
            Step(
                "install",
                "cmake-install-top",
                (
                    "cmake",
                    "-DCMAKE_INSTALL_LOCAL_ONLY=ON",
                    "-P",
                    str(build / "cmake_install.cmake"),
                ),
            ),
            Step(
                "install",
                "install-closure",
                action="pkgconfig-install",
                args={**args, "install_dir": comp.install_dir},
            ),
        ]
    targets = comp.spec.get("cmake_targets", [])
    build_cmd = ["cmake", "--build", str(build), "-j", str(comp.jobs)]
    for t in targets:
        build_cmd += ["--target", t]
    out.append(Step("build", "cmake-build", tuple(build_cmd)))
    if not targets:
        out.append(Step("install", "cmake-install", ("cmake", "--install", str(build))))
    return out
