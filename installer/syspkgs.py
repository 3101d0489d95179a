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
    "autoconf": ("autoconf",),
    "automake": ("automake",),
    "libtool": ("libtoolize",),
    "make": ("make",),
    "gcc": ("gcc",),
    "g++": ("g++",),
    "pkg-config": ("pkg-config", "pkgconf"),
    "pkgconf": ("pkgconf", "pkg-config"),
    "cmake": ("cmake",),
    "git": ("git",),
    "ninja-build": ("ninja",),
    "patchelf": ("patchelf",),
}


# package -> the aclocal macro file that must come with its tool: libtoolize without libtool.m4
# where aclocal looks fails only in automake, as "LIBTOOL is undefined"
MACROS: dict[str, str] = {"libtool": "libtool.m4"}


def provided_on_path(packages: list[str], path: str | None = None,
                     provides: dict[str, tuple[str, ...]] = PROVIDES) -> dict[str, str]:
    """{package: the executable on PATH that provides it} for the packages that have one (with
    its aclocal macros where MACROS names them)."""
    found = {}
    for pkg in packages:
        for tool in provides.get(pkg, ()):
            where = shutil.which(tool, path=path)
            if where and (pkg not in MACROS or aclocal_finds(MACROS[pkg], path)):
                found[pkg] = where
                break
    return found


def aclocal_finds(macro_file: str, path: str | None = None) -> bool:
    """Whether the aclocal on PATH would find macro_file: in its own directory, the directories
    its `dirlist` names, or ACLOCAL_PATH. True without an aclocal (automake's own absence is
    reported for automake)."""
    aclocal = shutil.which("aclocal", path=path)
    if not aclocal:
        return True
    res = subprocess.run([aclocal, "--print-ac-dir"], capture_output=True, text=True)
    acdir = Path(res.stdout.strip()) if res.returncode == 0 and res.stdout.strip() else None
    dirs = [acdir] if acdir else []
    try:
        dirs += [Path(d) for d in (acdir / "dirlist").read_text().split()] if acdir else []
    except OSError:
        pass
    dirs += [Path(d) for d in os.environ.get("ACLOCAL_PATH", "").split(":") if d]
    return any((d / macro_file).is_file() for d in dirs)


def looked_for(packages: list[str], provides: dict[str, tuple[str, ...]] = PROVIDES,
               dpkg: bool = True) -> str:
    def where(p: str) -> str:
        if p not in provides:
            return "dpkg"
        tools = f"{'/'.join(provides[p])} on PATH"
        tools += f" with {MACROS[p]} for aclocal" if p in MACROS else ""
        return f"dpkg or {tools}" if dpkg else tools
    return ", ".join(f"{p} ({where(p)})" for p in packages)


def distro_family(os_release: Path = Path("/etc/os-release")) -> str | None:
    try:
        fields = dict(
            line.split("=", 1) for line in os_release.read_text().splitlines() if "=" in line
        )
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
        return _tools_only(table, mode, family, path, provides)
    wanted = list(table[family])
    not_in_dpkg = missing_debian(wanted)
    on_path = provided_on_path(not_in_dpkg, path, provides)
    missing = [p for p in not_in_dpkg if p not in on_path]
    record = {
        "family": family,
        "wanted": wanted,
        "missing": missing,
        "installed": [],
        "provided_by_path": on_path,
    }
    if not missing:
        return record
    is_root = os.geteuid() == 0 if is_root is None else is_root
    command = apt_command(missing)
    if mode == "ignore":
        log.warning(
            "system packages missing, going on anyway (--system-packages ignore): %s",
            " ".join(missing),
        )
        record["ignored"] = True
        return record
    if mode == "check" or not is_root:
        why = "--system-packages check was given" if mode == "check" else "not running as root"
        raise SystemPackagesError(
            f"missing system packages: {' '.join(missing)} ({why}); looked for: "
            f"{looked_for(missing, provides)}",
            fix=f"run: {'' if is_root else 'sudo '}apt-get update && {' '.join(command)}",
        )
    log.info("installing system packages: %s", " ".join(missing))
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as logf:
        for cmd in (["apt-get", "update"], command):
            logf.write(f"$ {' '.join(cmd)}\n")
            logf.flush()
            rc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env).returncode
            if rc != 0:
                raise SystemPackagesError(
                    f"`{' '.join(cmd)}` failed with exit code {rc}",
                    log=str(log_path),
                    fix="read the log; fix the package source, then run again",
                )
    still = missing_debian(missing)
    if still:
        raise SystemPackagesError(f"apt-get did not install: {' '.join(still)}", log=str(log_path))
    record["installed"] = missing
    return record


def _tools_only(table: dict[str, dict[str, str]], mode: str, family: str | None, path: str | None,
                provides: dict[str, tuple[str, ...]]) -> dict:
    """A distribution with no package list (no dpkg to ask, no apt to install with): the tools
    of the recipe's list are looked for on PATH, and a missing one is named before any build."""
    packages = sorted(next(iter(table.values()), {}))
    tools = [p for p in packages if p in provides]
    on_path = provided_on_path(tools, path, provides)
    missing = [p for p in tools if p not in on_path]
    log.warning("system packages: no list for this distribution; libraries and headers "
                "unchecked: %s",
                ", ".join(p for p in packages if p not in provides))
    record = {"family": family, "checked": "tools on PATH", "missing": missing,
              "provided_by_path": on_path}
    if missing and mode == "ignore":
        log.warning("build tools missing, going on anyway (--system-packages ignore): %s",
                    looked_for(missing, provides, dpkg=False))
        record["ignored"] = True
    elif missing:
        raise SystemPackagesError(f"missing build tools: {' '.join(missing)}; looked for: "
                                  f"{looked_for(missing, provides, dpkg=False)}",
                                  fix="install them with this distribution's package manager "
                                      "(the recipe's system_packages list names Debian's), then "
                                      "run again")
    return record
