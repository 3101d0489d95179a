"""Choosing UCX settings for the memory kinds in play, before any NIXL agent exists.

UCX reads its environment when NIXL creates the backend, so this runs first. Rules (DESIGN §4):

- NIXL needs an active-message (AM) transport beside the bulk one; ``cma``, ``cuda_copy``,
  ``cuda_ipc`` and ``ze_copy`` only do get/put. NIXL also creates its endpoints with peer-failure
  handling (a dead peer must give an error), so only AM transports that handle peer failure
  count: tcp and the InfiniBand ones always; UCX's shared-memory ones (posix, sysv) only when
  their ``ERROR_HANDLING`` setting is on (UCX's default is off: measured, ``UCX_TLS=posix,cma``
  alone fails with "posix/memory - no peer failure handler").
- Host and CUDA memory (``cpu``, ``cuda``): turn on ``UCX_POSIX_ERROR_HANDLING``. Without it
  the AM lane between two processes of one host is tcp over loopback, and the first endpoint of
  a process spends 10-20 ms of the handshake in UCX's protocol selection querying the tcp interfaces (about 150
  socket ioctls and sysfs walks, measured on the 2-core CI host); with it the AM lane is posix
  shared memory (peer failure detected by checking the peer's process), the first handshake's
  add-agent takes ~1 ms and a small pull ~0.05 ms instead of ~1 ms. posix (not sysv): UCX can
  check a posix peer safely because it attaches the peer's shared-memory file; peers on other
  hosts still use tcp/IB, which stay enabled. With CUDA memory (2 x H100, 2026-11-25) the first
  connect's handshake took 30 -> 10 ms (one GPU) and 56 -> 32 ms (NVLink), and a push the
  prefill starts, whose notification is an active message, lost ~70 µs at 64 MiB on one GPU.
- With posix in play (host and CUDA memory): ``UCX_POSIX_SHM_MIN_SIZE=0``. Every UCX worker
  keeps a receive pool in /dev/shm (~4 MiB; NIXL's UCX threads add a worker each), and UCX's
  posix memory domain offers shared memory only while /dev/shm has this much free (16 MiB by
  default). Below it a worker made later falls back to memory without a handle, which UCX 1.22
  dereferences (``uct_mm_iface_recv_desc_init``): a SIGSEGV in NIXL's create_backend, seen in a
  container's 64 MiB /dev/shm (docker's default) with a TP group's decodes on UCX threads. At 0
  a full /dev/shm is an error NIXL reports.
- Host memory: ``UCX_CMA_SEG_SIZE=4M``. cma moves one segment per UCX progress call; with
  512 KiB segments a 1 GiB pull is 2048 process_vm_readv calls. Measured on the 2-core host
  (1 GiB cross_layer pull vs same-run memmove, 7 runs each): 512 KiB 0.80 median, 4 MiB 0.85,
  64 MiB 0.85. 4 MiB keeps one progress call short (~0.25 ms at 16 GB/s), so a pull from one
  peer does not hold up the others' progress for long.
- Intel GPUs need ``UCX_MEMTYPE_CACHE=n``. CUDA pull (READ) needs
  ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on`` or it falls back to TCP silently. xpu keeps UCX's
  default AM choice (not measured there with posix AM).

Values the user already set are kept, except an impossible ``UCX_TLS``, which is refused with
the reason.
"""

from __future__ import annotations

import os
from typing import Mapping, MutableMapping

from . import ucxlog
from .errors import TransportError

# AM-capable transports that handle peer failure whatever their settings.
AM_PEER_FAILURE = {"tcp", "rc", "rc_x", "rc_v", "rc_mlx5", "ud", "ud_x", "ud_v", "ud_mlx5",
                   "dc", "dc_x", "dc_mlx5"}
# Shared-memory AM transports: usable by NIXL only with their ERROR_HANDLING setting on.
SHM_AM = ("posix", "sysv")
# UCX_TLS aliases, expanded to the AM transports they include.
ALIASES = {"all": AM_PEER_FAILURE | set(SHM_AM), "sm": set(SHM_AM), "shm": set(SHM_AM),
           "mm": set(SHM_AM), "ib": AM_PEER_FAILURE - {"tcp"}}
# Host memory's bulk transport between processes (process_vm_readv/writev), and its segment:
# UCX copies one segment per worker progress call (UCX_CMA_TX_QUOTA=1), 512 KiB by default.
CMA_SEG_SETTING, CMA_SEG_SIZE = "UCX_CMA_SEG_SIZE", "4M"
DEVICE_KINDS = ("cpu", "cuda", "xpu")
SHM_AM_SETTING = "UCX_POSIX_ERROR_HANDLING"
SHM_MIN_SETTING = "UCX_POSIX_SHM_MIN_SIZE"
_TRUE = {"y", "yes", "on", "1", "true"}


def _names(tls: str) -> set[str]:
    return {t.strip().lstrip("^").lower() for t in tls.split(",") if t.strip()}


def admitted(env: Mapping[str, str], universe: set[str]) -> set[str]:
    """Which transports of ``universe`` ``UCX_TLS`` in ``env`` lets UCX use (aliases: all, sm,
    shm, mm, ib; a leading ``^`` excludes)."""
    tls = (env.get("UCX_TLS") or "").strip()
    if not tls:
        return set(universe)
    named: set[str] = set()
    for name in _names(tls):
        named |= ALIASES.get(name, {name})
        if name in ("all", "sm", "shm"):
            named.add("cma")  # UCX's sm/shm aliases include the single-copy transports
    if tls.startswith("^"):
        return set(universe) - named
    return named & set(universe)


def admitted_am(env: Mapping[str, str]) -> set[str]:
    """The AM transports (tcp, posix, sysv, rc, ...) that ``UCX_TLS`` in ``env`` lets UCX use."""
    return admitted(env, ALIASES["all"])


def shm_error_handling(env: Mapping[str, str], transport: str) -> bool:
    """Whether UCX's ``transport`` (posix or sysv) exposes peer-failure handling under ``env``:
    its own ``UCX_<T>_ERROR_HANDLING``, else the shared ``UCX_MM_ERROR_HANDLING``, else off."""
    value = env.get(f"UCX_{transport.upper()}_ERROR_HANDLING",
                    env.get("UCX_MM_ERROR_HANDLING", "n"))
    return value.strip().lower() in _TRUE


def usable_am(env: Mapping[str, str]) -> set[str]:
    """AM transports NIXL can use (peer-failure handling included) under ``env``."""
    admitted = admitted_am(env)
    return {t for t in admitted if t in AM_PEER_FAILURE or
            (t in SHM_AM and shm_error_handling(env, t))}


# Why each setting is made (reported beside the settings: bench's ucx_policy).
REASONS = {
    SHM_AM_SETTING: "NIXL's active messages over posix shared memory instead of tcp on one host",
    SHM_MIN_SETTING: "a full /dev/shm is UCX's error, not a crash (a worker's receive pool "
                     "without a memory handle: a SIGSEGV in UCX 1.22)",
    CMA_SEG_SETTING: "host memory moves by cma in 4 MiB segments (512 KiB: 2048 calls per GiB)",
    "UCX_MEMTYPE_CACHE": "Intel GPU memory is not seen through UCX's memory-type cache",
    "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "a pull (READ) of CUDA memory takes CUDA IPC, not tcp "
                                     "(0.4 GB/s -> 838 GB/s measured)",
    "UCX_TLS": "single-node Intel GPUs without InfiniBand: ze_ipc between processes, ze_copy, "
               "and tcp for NIXL's active messages (seed 001)",
    "UCX_LOG_FILE": "UCX's messages reach Python logging (kvruntime.ucx) at their own level, "
                    "not raw stderr (ucxlog.py)",
    "UCX_PROTO_INFO": "the transports UCX selects are read back: device memory on TCP is an "
                      "error, never silent (ucxlog.py)",
}
ZE_IPC_TLS = "ze_ipc,ze_copy,tcp"
IB_TRANSPORTS = {"rc", "rc_x", "rc_v", "rc_mlx5", "ud", "ud_x", "ud_v", "ud_mlx5", "dc", "dc_x",
                 "dc_mlx5"}


def offered_transports(timeout: float = 10.0) -> set[str] | None:
    """The transports this host's UCX offers (``ucx_info -d``), or None when no ucx_info is on
    PATH (a wheel's bundled UCX): then no choice depends on them."""
    import shutil
    import subprocess

    tool = shutil.which("ucx_info")
    if tool is None:
        return None
    try:
        out = subprocess.run([tool, "-d"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    # ucx_info indents inside the comment: "#      Transport: ze_ipc"
    return {line.split(":", 1)[1].strip() for line in out.stdout.splitlines()
            if line.lstrip("# \t").startswith("Transport:")}


def xpu_tls(env: Mapping[str, str], offered: set[str] | None) -> tuple[str | None, str]:
    """``UCX_TLS`` for Intel GPU memory given the transports UCX ``offered`` (None: unknown), and
    why; None leaves it to UCX (ze_copy beside the host transports) — pure."""
    if "UCX_TLS" in env:
        return None, f"UCX_TLS={env['UCX_TLS']}: yours, kept"
    if offered is None:
        return None, "ze_copy fallback: this UCX's transports are unknown (no ucx_info on PATH), UCX_TLS left to UCX"
    if offered & IB_TRANSPORTS:
        return None, (f"InfiniBand here ({', '.join(sorted(offered & IB_TRANSPORTS))}): UCX_TLS left to UCX, "
                      f"which moves GPU memory between nodes over it")
    if "ze_ipc" not in offered:
        return None, ("ze_copy fallback: this UCX offers no ze_ipc (no UCX release has it: `installer --platform "
                      "xpu --variant ze-ipc` builds one; with an Intel GPU, a Level Zero driver without IPC "
                      "support hides it too), UCX_TLS left to UCX")
    return ZE_IPC_TLS, REASONS["UCX_TLS"]


def describe(added: Mapping[str, str], env: Mapping[str, str], device_kind: str,
             offered: set[str] | None = None) -> list[str]:
    """One line per setting in play: what kvruntime set and why, and what the user set (kept);
    for Intel GPU memory, given the ``offered`` transports, why ``UCX_TLS`` was left to UCX."""
    lines = [f"{k}={v}: {REASONS.get(k, 'set by kvruntime')}" for k, v in sorted(added.items())]
    for k in sorted(REASONS):
        if k in env and k not in added:
            lines.append(f"{k}={env[k]}: yours, kept")
    if device_kind == "xpu" and offered is not None and "UCX_TLS" not in added and "UCX_TLS" not in env:
        lines.append(f"UCX_TLS unset: {xpu_tls(env, offered)[1]}")
    return lines


def policy(device_kind: str, env: Mapping[str, str], offered: set[str] | None) -> list[str]:
    """What kvruntime would set for ``device_kind`` memory under ``env``, with why (``describe``),
    the transport choice included: for Intel GPU memory ``UCX_TLS`` chosen or left to UCX and the
    reason, also when the transports UCX offers are unknown — pure. A ``UCX_TLS`` that cannot work
    is its one line."""
    try:
        added = ucx_settings(device_kind, env, offered)
    except TransportError as exc:
        return [f"refused: {exc}"]
    lines = describe(added, env, device_kind, offered)
    if device_kind == "xpu" and offered is None and "UCX_TLS" not in env:
        lines.append(f"UCX_TLS unset: {xpu_tls(env, None)[1]}")
    return lines


def ucx_settings(device_kind: str, env: Mapping[str, str],
                 offered: set[str] | None = None) -> dict[str, str]:
    """The UCX variables to add for ``device_kind`` given the current ``env`` and the
    transports the host's UCX ``offered`` (None: unknown) — pure."""
    if device_kind not in DEVICE_KINDS:
        raise TransportError(f"device kind {device_kind!r} is not one of {DEVICE_KINDS}")
    want: dict[str, str] = {}
    tls, _why = xpu_tls(env, offered) if device_kind == "xpu" else (None, "")
    if tls:
        want["UCX_TLS"] = tls
    if device_kind in ("cpu", "cuda") and "posix" in admitted_am(env):
        want[SHM_AM_SETTING] = "y"
        want[SHM_MIN_SETTING] = "0"
    if device_kind == "cpu" and admitted(env, {"cma"}):
        want[CMA_SEG_SETTING] = CMA_SEG_SIZE
    if device_kind == "xpu":
        want["UCX_MEMTYPE_CACHE"] = "n"
    if device_kind == "cuda" and admitted(env, {"cuda_ipc"}):  # else UCX warns it is unused
        want["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] = "on"
    added = {k: v for k, v in want.items()
             if k not in env and not (k == SHM_AM_SETTING and "UCX_MM_ERROR_HANDLING" in env)}
    if not usable_am({**env, **added}):
        tls = env.get("UCX_TLS")
        shm = sorted(admitted_am(env) & set(SHM_AM))
        why = (f"; {', '.join(shm)} would need UCX_{shm[0].upper()}_ERROR_HANDLING=y (NIXL "
               f"handles peer failure)" if shm else "")
        raise TransportError(
            f"UCX_TLS={tls} has no active-message transport that NIXL can use{why}: "
            f"add tcp (e.g. UCX_TLS={tls},tcp)"
        )
    return added


def apply_ucx_settings(device_kind: str, env: MutableMapping[str, str] | None = None,
                       offered: set[str] | None = None) -> dict:
    env = os.environ if env is None else env
    if offered is None and device_kind == "xpu":  # the only choice that depends on them
        offered = offered_transports()
    added = ucx_settings(device_kind, env, offered)
    env.update(added)
    added.update(ucxlog.install(env))  # UCX's log into a file we read (ucxlog.py)
    return added


def forced_by_user(name: str, added: Mapping[str, str], env: Mapping[str, str] | None = None
                   ) -> bool:
    """The user set ``name`` themselves (kvruntime did not choose it)."""
    env = os.environ if env is None else env
    return name in env and name not in added


def ucx_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Every ``UCX_*`` variable in effect (for reports: what the figures ran under)."""
    env = os.environ if env is None else env
    return {k: v for k, v in sorted(env.items()) if k.startswith("UCX_")}
