"""Header-only libraries (asio): copy the include tree and write a pkg-config file, which is all
a consumer's dependency() lookup needs."""
from __future__ import annotations

from .step import Step


def steps(comp) -> list[Step]:
    return [
        Step(
            "install",
            "copy-headers",
            action="copy-tree",
            args={
                "src": comp.src_dir / comp.spec.get("include_dir", "include"),
                "dst": comp.install_dir / "include",
            },
        ),
        Step(
            "install",
            "pkg-config",
            action="write-pkgconfig",
            args={
                "path": comp.install_dir
                / "lib"
                / "pkgconfig"
                / f"{comp.spec.get('pkgconfig_name', comp.name)}.pc",
                "version": comp.spec.get("version", "0"),
            },
        ),
    ]
