"""Autotools (UCX): autogen.sh when the tree has no configure (git archives), an out-of-tree
configure with every feature stated explicitly, make, make install."""
from __future__ import annotations

from ..options import flags
from .step import Step


def steps(comp) -> list[Step]:
    src, build = comp.src_dir, comp.build_dir
    configure = [str(src / "configure"), f"--prefix={comp.install_dir}",
                 *flags("with", comp.spec.get("with", {})),
                 *flags("enable", comp.spec.get("enable", {})),
                 *comp.spec.get("configure_args", [])]
    return [
        Step("configure", "autogen", ("./autogen.sh",), cwd=src, unless_exists=src / "configure"),
        Step("configure", "configure", tuple(configure), cwd=build),
        Step("build", "make", ("make", f"-j{comp.jobs}"), cwd=build),
        Step("install", "make-install", ("make", "install"), cwd=build),
    ]
