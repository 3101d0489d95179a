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
import tarfile
import time
from pathlib import Path

SITE_FILE = "kvstack-config.site"
AUTOGEN_MARK = ".kvstack-autogen-start"  # in a source tree while its autogen.sh runs
AUTOTOOLS = ("autoconf", "autoheader", "automake", "aclocal", "libtoolize", "m4", "autoreconf")
CACHE_FILE = "config.cache"
ENV_READ = (
    "CC",
    "CXX",
    "CPP",
    "CXXCPP",
    "CFLAGS",
    "CXXFLAGS",
    "CPPFLAGS",
    "LDFLAGS",
    "LIBS",
    "PATH",
    "PKG_CONFIG",
    "PKG_CONFIG_PATH",
    "PKG_CONFIG_LIBDIR",
    "LD_LIBRARY_PATH",
    "CUDA_HOME",
    "LC_ALL",
)
COMPILERS = ("cc", "gcc", "c++", "g++", "cpp")
PACKAGE_DBS = (
    Path("/var/lib/dpkg/status"),
    Path("/var/lib/rpm/rpmdb.sqlite"),
    Path("/var/lib/rpm/Packages"),
)


def key(configure_argv: list[str], source_pin: str, env: dict[str, str]) -> str | None:
    packages = _package_state()
    if packages is None:
        return None
    args = [a for a in configure_argv[1:] if not a.startswith("--prefix=")]
    material = {
        "args": args,
        "source": source_pin,
        "packages": packages,
        "dirs": _with_dirs(args),
        "env": {k: env.get(k) for k in ENV_READ},
        "compilers": {
            c: _identity(c, env) for c in (env.get("CC"), env.get("CXX"), *COMPILERS) if c
        },
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:24]


def restore(cache_dir: Path, build_dir: Path, key_: str | None) -> str:
    """Write the site script into build_dir and put the cached results beside it. Returns what
    happened, for the step's log."""
    build_dir.mkdir(parents=True, exist_ok=True)
    site = build_dir / SITE_FILE
    if key_ is None:
        site.write_text("# kvstack: no autoconf cache (this host's package state cannot be read)\n")
        return "no cache: the host's package database (dpkg, rpm) was not found"
    site.write_text(
        "# kvstack: autoconf results kept per toolchain, key "
        f"{key_}\ncache_file={build_dir / CACHE_FILE}\n"
    )
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


def _identity(name: str, env: dict[str, str], ask: str = "-v") -> str | None:
    """Which ``name`` on the build's PATH, and what it says of itself (``ask``: a compiler's
    ``-v``, a tool's ``--version``)."""
    exe = shutil.which(name.split()[0], path=env.get("PATH"))
    if exe is None:
        return None
    try:
        r = subprocess.run([exe, ask], capture_output=True, text=True, timeout=30, env=env)
    except (OSError, subprocess.SubprocessError):
        return f"{os.path.realpath(exe)} (does not run)"
    return f"{os.path.realpath(exe)}\n{r.stdout}{r.stderr}"


# -- autogen.sh's outputs ---------------------------------------------------------------------
# A source without configure (git archives: UCX's) runs autogen.sh first, ~30 s single-threaded
# on 2 cores. What it writes depends only on the source and the autotools, so the files it wrote
# (configure, Makefile.in, aclocal.m4, libtool's and automake's scripts) are kept per (source pin,
# autotools, package state) and a later build of the same source — another platform, or a run
# after a failed one — lays them over its fresh tree instead of running it (same files, later
# times than the sources', so make never re-runs autoconf).

def autogen_key(source_pin: str, env: dict[str, str]) -> str | None:
    packages = _package_state()
    if packages is None:
        return None
    tools = {t: _identity(t, env, "--version") for t in AUTOTOOLS}
    material = {"source": source_pin, "packages": packages, "tools": tools}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:24]


def autogen_restore(cache_dir: Path, src_dir: Path, key_: str | None) -> str:
    """Before autogen.sh: lay its kept outputs over ``src_dir`` (its configure then exists and
    the step is skipped), or mark the tree so that what the step writes can be kept after."""
    if (src_dir / "configure").exists():
        return "the source has its configure: autogen.sh does not run"
    if key_ is None:
        return "no cache: the host's package database (dpkg, rpm) was not found"
    entry = _autogen_entry(cache_dir, key_)
    if entry.is_file():
        from .extract import extract_safely

        try:
            with tarfile.open(entry, "r:gz") as tf:
                extract_safely(tf, tf.getmembers(), src_dir)
            return f"autogen.sh's outputs from {entry}"
        except (tarfile.TarError, OSError, EOFError) as e:  # a damaged entry: autogen.sh runs
            (src_dir / "configure").unlink(missing_ok=True)  # and rewrites what it laid down
            entry.unlink(missing_ok=True)
            said = f"the kept outputs {entry} could not be used ({e}): removed"
    else:
        said = f"no entry {entry} yet"
    (src_dir / AUTOGEN_MARK).write_text(f"{time.time_ns()}\n")
    return f"{said}: autogen.sh runs and what it writes is kept"


def autogen_keep(cache_dir: Path, src_dir: Path, key_: str | None) -> str:
    """After autogen.sh: the files it wrote or changed (newer than the mark), kept under the key
    (atomically)."""
    mark = src_dir / AUTOGEN_MARK
    if key_ is None or not mark.is_file():
        return "nothing to keep"
    since = int(mark.read_text().strip() or 0)
    mark.unlink()
    entry = _autogen_entry(cache_dir, key_)
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
    count = 0
    with tarfile.open(tmp, "w:gz", compresslevel=1) as tf:
        for path in sorted(src_dir.rglob("*")):
            st = path.lstat()
            if (path.is_symlink() or path.is_file()) and st.st_mtime_ns >= since:
                tf.add(path, arcname=path.relative_to(src_dir).as_posix(), recursive=False)
                count += 1
    os.replace(tmp, entry)
    return f"{count} files autogen.sh wrote kept as {entry}"


def _autogen_entry(cache_dir: Path, key_: str) -> Path:
    return cache_dir / "autogen" / f"{key_}.tar.gz"
