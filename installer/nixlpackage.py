"""kvstack's `nixl` package (installer/nixl_alias.py, with its CONFIG filled in) beside the NIXL
module a build made: in the build's site-packages (install) and in its wheel (wheel.py), so
`import nixl`, as engines import NIXL, is this build's backend and nothing else."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from . import envfile
from .errors import PrefixError

PACKAGE = "nixl"
TEMPLATE = Path(__file__).with_name("nixl_alias.py")
MARKER = "CONFIG = {}"
# what the package says it is bound to; the backend's name is checked again where it is used
BACKEND = re.compile(r"nixl_(cpu|xpu|cu\d+)")


def source(backend: str, platform: str, build_id: str) -> str:
    """The package's __init__.py for this build."""
    if not BACKEND.fullmatch(backend):
        raise PrefixError(f"NIXL module {backend!r} is not one of nixl_cpu, nixl_xpu, nixl_cuN",
                          fix="install again: the build's module name is unexpected")
    config: dict[str, Any] = {"backend": backend, "platform": str(platform),
                              "build_id": str(build_id)}
    text = TEMPLATE.read_text()
    if text.count(MARKER) != 1:
        raise AssertionError(f"{TEMPLATE} must hold {MARKER!r} once")
    return text.replace(MARKER, f"CONFIG = {config!r}", 1)


def is_kvstack(package: Path) -> bool:
    """Whether `package` (a directory named nixl) is one of ours, not NIXL's meta package."""
    try:
        head = (package / "__init__.py").read_text(errors="replace")[:400]
    except OSError:
        return False
    return head.startswith('"""kvstack\'s `nixl` package')


def write(site: Path, backend: str, platform: str, build_id: str) -> Path:
    """site/nixl/__init__.py for this build (replacing an older one of ours, atomically)."""
    text = source(backend, platform, build_id)  # refuses a bad name before anything is written
    package = site / PACKAGE
    if package.exists() and not is_kvstack(package):
        raise PrefixError(f"{package} exists and is not kvstack's nixl package",
                          fix=f"remove {package} (another NIXL's) and install again")
    package.mkdir(exist_ok=True)
    init = package / "__init__.py"
    tmp = init.with_suffix(".py.tmp")
    tmp.write_text(text)
    os.replace(tmp, init)
    return init


def site_for(build_dir: Path, backend: str, platform: str, build_id: str, into: Path) -> Path:
    """The directory from which `import nixl` is the build's: its own site-packages when the
    install wrote the package there, else `into`, given the package now and a link to the build's
    module beside it (a build installed before kvstack wrote the package; the build is only
    read)."""
    site = envfile.nixl_site_packages(build_dir)
    if site is None or not (site / backend / "__init__.py").is_file():
        raise PrefixError(f"{build_dir} holds no NIXL module {backend!r}", fix="install again")
    if is_kvstack(site / PACKAGE):
        return site
    into.mkdir(parents=True, exist_ok=True)
    link = into / backend
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(site / backend, target_is_directory=True)
    write(into, backend, platform, build_id)
    return into
