"""Choosing UCX settings for the memory kinds in play, before any NIXL agent exists.

UCX reads its environment when NIXL creates the backend, so this runs first. Rules (DESIGN §4):
NIXL needs an active-message transport (tcp, sm/posix/sysv, rc/ud/dc) beside the bulk one;
``cma``, ``cuda_copy``, ``cuda_ipc`` and ``ze_copy`` only do get/put. Intel GPUs need
``UCX_MEMTYPE_CACHE=n``. CUDA pull (READ) needs ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on`` or it falls
back to TCP silently. Values the user already set are kept, except an impossible ``UCX_TLS``,
which is refused with the reason.
"""

from __future__ import annotations

import os
from typing import Mapping, MutableMapping

from .errors import TransportError

AM_CAPABLE = {"tcp", "sm", "shm", "posix", "sysv", "rc", "rc_x", "rc_v", "rc_mlx5", "ud",
              "ud_x", "ud_v", "ud_mlx5", "dc", "dc_x", "dc_mlx5", "all", "ib", "mm"}
DEVICE_KINDS = ("cpu", "cuda", "xpu")


def ucx_settings(device_kind: str, env: Mapping[str, str]) -> dict[str, str]:
    """The UCX variables to add for ``device_kind`` given the current ``env`` (pure)."""
    if device_kind not in DEVICE_KINDS:
        raise TransportError(f"device kind {device_kind!r} is not one of {DEVICE_KINDS}")
    tls = env.get("UCX_TLS")
    if tls:
        names = {t.strip().lstrip("^") for t in tls.split(",") if t.strip()}
        if not tls.startswith("^") and not names & AM_CAPABLE:
            raise TransportError(
                f"UCX_TLS={tls} has no active-message transport, which NIXL needs: "
                f"add tcp or sm (e.g. UCX_TLS={tls},tcp)"
            )
    want: dict[str, str] = {}
    if device_kind == "xpu":
        want["UCX_MEMTYPE_CACHE"] = "n"
    if device_kind == "cuda":
        want["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] = "on"
    return {k: v for k, v in want.items() if k not in env}


def apply_ucx_settings(device_kind: str, env: MutableMapping[str, str] | None = None) -> dict:
    env = os.environ if env is None else env
    added = ucx_settings(device_kind, env)
    env.update(added)
    return added
