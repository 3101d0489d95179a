"""System build dependencies from the recipe's per-distro table. As root the installer installs
what is missing (apt); otherwise it stops and prints the exact command.

A package counts by what it provides: a tool package is there when dpkg has it installed OR a
usable tool of its name is on PATH (a cmake from pip, a compiler from a module system), so hosts
whose tools come from elsewhere are not told to apt-get what they already have."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

from .errors import SystemPackagesError

log = logging.getLogger("kvstack.installer")
DEBIAN_LIKE = {"debian", "ubuntu"}
# package -> the executables any one of which does its job here (libraries and headers: dpkg only)
PROVIDES: dict[str, tuple[str, ...]] = {
    "autoconf": ("autoconf",), "automake": ("automake",), "libtool": ("libtoolize",), "make": ("make",),
    "gcc": ("gcc",), "g++": ("g++",), "pkg-config": ("pkg-config", "pkgconf"), "pkgconf": ("pkgconf", "pkg-config"),
    "cmake": ("cmake",), "git": ("git",), "ninja-build": ("ninja",), "patchelf": ("patchelf",),
}


def provided_on_path(packages: list[str], path: str | None = None,
                     provides: dict[str, tuple[str, ...]] = PROVIDES) -> dict[str, str]:
    """{package: the executable on PATH that provides it} for the packages that have one."""
    found = {}
    for pkg in packages:
        for tool in provides.get(pkg, ()):
            where = shutil.which(tool, path=path)
            if where:
                found[pkg] = where
                break
    return found


def looked_for(packages: list[str], provides: dict[str, tuple[str, ...]] = PROVIDES) -> str:
    return ", ".join(f"{p} (dpkg" + (f" or {'/'.join(provides[p])} on PATH)" if p in provides else ")") for p in packages)


def distro_family(os_release: Path = Path("/etc/os-release")) -> str | None:
    try:
        fields = dict(line.split("=", 1) for line in os_release.read_text().splitlines() if "=" in line)
    except OSError:
        return None
    ids = {fields.get("ID", "").strip('"')} | set(fields.get("ID_LIKE", "").strip('"').split())
    return "debian" if ids & DEBIAN_LIKE else None


def missing_debian(packages: list[str]) -> list[str]:
    res = subprocess.run(["dpkg-query", "-W", "-f=${Package} ${db:Status-Abbrev}\n", *packages],
                         capture_output=True, text=True)
    installed = {line.split()[0] for line in res.stdout.splitlines()
                 if len(line.split()) >= 2 and line.split()[1] == "ii"}
    return [p for p in packages if p not in installed]


def apt_command(packages: list[str]) -> list[str]:
    return ["apt-get", "install", "-y", "--no-install-recommends", *packages]


def ensure(table: dict[str, dict[str, str]], *, mode: str, log_path: Path,
           family: str | None = None, is_root: bool | None = None, path: str | None = None,
           provides: dict[str, tuple[str, ...]] = PROVIDES) -> dict:
    """Make sure the recipe's packages for this distro are there; return the manifest record."""
    family = family if family is not None else distro_family()
    if family is None or family not in table:
        log.warning("system packages: no list for this distribution; make sure these tools exist: %s",
                    ", ".join(sorted(next(iter(table.values()), {}))))
        return {"family": family, "checked": False}
    wanted = list(table[family])
    not_in_dpkg = missing_debian(wanted)
    on_path = provided_on_path(not_in_dpkg, path, provides)
    missing = [p for p in not_in_dpkg if p not in on_path]
    record = {"family": family, "wanted": wanted, "missing": missing, "installed": [], "provided_by_path": on_path}
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
        raise SystemPackagesError(f"missing system packages: {' '.join(missing)} ({why}); looked for: "
                                  f"{looked_for(missing, provides)}",
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
