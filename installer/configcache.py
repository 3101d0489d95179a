"""Autoconf results kept per toolchain, so a component configured before with the same flags on the
same host answers its configure checks from the cache ("(cached)") instead of compiling a test
program each (UCX's configure: ~17 s on 2 cores, ~55 s on the 16-core CUDA host).

How, without changing what is built: the configure step runs with CONFIG_SITE naming a site
script in its build directory that only sets `cache_file` (the autoconf manual's "a site file can
define a default cache file"), so the command line — which UCX compiles into libucs as
UCX_CONFIGURE_FLAGS — stays the same as without a cache. Before configure, the entry for this
key is copied there (when there is one); after a successful configure, the file is stored back
under the key (atomically, so two installers never see half a file).

The key: the configure arguments but --prefix (the install directory holds the build id, and no
check depends on it), the source's pin, every variable configure reads from the environment
(compilers, flags, PATH, pkg-config paths), the identity of the compilers on that PATH (`-v`:
version and configuration), the host's package state (the dpkg or rpm database), so that
installing or upgrading a -dev package starts a new entry, and what the directories that
`--with-X=DIR` names hold (names, sizes, times of DIR/include and DIR/lib*: a CUDA installed by
NVIDIA's runfile is no package). A host whose package state cannot be
read gets no cache: configure runs every check, as it always did."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path


SITE_FILE = "kvstack-config.site"
CACHE_FILE = "config.cache"
ENV_READ = ("CC", "CXX", "CPP", "CXXCPP", "CFLAGS", "CXXFLAGS", "CPPFLAGS", "LDFLAGS", "LIBS", "PATH",
            "PKG_CONFIG", "PKG_CONFIG_PATH", "PKG_CONFIG_LIBDIR", "LD_LIBRARY_PATH", "CUDA_HOME", "LC_ALL")
COMPILERS = ("cc", "gcc", "c++", "g++", "cpp")
PACKAGE_DBS = (Path("/var/lib/dpkg/status"), Path("/var/lib/rpm/rpmdb.sqlite"), Path("/var/lib/rpm/Packages"))


def key(configure_argv: list[str], source_pin: str, env: dict[str, str]) -> str | None:
    packages = _package_state()
    if packages is None:
        return None
    args = [a for a in configure_argv[1:] if not a.startswith("--prefix=")]
    material = {"args": args, "source": source_pin, "packages": packages, "dirs": _with_dirs(args),
                "env": {k: env.get(k) for k in ENV_READ},
                "compilers": {c: _compiler_identity(c, env) for c in (env.get("CC"), env.get("CXX"), *COMPILERS) if c}}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:24]


def restore(cache_dir: Path, build_dir: Path, key_: str | None) -> str:
    """Write the site script into build_dir and put the cached results beside it. Returns what
    happened, for the step's log."""
    build_dir.mkdir(parents=True, exist_ok=True)
    site = build_dir / SITE_FILE
    if key_ is None:
        site.write_text("# kvstack: no autoconf cache (this host's package state cannot be read)\n")
        return "no cache: the host's package database (dpkg, rpm) was not found"
    site.write_text(f"# kvstack: autoconf results kept per toolchain, key {key_}\ncache_file={build_dir / CACHE_FILE}\n")
    entry = _entry(cache_dir, key_)
    if entry.is_file():
        shutil.copyfile(entry, build_dir / CACHE_FILE)
        return f"cached results from {entry}"
    return f"no entry {entry} yet: configure runs every check and the results are kept"


def save(cache_dir: Path, build_dir: Path, key_: str | None) -> str:
    produced = build_dir / CACHE_FILE
    if key_ is None or not produced.is_file():
        return "nothing to keep"
    entry = _entry(cache_dir, key_)
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
    shutil.copyfile(produced, tmp)
    os.replace(tmp, entry)
    return f"kept as {entry}"


def _entry(cache_dir: Path, key_: str) -> Path:
    return cache_dir / "autoconf" / f"{key_}.cache"


def _package_state() -> str | None:
    for db in PACKAGE_DBS:
        try:
            h = hashlib.sha256()
            with open(db, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            return f"{db}:{h.hexdigest()}"
        except OSError:
            continue
    return None


def _with_dirs(args: list[str]) -> dict[str, list]:
    out: dict[str, list] = {}
    for arg in args:
        if arg.startswith("--with-") and "=" in arg and os.path.isabs(arg.split("=", 1)[1]):
            root = Path(arg.split("=", 1)[1])
            for sub in ("include", "lib", "lib64"):
                try:
                    out[str(root / sub)] = sorted((e.name, e.stat(follow_symlinks=False).st_size,
                                                   e.stat(follow_symlinks=False).st_mtime_ns)
                                                  for e in os.scandir(root / sub))
                except OSError:
                    continue
    return out


def _compiler_identity(name: str, env: dict[str, str]) -> str | None:
    exe = shutil.which(name.split()[0], path=env.get("PATH"))
    if exe is None:
        return None
    try:
        r = subprocess.run([exe, "-v"], capture_output=True, text=True, timeout=30, env=env)
    except (OSError, subprocess.SubprocessError):
        return f"{os.path.realpath(exe)} (does not run)"
    return f"{os.path.realpath(exe)}\n{r.stdout}{r.stderr}"
