"""kvruntime: move KV-cache blocks between prefill and decode processes through NIXL.

The public face, everything an engine needs::

    from kvruntime import PrefillServer, DecodeClient, Options, KVCache, KVLayout, \
        TransferHandle, TransferResult, errors

A prefill process serves its ``KVCache`` with a ``PrefillServer``; a decode process connects a
``DecodeClient`` to it and pulls (or is pushed) blocks, each request a ``TransferHandle`` that ends
in a ``TransferResult``. ``Options`` holds what both sides take (their keyword arguments fill
it). Every error is a ``errors.KVRuntimeError``.

Pure layers (no NIXL, no torch): ``layout``, ``plan``, ``frames``, ``handshake``, ``options``,
``app``. The classes that touch NIXL, numpy or torch are imported on first use, so ``import
kvruntime`` stays cheap and the pure layers work on any Python. Every other module is internal:
its names may change.
"""

from importlib import import_module

from . import errors
from .errors import KVRuntimeError
from .layout import CROSS_LAYER, PER_LAYER, KVLayout
from .options import Options
from .plan import TransferPlan, make_plan

# public name -> the internal module that holds it, imported when the name is first read
_LAZY = {
    "PrefillServer": "prefill.server",
    "DecodeClient": "decode.client",
    "KVCache": "memory",
    "TransferHandle": "decode.inflight",
    "TransferResult": "jobs",
}

__all__ = ["CROSS_LAYER", "PER_LAYER", "DecodeClient", "KVCache", "KVLayout", "KVRuntimeError",
           "Options", "PrefillServer", "TransferHandle", "TransferPlan", "TransferResult",
           "errors", "make_plan"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvruntime' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value  # read once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
