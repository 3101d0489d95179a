"""Finding the NIXL Python module and smoothing over its quirks.

NIXL ships under several module names depending on how it was built: ``nixl_cpu`` and
``nixl_xpu`` (meson builds without CUDA), ``nixl_cu13``/``nixl_cu12`` (PyPI wheels), or the
plain ``nixl`` meta-package. The first one that imports wins unless the caller or
``KVRUNTIME_NIXL_MODULE`` names one.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from ..errors import NixlNotFoundError
from ..options import environment

CANDIDATES = ("nixl_cpu", "nixl_xpu", "nixl_cu13", "nixl_cu12", "nixl")
ENV_OVERRIDE = "KVRUNTIME_NIXL_MODULE"


@dataclass(frozen=True)
class NixlBinding:
    module_name: str
    api: ModuleType  # the module that defines nixl_agent and nixl_agent_config

    @property
    def agent_class(self):
        return self.api.nixl_agent

    @property
    def config_class(self):
        return self.api.nixl_agent_config

    def efa_clash(self) -> str | None:
        """Why UCX's efa module must stay unloaded under this NIXL, or None.

        PyPI's NIXL wheels (nixl-cu12 1.5.1) bundle a private libibverbs and UCX's efa module but
        not libefa: on a host with rdma-core that module loads the host's libefa, which brings
        the host's libibverbs in beside the private one, and the process dies (SIGSEGV) when the
        agent is destroyed. Seen on Debian 12 with rdma-core 44; the clash NIXL PR #1929 is
        about. kvstack's own builds link the host's libibverbs alone and are not affected."""
        import ctypes.util

        package = Path(self.api.__file__).parent
        libs = package.parent / f"{package.name}.libs"
        private = any(libs.glob("libibverbs-*.so*")) and not any(libs.glob("libefa*.so*"))
        if not private or not any((libs / "ucx").glob("libuct_ib_efa*.so*")):
            return None
        if ctypes.util.find_library("efa") is None:
            return None
        return (f"{package.name}'s wheel bundles its own libibverbs but not libefa: UCX's efa "
                f"module would load this host's libefa and with it a second libibverbs, which "
                f"crashes the process when the agent is destroyed (NIXL PR #1929)")

    @property
    def version(self) -> str:
        try:
            from importlib.metadata import version

            return version(self.module_name.replace("_", "-"))
        except Exception:  # meson installs carry no dist-info
            return "unknown"


def load_nixl(module: str | None = None) -> NixlBinding:
    """Import NIXL. ``module`` (or the env override) restricts the search to that one name."""
    chosen = module or environment(ENV_OVERRIDE)
    names = (chosen,) if chosen else CANDIDATES
    tried = []
    for name in names:
        try:
            mod = importlib.import_module(name)
        except Exception as exc:  # ImportError, or an OSError from a missing libucp
            tried.append(f"{name} ({type(exc).__name__}: {exc})")
            continue
        api = mod if hasattr(mod, "nixl_agent") else getattr(mod, "_api", None)
        if api is None or not hasattr(api, "nixl_agent"):
            tried.append(f"{name} (imported, but it has no nixl_agent)")
            continue
        _quiet_nixl_info()
        return NixlBinding(name, api)
    how = f"{ENV_OVERRIDE}/argument" if chosen else "the default search"
    raise NixlNotFoundError(
        f"no NIXL Python module could be loaded ({how} tried: {'; '.join(tried)}). "
        f"Install one (e.g. `pip install nixl-cu12` or build NIXL with the installer) "
        f"or set {ENV_OVERRIDE} to the module name."
    )


def _quiet_nixl_info() -> None:
    """NIXL's Python logger prints INFO lines (every agent, every backend) to stdout, where
    a tool's report goes: keep its warnings and errors, and its INFO only when kvruntime logs
    at INFO or below (KVRUNTIME_LOG_LEVEL, or the library user's own 'nixl' level)."""
    import logging

    nixl_log = logging.getLogger("nixl")
    wanted = (environment("KVRUNTIME_LOG_LEVEL") or "").upper()
    if nixl_log.level in (logging.NOTSET, logging.INFO) and wanted not in ("DEBUG", "INFO"):
        nixl_log.setLevel(logging.WARNING)


def as_str(name: str | bytes) -> str:
    """NIXL returns agent names as bytes from some calls and str from others."""
    return name.decode() if isinstance(name, (bytes, bytearray)) else str(name)
