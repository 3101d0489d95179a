"""Copied into kvstack's NIXL wheel as <module>/_kvstack_preload.py and imported first by the
module's __init__: it makes the bundled, private UCX the one NIXL binds to even when another UCX
was loaded into the process before (with RTLD_GLOBAL its symbols come first in every later
lookup). Standalone: it imports nothing from kvstack.

- NIXL's UCX plugin is loaded with RTLD_DEEPBIND (NIXL_UCX_DEEPBIND, NIXL >= 1.4), so its ucp_*
  calls resolve in its own dependencies, the private libucp-kvstack-*.so, before the global scope;
  NIXL_UCX_EXPECTED_SONAME makes NIXL refuse the plugin if it bound to any other libucp.
- UCX loads its transport modules (<libs>/ucx/libuct_*.so.0) itself, RTLD_LOCAL and without
  RTLD_DEEPBIND unless UCX was configured with --enable-module-deepbind; a module's uct_*/ucs_*
  references would then resolve to the foreign UCX. Loading each module here first, with
  RTLD_DEEPBIND, binds it to the private libraries; UCX's own dlopen of the same file later gets
  this handle back (glibc keeps one copy per file) and runs the module's init as usual.
- The platform's runtime settings (what env.sh exports for it) are set unless already set.

CONFIG is filled in when the wheel is made."""
import ctypes
import os

CONFIG = {}  # filled in by `python -m installer wheel`: {"ucp_soname": ..., "env": {...}}

_HERE = os.path.dirname(os.path.abspath(__file__))
LIBS = os.path.join(os.path.dirname(_HERE), os.path.basename(_HERE) + ".libs")
_handles = []  # kept for the life of the process: the modules must stay loaded


def _preload_ucx_modules(libs_dir):
    deepbind = getattr(os, "RTLD_DEEPBIND", 0)
    if not deepbind:
        return []
    loaded = []
    modules = os.path.join(libs_dir, "ucx")
    for name in sorted(os.listdir(modules)) if os.path.isdir(modules) else []:
        if not name.startswith("lib") or ".so" not in name:
            continue
        try:
            _handles.append(ctypes.CDLL(os.path.join(modules, name), mode=os.RTLD_NOW | os.RTLD_LOCAL | deepbind))
            loaded.append(name)
        except OSError:
            pass  # a module whose own dependencies are missing here (e.g. CUDA's): UCX skips it too
    return loaded


def setup(config=None, libs_dir=None):
    config = CONFIG if config is None else config
    for key, value in config.get("env", {}).items():
        os.environ.setdefault(key, value)
    if config.get("ucp_soname"):
        os.environ.setdefault("NIXL_UCX_DEEPBIND", "1")
        os.environ.setdefault("NIXL_UCX_EXPECTED_SONAME", config["ucp_soname"])
    return _preload_ucx_modules(LIBS if libs_dir is None else libs_dir)


MODULES = setup()
