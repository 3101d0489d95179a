"""Plain make (gdrcopy's user library): no configure step; the recipe's `make_targets`, then its
`install_targets`, each with the recipe's `make_vars` (NAME=value) on make's command line. In the
source tree, since such Makefiles build in place."""
from __future__ import annotations

from .step import Step


def steps(comp) -> list[Step]:
    src, spec = comp.src_dir, comp.spec
    variables = tuple(f"{k}={v}" for k, v in spec.get("make_vars", {}).items())
    out = [Step("build", f"make-{t}", ("make", f"-j{comp.jobs}", "-C", str(src), *variables, t))
           for t in spec.get("make_targets", [])]
    out += [Step("install", f"make-{t}", ("make", "-C", str(src), *variables, t))
            for t in spec.get("install_targets", ["install"])]
    return out
