"""Copied into kvstack's NIXL wheel as <module>/_kvstack_preload.py and imported first by the
module's __init__. Standalone: it imports nothing from kvstack.

- Nothing is loaded with RTLD_DEEPBIND, and NIXL is told not to load its UCX plugin so
  (NIXL_UCX_DEEPBIND=0, whatever the environment says). libucs imports `environ` through a copy
  relocation in the executable; in a deep-bound scope that reference binds to libc's own,
  unused `environ` instead, and UCX faults reading its settings in ucp_worker_create (SIGSEGV
  in NIXL's create_backend on a host that never held the build; NIXL issue 1668, PR 2274).
- The bundled UCX and NIXL have private SONAMEs (libucp-kvstack-<hash>.so.0, ...), so a UCX
  another library brought in its own local scope (a Python extension's, loaded RTLD_LOCAL as
  Python loads them) is a copy beside ours, never ours. A UCX loaded RTLD_GLOBAL before us
  (LD_PRELOAD, ctypes with RTLD_GLOBAL) comes first in every lookup without DEEPBIND, ours
  included: the import stops then, before any of our libraries loads, with one line naming that
  UCX (a half-bound private UCX refused by NIXL still faulted at exit). NIXL_UCX_EXPECTED_SONAME
  makes NIXL itself refuse its UCX plugin if it ever bound to another libucp all the same.
- UCX finds its modules beside libucs (<libs>/ucx) and NIXL its plugins beside libnixl
  (<libs>/plugins); the wheel made the build's own directories, compiled into libucs, name
  nothing (installer/wheel.py), so nothing is looked up where the build was.
- A library the wheel takes from another wheel it requires (the cuda build's libcudart from
  nvidia-cuda-runtime, in site-packages/nvidia/cu13/lib) is loaded from there first (the
  site-packages of this wheel, else the first directory on sys.path that has it): a NEEDED
  entry naming its SONAME then takes the loaded copy in every file, the grafted ones too, whose
  RUNPATHs auditwheel resets to the wheel's own directory.
- The platform's runtime settings (what env.sh exports for it) are set unless already set.

CONFIG is filled in when the wheel is made."""
import ctypes
import os
import sys

# filled in by `python -m installer wheel`:
# {"libs": ..., "ucp_soname": ..., "env": {...}, "from_pip": [...]}
CONFIG = {}
_HERE = os.path.dirname(os.path.abspath(__file__))
SITE = os.path.dirname(_HERE)
LIBS = os.path.join(SITE, CONFIG.get("libs", os.path.basename(_HERE) + ".libs"))


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def global_ucx(libs_dir=LIBS):
    """The file of a UCX in the process's global scope that is not this wheel's, else None."""
    try:
        found = ctypes.cast(ctypes.CDLL(None).ucp_init_version, ctypes.c_void_p).value
    except (AttributeError, OSError):
        return None
    info = _DlInfo()
    libc = ctypes.CDLL(None)
    if (
        not found
        or not libc.dladdr(ctypes.c_void_p(found), ctypes.byref(info))
        or not info.dli_fname
    ):
        return "an unknown library"
    path = os.path.realpath(info.dli_fname.decode(errors="replace"))
    return None if path.startswith(os.path.realpath(libs_dir) + os.sep) else path


def setup(config=None, libs_dir=LIBS, site=SITE):
    foreign = global_ucx(libs_dir)
    if foreign:
        raise ImportError(
            f"{os.path.basename(_HERE)}: another UCX is loaded with RTLD_GLOBAL in this process "
            f"({foreign}) and would take the place of this wheel's own; load that one RTLD_LOCAL "
            f"(not by LD_PRELOAD), or not at all, before importing {os.path.basename(_HERE)}"
        )
    config = CONFIG if config is None else config
    for key, value in config.get("env", {}).items():
        os.environ.setdefault(key, value)
    os.environ["NIXL_UCX_DEEPBIND"] = "0"
    for path in config.get("from_pip", []):
        # beside this package, else in any directory on sys.path (a venv seeing another's
        # site-packages through a .pth); found nowhere, the loader names it when a library needs it
        found = next(
            (f for d in [site, *sys.path] if d and os.path.exists(f := os.path.join(d, path))), None
        )
        if found:
            ctypes.CDLL(found)
    if config.get("ucp_soname"):
        os.environ.setdefault("NIXL_UCX_EXPECTED_SONAME", config["ucp_soname"])


setup()
