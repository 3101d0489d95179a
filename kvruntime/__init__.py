"""kvruntime: move KV-cache blocks between prefill and decode processes through NIXL.

Pure layers (no NIXL, no torch): ``layout``, ``plan``, ``frames``, ``handshake``. NIXL is
imported only when an agent is made, so the pure layers work on any Python.
"""

from .errors import KVRuntimeError
from .layout import CROSS_LAYER, PER_LAYER, KVLayout
from .plan import TransferPlan, make_plan

__all__ = ["CROSS_LAYER", "PER_LAYER", "KVLayout", "KVRuntimeError", "TransferPlan",
           "make_plan"]
