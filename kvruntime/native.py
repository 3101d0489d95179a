"""kvruntime's one native helper, ``csrc/idscan.c``: block-id lists read in one C pass, and a
request's (or a batch's) ids split into runs with their range and duplicate checks in another;
and the host staging pools' copies (a request's pieces gathered into a run or scattered out of
it, with the GIL released: staging.py).

Built on first use with the host's C compiler against this Python's headers, the way Triton
builds its launchers, and kept in a cache keyed by the source and the Python (version and ABI:
the library calls nothing but Python's C API); a later process loads it in about a millisecond,
with or without a compiler. So an image builds it once where compilers are and carries the
cache to where they are not (Containerfile). Where it is neither cached nor buildable, or
``KVRUNTIME_NATIVE=0``, it is off and plan.py reads lists through ``array('q')`` and plans in
numpy: slower, same results (tests/unit/kvruntime/test_native.py and test_plan_vectorized.py
hold both to that).

The cache is ``$KVRUNTIME_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvruntime``, else
``~/.cache/kvruntime``. A library there is loaded only when it and its folder belong to this
user or to root and neither is writable by anyone else: whoever can replace it could run code
in every process that plans a transfer.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shlex
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path

from .options import environment

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "idscan.c"
MODULE = "_kvr_idscan"
BUILD_SECONDS = 120
FUNCTIONS = ("scan", "scan_batch", "runs", "copy")

_lock = threading.Lock()
_state: dict = {}  # FUNCTIONS: each function or None; "how": one line, what happened


def id_scan():
    """``scan(ids, out)`` of csrc/idscan.c, or None where it cannot be had (``status`` says
    why). The first call builds or loads it; later calls return what that found."""
    try:
        return _state["scan"]
    except KeyError:
        return _module()["scan"]


def id_runs():
    """``runs(ids, bounds, seen, src_blocks, dst_blocks, out, run_bounds)`` of csrc/idscan.c,
    or None where it cannot be had (as ``id_scan``)."""
    try:
        return _state["runs"]
    except KeyError:
        return _module()["runs"]


def id_scan_batch():
    """``scan_batch(requests, bounds)`` of csrc/idscan.c, or None where it cannot be had (as
    ``id_scan``)."""
    try:
        return _state["scan_batch"]
    except KeyError:
        return _module()["scan_batch"]


def piece_copy():
    """``copy(dst, src, length)`` of csrc/idscan.c, or None where it cannot be had (as
    ``id_scan``): staging.py then copies piece by piece through ctypes."""
    try:
        return _state["copy"]
    except KeyError:
        return _module()["copy"]


def _module() -> dict:
    with _lock:
        if "how" not in _state:
            mod, how = _load()
            # "how" last: it marks the functions as looked up (a reader without the lock who
            # misses a function comes here and waits for the lock)
            _state.update({name: getattr(mod, name, None) for name in FUNCTIONS})
            _state["how"] = how
            (log.debug if mod is not None else log.info)("native id reader: %s", how)
    return _state


def status() -> str:
    """One line: where the id reader came from, or why it is off (bench and selftest say it)."""
    id_scan()
    return _state["how"]


def cache_dir() -> Path:
    if environment("KVRUNTIME_CACHE_DIR"):
        return Path(environment("KVRUNTIME_CACHE_DIR"))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvruntime"


def _load():
    if environment("KVRUNTIME_NATIVE") == "0":
        return None, "off (KVRUNTIME_NATIVE=0): block-id lists are read by array('q')"
    try:
        source = SOURCE.read_bytes()
    except OSError as exc:
        return None, f"off: cannot read {SOURCE} ({exc.strerror})"
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    key = hashlib.sha256(b"\0".join([source, sys.version.encode(), suffix.encode()]))
    key = key.hexdigest()[:16]
    folder = cache_dir()
    target = folder / f"{MODULE}-{key}{suffix}"
    try:
        if target.exists():
            how = f"loaded {target}"
        else:
            compiler = shlex.split(os.environ.get("CC") or "cc")
            found = shutil.which(compiler[0]) if compiler else None
            include = sysconfig.get_paths().get("include") or ""
            if found is None:
                return None, (f"off: no C compiler ({compiler[0] if compiler else 'CC is empty'}) "
                              f"and no {target.name} in {folder}; install one (e.g. apt-get "
                              f"install gcc) to read block-id lists faster")
            if not os.path.isfile(os.path.join(include, "Python.h")):
                return None, (f"off: no Python.h under {include or '?'}; install this Python's "
                              f"headers (e.g. apt-get install python3-dev) to read block-id "
                              f"lists faster")
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            why = _untrusted(folder)
            if why:
                return None, f"off: {why}"
            built = _build([found, *compiler[1:]], include, folder, target)
            if built is not None:
                return None, built
            how = f"built {target}"
        why = _untrusted(folder) or _untrusted(target)
        if why:
            return None, f"off: {why}"
        spec = importlib.util.spec_from_file_location(
            MODULE, target, loader=importlib.machinery.ExtensionFileLoader(MODULE, str(target)))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod, how
    except (OSError, ImportError) as exc:
        return None, f"off: {target}: {exc}"


def _build(cc: list, include: str, folder: Path, target: Path) -> str | None:
    """Compile into a temporary file beside ``target`` and rename it into place (two processes
    building at once each rename a whole library). None when built, else the reason, with the
    tail of the compiler's output and where all of it is kept."""
    fd, tmp = tempfile.mkstemp(prefix=f".{MODULE}-", suffix=".so", dir=folder)
    os.close(fd)
    logfile = target.with_suffix(".log")
    cmd = [*cc, "-O2", "-shared", "-fPIC", f"-I{include}", str(SOURCE), "-o", tmp]
    try:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=BUILD_SECONDS, check=False)
        output = done.stdout.decode(errors="replace")
        if done.returncode != 0:
            logfile.write_text(f"$ {shlex.join(cmd)}\n{output}")
            tail = output.strip().splitlines()[-1:] or ["(no output)"]
            return f"off: building {SOURCE.name} failed ({tail[0]}); log: {logfile}"
        os.chmod(tmp, 0o700)
        os.replace(tmp, target)
        return None
    except subprocess.TimeoutExpired:
        return f"off: building {SOURCE.name} took over {BUILD_SECONDS}s"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _untrusted(path: Path) -> str | None:
    """Why ``path`` must not be loaded from (or built into), or None."""
    st = path.stat()
    if st.st_uid not in (os.getuid(), 0):
        return f"{path} belongs to uid {st.st_uid}, neither this user ({os.getuid()}) nor root"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o}); chmod go-w it"
    return None
