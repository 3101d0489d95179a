"""System build dependencies from the recipe's per-distro table. As root the installer installs
what is missing (apt); otherwise it stops and prints the exact command."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

from .errors import SystemPackagesError

log = logging.getLogger("kvstack.installer")
DEBIAN_LIKE = {"debian", "ubuntu"}
# Packages that exist to put a tool on PATH: any usable one counts, wherever it came from (a
# cmake or ninja from pip, a compiler from a devtoolset). Header/library packages are asked of
# dpkg only.
TOOLS = {
    "autoconf": ("autoconf",), "automake": ("automake",), "libtool": ("libtoolize",),
    "make": ("make",), "gcc": ("gcc", "cc"), "g++": ("g++", "c++"),
    "pkg-config": ("pkg-config", "pkgconf"), "pkgconf": ("pkgconf", "pkg-config"),
    "cmake": ("cmake",), "ninja-build": ("ninja",), "git": ("git",),
}


def _tool_on_path(package: str) -> str | None:
    """The first usable tool that stands for ``package`` (answers --version), or None."""
    for name in TOOLS.get(package, ()):
        path = shutil.which(name)
        if path and subprocess.run([path, "--version"], capture_output=True).returncode == 0:
            return path
    return None


def looked_for(package: str) -> str:
    tools = TOOLS.get(package)
    return (f"{package} (dpkg, or {' / '.join(tools)} on PATH)" if tools else f"{package} (dpkg)")


def distro_family(os_release: Path = Path("/etc/os-release")) -> str | None:
    try:
        fields = dict(line.split("=", 1) for line in os_release.read_text().splitlines() if "=" in line)
    except OSError:
        return None
    ids = {fields.get("ID", "").strip('"')} | set(fields.get("ID_LIKE", "").strip('"').split())
    return "debian" if ids & DEBIAN_LIKE else None


def missing_debian(packages: list[str]) -> list[str]:
    """Packages neither installed (dpkg) nor, for tool packages, present as a usable tool."""
    res = subprocess.run(["dpkg-query", "-W", "-f=${Package} ${db:Status-Abbrev}\n", *packages],
                         capture_output=True, text=True)
    installed = {line.split()[0] for line in res.stdout.splitlines()
                 if len(line.split()) >= 2 and line.split()[1] == "ii"}
    return [p for p in packages if p not in installed and _tool_on_path(p) is None]


def apt_command(packages: list[str]) -> list[str]:
    return ["apt-get", "install", "-y", "--no-install-recommends", *packages]


def ensure(table: dict[str, dict[str, str]], *, mode: str, log_path: Path,
           family: str | None = None, is_root: bool | None = None) -> dict:
    """Make sure the recipe's packages for this distro are there; return the manifest record."""
    family = family if family is not None else distro_family()
    if family is None or family not in table:
        wanted = sorted(next(iter(table.values()), {}))
        absent = [p for p in wanted if p in TOOLS and _tool_on_path(p) is None]
        log.warning("system packages: no list for this distribution; tools not found on PATH: %s; "
                    "also needed (not checked): %s", ", ".join(absent) or "none",
                    ", ".join(p for p in wanted if p not in TOOLS))
        return {"family": family, "checked": False, "tools_missing": absent}
    wanted = list(table[family])
    missing = missing_debian(wanted)
    record = {"family": family, "wanted": wanted, "missing": missing, "installed": []}
    if not missing:
        return record
    is_root = os.geteuid() == 0 if is_root is None else is_root
    command = apt_command(missing)
    if mode == "ignore":
        log.warning("system packages missing, going on anyway (--system-packages ignore): %s", " ".join(missing))
        record["ignored"] = True
        return record
    if mode == "check" or not is_root:
        why = "--system-packages check was given" if mode == "check" else "not running as root"
        raise SystemPackagesError(f"missing system packages: {' '.join(missing)} ({why}; looked for "
                                  f"{', '.join(looked_for(p) for p in missing)})",
                                  fix=f"run: {'' if is_root else 'sudo '}apt-get update && {' '.join(command)}")
    log.info("installing system packages: %s", " ".join(missing))
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as logf:
        for cmd in (["apt-get", "update"], command):
            logf.write(f"$ {' '.join(cmd)}\n")
            logf.flush()
            rc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env).returncode
            if rc != 0:
                raise SystemPackagesError(f"`{' '.join(cmd)}` failed with exit code {rc}", log=str(log_path),
                                          fix="read the log; fix the package source, then run again")
    still = missing_debian(missing)
    if still:
        raise SystemPackagesError(f"apt-get did not install: {' '.join(still)}", log=str(log_path))
    record["installed"] = missing
    return record
