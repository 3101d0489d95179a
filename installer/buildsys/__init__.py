"""Build systems. Each module turns one recipe component into the steps that build and install
it (`steps`), pure data that the plan shows before anything runs."""
from __future__ import annotations

from . import autotools, cmake, headers, make, meson

STEP_MAKERS = {
    "autotools": autotools.steps,
    "meson": meson.steps,
    "cmake": cmake.steps,
    "headers": headers.steps,
    "make": make.steps,
}
