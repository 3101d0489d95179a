"""What a PrefillServer and a DecodeClient share: one ``Options``, and every KVRUNTIME_*
environment variable, read here and nowhere else.

``Options`` holds the eleven settings both sides take (the keyword arguments of both constructors
fill it, so ``PrefillServer(cache, timeout=2)`` and ``PrefillServer(cache, Options(timeout=2))``
are the same server). ``Options.from_env()`` starts from the environment (``ENV``), then takes
what the caller gives. ``environment(name)`` is how any other module reads one of the variables
in ``ENV``, so that the table below is the whole list (docs/kvruntime.md lists the same
variables: a unit test compares the names).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import Mapping

from .app import check_app
from .numbers import check_seconds

# variable -> (the Options field it fills, or None for a module's own setting; what it does)
ENV = {
    "KVRUNTIME_KV_BUFFER": ("kv_buffer", "`device` or `host_staged`: where NIXL reads and writes "
                            "the KV (default: device where the device memory registers)"),
    "KVRUNTIME_SECRET": ("secret", "the shared secret both sides prove at the handshake"),
    "KVRUNTIME_NIXL_MODULE": (None, "the NIXL Python module to load (default: the first of "
                              "nixl_cpu, nixl_xpu, nixl_cu13, nixl_cu12, nixl)"),
    "KVRUNTIME_LOG_LEVEL": (None, "NIXL's INFO lines are kept at INFO or DEBUG; the tools' "
                            "processes log at this level to stderr"),
    "KVRUNTIME_NATIVE": (None, "`0`: block-id lists are read by Python, not the compiled reader"),
    "KVRUNTIME_CACHE_DIR": (None, "where the compiled reader is kept (default: "
                            "$XDG_CACHE_HOME/kvruntime)"),
    "KVRUNTIME_UCX_THREADS": (None, "a decode's NIXL UCX threads (0-64) when its caller did "
                              "not choose (`ucx_threads=None`): 0 off, a number on, whatever "
                              "kvruntime would choose (how the suites run both ways)"),
}


def environment(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of KVRUNTIME_* variable ``name`` (one of ``ENV``), or None when unset or empty."""
    if name not in ENV:
        raise KeyError(f"{name} is not one of kvruntime's variables (options.ENV)")
    return (os.environ if environ is None else environ).get(name) or None


@dataclass(frozen=True)
class Options:
    """Settings of both sides. ``binding``: a loaded NIXL module (binding.py; None: found by
    name); ``secret``: the handshake's shared secret (None: no authentication, loopback
    only); ``timeout``: seconds for a connect, a frame, a control call; ``ucx_threads``:
    NIXL's UCX threads (0: the caller's polls progress; None: chosen, agent.ucx_threads);
    ``device_kind``: "cpu", "cuda" or "xpu" (which UCX settings apply); ``name``: the NIXL
    agent's name (None: a unique one); ``kv_buffer``: "device" or "host_staged" (None: by the
    device kind); ``staging_blocks``: host-staged pool size in blocks (0: the cache's);
    ``tp_rank``: this side's tensor-parallel rank; ``coalesce``: "auto", "always" or
    "never", whether a NIXL request of many runs goes through both sides' staging pools
    (coalesce.py; "never" on a prefill: it keeps no pool); ``app``: the application's
    descriptor, a flat dict of scalars both sides must hold alike (app.py: a model's config;
    None: not compared, unless the peer has one)."""

    binding: object = None
    secret: bytes | None = None
    timeout: float = 5.0
    ucx_threads: int | None = None
    device_kind: str = "cpu"
    name: str | None = None
    kv_buffer: str | None = None
    staging_blocks: int = 0
    tp_rank: int = 0
    coalesce: str = "auto"
    app: dict | None = field(default=None, hash=False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **given) -> "Options":
        """The environment's settings (``ENV``), overridden by ``given``."""
        found = {}
        for name, (target, _what) in ENV.items():
            value = environment(name, environ)
            if target is not None and value is not None:
                found[target] = value.encode() if target == "secret" else value
        return cls(**{**found, **given})

    @classmethod
    def of(cls, options: "Options | None", given: dict) -> "Options":
        """``options`` (or the defaults) with the keyword arguments a constructor got; an
        unknown name raises TypeError, as a call with it would."""
        unknown = set(given) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")
        out = replace(options or cls(), **given)
        # a bad descriptor: LayoutError, now; a bad timeout: said now, not at the first frame
        return replace(out, app=check_app(out.app), timeout=check_seconds("timeout", out.timeout))

