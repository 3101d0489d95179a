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
  a process spends 10-20 ms of the handshake in UCX's protocol selection querying the tcp
  interfaces (about 150 socket ioctls and sysfs walks, measured on the 2-core CI host); with it
  the AM lane is posix shared memory (peer failure detected by checking the peer's process), the
  first handshake's add-agent takes ~1 ms and a small pull ~0.05 ms instead of ~1 ms. posix (not
  sysv): UCX can check a posix peer safely because it attaches the peer's shared-memory file;
  peers on other hosts still use tcp/IB, which stay enabled. With CUDA memory (2 x H100,
  2026-11-25) the first connect's handshake took 30 -> 10 ms (one GPU) and 56 -> 32 ms
  (NVLink), and a push the prefill starts, whose notification is an active message, lost ~70 µs
  at 64 MiB on one GPU.
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

- Across hosts (``cross_host``, DESIGN §9): RDMA when an ACTIVE port (nics.py) has an RDMA
  transport this UCX offers there (``ucx_info -d``) and ``UCX_TLS`` admits; rc, ud, dc and srd
  also carry NIXL's active messages. With device memory and several such NICs,
  ``UCX_NET_DEVICES`` = the GPU's nearest (PCIe, then NUMA), plus ``lo`` where no shared-memory
  AM lane serves NIXL's endpoint to itself (SGLang #40641). GPUDirect RDMA (nvidia_peermem or
  DMA-BUF; Intel: the xe driver and DMA-BUF) or UCX staging through host memory is said.

Values the user already set are kept, except an impossible ``UCX_TLS`` or ``UCX_NET_DEVICES``
(a device this host lacks: NIXL_ERR_BACKEND otherwise, prime-rl #3204; or no AM lane left on
it, NIXL #1647), which is refused with the reason.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Mapping, MutableMapping

from ..errors import TransportError
from . import ucxlog

# The RDMA transports as ``ucx_info -d`` names them (verbs, mlx5's own, EFA's srd), each with
# the UCX_TLS aliases that select it (ucp_context.c's ucp_tl_aliases in UCX 1.22).
RDMA_AM = {"rc_verbs": ("rc", "rc_v"), "rc_mlx5": ("rc", "rc_x"), "dc_mlx5": ("dc", "dc_x"),
           "ud_verbs": ("ud", "ud_v"), "ud_mlx5": ("ud", "ud_x"), "srd": ()}
# AM-capable transports that handle peer failure whatever their settings: tcp and the RDMA
# ones (rc, ud, dc and srd all report UCT_IFACE_FLAG_ERRHANDLE_PEER_FAILURE in UCX 1.22),
# by the names ucx_info lists and UCX_TLS's aliases for them.
AM_PEER_FAILURE = {"tcp", "rc", "rc_x", "rc_v", "ud", "ud_x", "ud_v", "dc", "dc_x", *RDMA_AM}
# Shared-memory AM transports: usable by NIXL only with their ERROR_HANDLING setting on.
SHM_AM = ("posix", "sysv")
# UCX_TLS aliases, expanded to the AM transports they include (an alias stays in its own
# expansion: the sets below are also compared with aliases).
ALIASES = {"all": AM_PEER_FAILURE | set(SHM_AM), "sm": set(SHM_AM), "shm": set(SHM_AM),
           "mm": set(SHM_AM), "ib": AM_PEER_FAILURE - {"tcp"}}
for _tl, _aliases in RDMA_AM.items():
    for _alias in _aliases:
        ALIASES.setdefault(_alias, {_alias}).add(_tl)
del _tl, _aliases, _alias
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


def shm_am_across_users(own_uid: int, peer_uid: int | None, env: Mapping[str, str],
                        peer: str) -> str | None:
    """Why an agent under ``env`` must not meet ``peer`` of user ``peer_uid`` on this host
    (None: it may; ``peer_uid`` None: not on this host). With posix as an AM lane (its error
    handling on), UCX picks it for a peer whose shared memory it can open: a root process
    opens any user's, that user cannot open root's (mode 0600, /proc/<pid>/fd), and the side
    that cannot gets a lane it cannot reach: NIXL 1.5 then dies with SIGSEGV in
    get_new_notifs (UCX 1.22: "no active messages transport ... posix/memory"). Either side
    may be the one with posix on, so each refuses it for itself."""
    if peer_uid is None or peer_uid == own_uid or "posix" not in usable_am(env):
        return None
    return (f"{peer} runs as uid {peer_uid} on this host and this process as uid {own_uid}: "
            f"UCX's shared-memory lane ({SHM_AM_SETTING}=y, kvruntime's default) opens one way "
            f"only between users and NIXL crashes on it; run both as one user, or set "
            f"{SHM_AM_SETTING}=n in both processes (their active messages then take tcp)")


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
IB_TRANSPORTS = ALIASES["ib"]


def parse_ucx_info(text: str) -> dict[str, set[str]]:
    """The transports a ``ucx_info -d`` listing offers, each with its devices (``rc_mlx5``:
    {``mlx5_0:1``}, ``tcp``: {``eth0``, ``lo``}) — pure. ucx_info indents inside the comment
    (``#      Transport: ze_ipc``); UCX before 1.9 listed several devices under one transport."""
    offered: dict[str, set[str]] = {}
    transport = None
    for line in text.splitlines():
        field, _, value = line.lstrip("# \t").partition(":")
        value = value.strip()
        if field == "Memory domain" or field == "Connection manager":
            transport = None
        elif field == "Transport" and value:
            transport = value
            offered.setdefault(transport, set())
        elif field == "Device" and value and transport is not None:
            offered[transport].add(value)
    return offered


def offered_devices(timeout: float = 10.0) -> dict[str, set[str]] | None:
    """The transports this host's UCX offers, with their devices (``ucx_info -d``), or None
    when no ucx_info is on PATH (a wheel's bundled UCX) or it fails: then no choice depends on
    them."""
    import shutil
    import subprocess

    tool = shutil.which("ucx_info")
    if tool is None:
        return None
    try:
        out = subprocess.run([tool, "-d"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_ucx_info(out.stdout) if out.returncode == 0 else None


def offered_transports(timeout: float = 10.0) -> set[str] | None:
    """The transports this host's UCX offers (``ucx_info -d``), or None when no ucx_info is on
    PATH (a wheel's bundled UCX): then no choice depends on them."""
    offered = offered_devices(timeout)
    return None if offered is None else set(offered)


def xpu_tls(env: Mapping[str, str], offered: set[str] | None) -> tuple[str | None, str]:
    """``UCX_TLS`` for Intel GPU memory given the transports UCX ``offered`` (None: unknown), and
    why; None leaves it to UCX (ze_copy beside the host transports) — pure."""
    if "UCX_TLS" in env:
        return None, f"UCX_TLS={env['UCX_TLS']}: yours, kept"
    if offered is None:
        return None, ("ze_copy fallback: this UCX's transports are unknown (no ucx_info on PATH), "
                      "UCX_TLS left to UCX")
    if offered & IB_TRANSPORTS:
        ib = ", ".join(sorted(offered & IB_TRANSPORTS))
        return None, (f"InfiniBand here ({ib}): UCX_TLS left to UCX, "
                      f"which moves GPU memory between nodes over it")
    if "ze_ipc" not in offered:
        return None, ("ze_copy fallback: this UCX offers no ze_ipc (no UCX release has it: "
                      "`installer --platform xpu --variant ze-ipc` builds one; with an Intel GPU, "
                      "a Level Zero driver without IPC support hides it too), UCX_TLS left to UCX")
    return ZE_IPC_TLS, REASONS["UCX_TLS"]


NET_DEVICES = "UCX_NET_DEVICES"
# A UCX allow-list entry's range: "mlx5_[0-3]:1" is mlx5_0:1 ... mlx5_3:1 (UCX >= 1.18).
_RANGE = re.compile(r"^(.*?)\[(\d{1,9})-(\d{1,9})\](.*)$")
_MAX_RANGE = 1024  # a hostile "x[0-999999999]" is refused, not expanded


@dataclass(frozen=True)
class CrossHost:
    """The choice for peers on other hosts: the settings kvruntime adds (``UCX_NET_DEVICES``
    or none) and one line of why per part of the choice (the wire, the NIC, GPUDirect)."""

    settings: dict[str, str] = field(default_factory=dict)
    lines: tuple[str, ...] = ()


def _shown(text: str) -> str:
    """``text`` from the environment as one printable line (a newline or escape in a hostile
    value is shown escaped, never printed)."""
    return text if text.isprintable() else repr(text)


def net_device_names(value: str) -> tuple[bool, list[str]]:
    """``UCX_NET_DEVICES`` as (excluded: a leading ``^`` names what UCX must not use, names):
    ranges expanded, ``all`` dropped; TransportError in one line for a range too wide."""
    text = value.strip()
    excluded = text.startswith("^")
    names = []
    for item in text.lstrip("^").split(","):
        item = item.strip()
        if not item or item == "all":
            continue
        m = _RANGE.match(item)
        if not m:
            names.append(item)
            continue
        low, high = int(m.group(2)), int(m.group(3))
        if high < low or high - low >= _MAX_RANGE:
            raise TransportError(f"{NET_DEVICES}={_shown(value)}: range {_shown(item)} is not "
                                 f"one UCX expands (low <= high, at most {_MAX_RANGE} names)")
        names += [f"{m.group(1)}{i}{m.group(4)}" for i in range(low, high + 1)]
    return excluded, names


def _listed(env: Mapping[str, str], devices: set[str]) -> set[str]:
    """Which of ``devices`` UCX_NET_DEVICES in ``env`` lets UCX use (all when unset)."""
    value = env.get(NET_DEVICES, "").strip()
    if not value or value == "all":
        return set(devices)
    excluded, names = net_device_names(value)
    return devices - set(names) if excluded else devices & set(names)


def _check_net_devices(env: Mapping[str, str], host, offered) -> None:
    """The user's UCX_NET_DEVICES names only devices this host has, and leaves NIXL an
    active-message transport on them; else one line before NIXL's NIXL_ERR_BACKEND does."""
    value = env[NET_DEVICES]
    excluded, names = net_device_names(value)
    ports, interfaces = host.ports(), list(host.net_interfaces)
    # a device ucx_info lists is one UCX opens, even where sysfs does not show it (UCX's
    # contrib/ibmock fakes libibverbs, not /sys)
    listed = set().union(*offered.values()) if isinstance(offered, Mapping) else set()
    absent = [n for n in names if n not in ports and n not in interfaces and n not in listed]
    if absent and not excluded:
        raise TransportError(
            f"{NET_DEVICES}={_shown(value)} names {', '.join(map(_shown, absent))}, not on this "
            f"host (RDMA ports: {', '.join(ports) or 'none'}; network interfaces: "
            f"{', '.join(interfaces) or 'none'}): UCX would open no such device and NIXL fail "
            f"with NIXL_ERR_BACKEND")
    if not isinstance(offered, Mapping):
        return  # which transports run on which device is unknown (no ucx_info)
    am = usable_am(env)
    lanes = sorted(f"{tl}/{dev}" for tl, devs in offered.items() if tl in am and tl not in SHM_AM
                   for dev in _listed(env, devs))
    if not lanes:
        on = sorted({f"{tl}/{d}" for tl, devs in offered.items() for d in devs})
        raise TransportError(
            f"{NET_DEVICES}={_shown(value)} leaves NIXL no active-message transport to another "
            f"host: this UCX offers {', '.join(on) or 'nothing'} (ucx_info -d), none an AM "
            f"transport on those devices that UCX_TLS admits (a UCX built without verbs offers "
            f"nothing on an RDMA port; add one of its devices or lo)")


def _gpudirect(device_kind: str, host) -> str:
    """Whether the NIC can read and write this device memory directly (GPUDirect RDMA), and
    what UCX does otherwise."""
    stage = ("UCX stages device memory through host memory (a copy each way: host-memory "
             "speed, not the NIC's)")
    if device_kind == "cuda":
        if host.nvidia_peermem:
            return "GPUDirect RDMA: nvidia_peermem is loaded, the NIC reaches CUDA memory"
        if host.cuda_dmabuf and host.verbs_dmabuf:
            return ("GPUDirect RDMA through DMA-BUF: the CUDA driver exports it and libibverbs "
                    "has ibv_reg_dmabuf_mr")
        dmabuf = ("the CUDA driver does not export DMA-BUF" if host.cuda_dmabuf is False else
                  "the CUDA driver's DMA-BUF support is unknown" if host.cuda_dmabuf is None
                  else "libibverbs has no ibv_reg_dmabuf_mr (rdma-core < 34)"
                  if host.verbs_dmabuf is False else "no libibverbs loads")
        return f"no GPUDirect RDMA (nvidia_peermem not loaded; {dmabuf}): {stage}"
    if host.xe_driver and host.verbs_dmabuf:
        return ("GPUDirect RDMA through DMA-BUF: the xe driver exports Intel GPU memory and "
                "libibverbs has ibv_reg_dmabuf_mr")
    why = ("the xe driver is not loaded (/sys/module/xe)" if not host.xe_driver else
           "libibverbs has no ibv_reg_dmabuf_mr (rdma-core < 34)" if host.verbs_dmabuf is False
           else "no libibverbs loads")
    return f"no GPUDirect RDMA ({why}): {stage}"


def cross_host(device_kind: str, env: Mapping[str, str], offered, host) -> CrossHost:
    """How ``device_kind`` memory moves to peers on other hosts — pure. ``offered``: the
    transports of ``ucx_info -d``, with their devices (parse_ucx_info) or names only (a set),
    or None (unknown); ``host``: nics.RdmaHost, or None (not read: nothing is said).

    RDMA when an ACTIVE port has an RDMA transport UCX offers and UCX_TLS admits; with device
    memory on a host of several such NICs, ``UCX_NET_DEVICES`` = the GPU's nearest one (UCX
    would otherwise stripe over NICs behind another socket). The list keeps an AM lane: rc, ud,
    dc and srd carry NIXL's active messages across hosts, and ``lo`` is added where no shared
    memory lane would serve NIXL's endpoint to itself (SGLang #40641). A user's
    ``UCX_NET_DEVICES`` naming a device this host lacks, or leaving no AM lane, is refused."""
    if host is None:
        return CrossHost()
    if NET_DEVICES in env:
        _check_net_devices(env, host, offered)
    active = host.active()
    if not active:
        down = "; ".join(str(n) for n in host.nics)
        unseen = sorted({d for tl, devs in offered.items() if tl in RDMA_AM for d in devs}
                        if isinstance(offered, Mapping) else ())
        return CrossHost(lines=(
            f"across hosts: tcp: {'no RDMA port is ACTIVE: ' + down if down else 'no RDMA device'}"
            f" on this host"
            + (f" (sysfs), though this UCX lists {', '.join(unseen)} (a fake libibverbs such "
               f"as UCX's ibmock, or a /sys without class/infiniband): UCX may use them"
               if unseen else ""),))
    ports = {f"{n.name}:{p.number}" for n in active for p in n.active_ports}
    up = ", ".join(sorted(ports))
    if not _listed(env, ports):
        return CrossHost(lines=(
            f"across hosts: tcp although {up} {'is' if len(ports) == 1 else 'are'} ACTIVE: "
            f"{NET_DEVICES}={_shown(env[NET_DEVICES])} (yours) names none of them",))
    ports = _listed(env, ports)  # the ports the user's device list keeps (all: none set)
    up = ", ".join(sorted(ports))
    if offered is None:
        return CrossHost(lines=(f"across hosts: RDMA ports {up} are ACTIVE; this UCX's "
                                f"transports are unknown (no ucx_info on PATH): UCX chooses",))
    by_device = offered if isinstance(offered, Mapping) else None
    rdma = {tl for tl in offered if tl in RDMA_AM
            and (by_device is None or by_device[tl] & ports)}
    if not rdma:
        return CrossHost(lines=(
            f"across hosts: tcp although {up} {'is' if len(ports) == 1 else 'are'} ACTIVE: "
            f"this UCX offers no RDMA transport there (ucx_info -d lists none: a build without "
            f"verbs, or libibverbs missing its provider)",))
    admitted_rdma = admitted(env, rdma)
    if not admitted_rdma:
        return CrossHost(lines=(
            f"across hosts: tcp although {up} {'is' if len(ports) == 1 else 'are'} ACTIVE: "
            f"UCX_TLS={_shown(env.get('UCX_TLS', ''))} (yours) admits none of "
            f"{', '.join(sorted(rdma))}",))
    lines = [f"across hosts: RDMA ({', '.join(sorted(admitted_rdma))} on {up}), which also carries "
             f"NIXL's active messages with peer-failure handling"]
    settings: dict[str, str] = {}
    if NET_DEVICES in env:
        lines.append(f"{NET_DEVICES}={_shown(env[NET_DEVICES])}: yours, kept")
    elif device_kind == "cpu":
        lines.append(f"{NET_DEVICES} unset: host memory is near every NIC alike; UCX uses "
                     f"{'the one' if len(active) == 1 else 'all ' + str(len(active))}")
    elif len(active) == 1:
        lines.append(f"{NET_DEVICES} unset: {active[0].name} is the only NIC with an ACTIVE "
                     f"port")
    elif host.gpu is None:
        lines.append(f"{NET_DEVICES} unset here: the GPU's PCI address is not known in this "
                     f"process (read from torch only where CUDA is initialized, as in an "
                     f"agent's process with its cache; never for xpu): there, the nearest of "
                     f"{len(active)} NICs, else UCX's choice")
    elif host.nearest is None:
        lines.append(f"{NET_DEVICES} unset: the GPU {host.gpu} is not in sysfs "
                     f"(bus/pci/devices), so its nearest of {len(active)} NICs is unknown: UCX "
                     f"chooses")
    else:
        nic, why = host.nearest
        device = nic.net_device()
        on_it = {tl for tl in admitted_rdma if by_device is None or device in by_device[tl]}
        if not on_it:
            lines.append(f"{NET_DEVICES} unset: UCX offers no RDMA transport UCX_TLS admits on "
                         f"{device}, the GPU's nearest NIC: UCX chooses")
        else:
            chosen = [device]
            shm_lane = usable_am(env) & set(SHM_AM)
            if not shm_lane and "lo" in host.net_interfaces and "tcp" in admitted_am(env):
                chosen.append("lo")  # NIXL's endpoint to itself needs an AM lane too
            settings[NET_DEVICES] = ",".join(chosen)
            lines.append(f"{NET_DEVICES}={settings[NET_DEVICES]}: {device} is the nearest of "
                         f"{len(active)} NICs to the GPU {host.gpu} ({why})"
                         + ("; lo keeps tcp for NIXL's endpoint to itself" if "lo" in chosen
                            else ""))
    if device_kind != "cpu":
        lines.append(f"across hosts, {device_kind} memory: {_gpudirect(device_kind, host)}")
    return CrossHost(settings, tuple(lines))


def describe(added: Mapping[str, str], env: Mapping[str, str], device_kind: str,
             offered=None, cross: CrossHost | None = None) -> list[str]:
    """One line per setting in play: what kvruntime set and why, and what the user set (kept);
    for Intel GPU memory, given the ``offered`` transports, why ``UCX_TLS`` was left to UCX;
    then the ``cross`` host choice (cross_host), which says why of the settings it made."""
    cross = cross or CrossHost()
    names = None if offered is None else set(offered)
    lines = [f"{k}={v}: {REASONS.get(k, 'set by kvruntime')}" for k, v in sorted(added.items())
             if k not in cross.settings]
    for k in sorted(REASONS):
        if k in env and k not in added:
            lines.append(f"{k}={env[k]}: yours, kept")
    if device_kind == "xpu" and names is not None and "UCX_TLS" not in added and \
            "UCX_TLS" not in env:
        lines.append(f"UCX_TLS unset: {xpu_tls(env, names)[1]}")
    return lines + list(cross.lines)


def policy(device_kind: str, env: Mapping[str, str], offered, host=None) -> list[str]:
    """What kvruntime would set for ``device_kind`` memory under ``env``, with why (``describe``),
    the transport choice included: for Intel GPU memory ``UCX_TLS`` chosen or left to UCX and the
    reason, also when the transports UCX offers are unknown; with this ``host``'s RDMA facts
    (nics.RdmaHost), the choice across hosts (cross_host) — pure. A setting that cannot work is
    its one line."""
    try:
        added, cross = _settings(device_kind, env, offered, host)
    except TransportError as exc:
        return [f"refused: {exc}"]
    lines = describe(added, env, device_kind, offered, cross)
    if device_kind == "xpu" and offered is None and "UCX_TLS" not in env:
        lines.insert(len(lines) - len(cross.lines), f"UCX_TLS unset: {xpu_tls(env, None)[1]}")
    return lines


def ucx_settings(device_kind: str, env: Mapping[str, str],
                 offered=None, host=None) -> dict[str, str]:
    """The UCX variables to add for ``device_kind`` given the current ``env``, the transports
    the host's UCX ``offered`` (names, or parse_ucx_info's transports with devices; None:
    unknown) and this ``host``'s RDMA facts (nics.RdmaHost; None: one host's choice only) —
    pure."""
    return _settings(device_kind, env, offered, host)[0]


def _settings(device_kind: str, env: Mapping[str, str], offered, host
              ) -> tuple[dict[str, str], CrossHost]:
    if device_kind not in DEVICE_KINDS:
        raise TransportError(f"device kind {device_kind!r} is not one of {DEVICE_KINDS}")
    names = None if offered is None else set(offered)
    want: dict[str, str] = {}
    tls, _why = xpu_tls(env, names) if device_kind == "xpu" else (None, "")
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
    # across hosts, under what one host's choice leaves (posix's error handling included)
    cross = cross_host(device_kind, {**env, **added}, offered, host)
    return {**added, **cross.settings}, cross


def rdma_facts(device_kind: str, env: Mapping[str, str], device_id: int | None = None,
               offered=None, sysfs: str = "/sys"):
    """This host's RDMA facts (nics.read_host) and the transports its UCX offers with their
    devices: ``ucx_info -d`` runs only where a choice depends on it (Intel GPU memory, an
    ACTIVE RDMA port, or a UCX_NET_DEVICES to check), else ``offered`` stays as given."""
    from . import nics

    host = nics.read_host(device_kind, device_id, sysfs)
    if offered is None and (device_kind == "xpu" or host.active() or NET_DEVICES in env):
        offered = offered_devices()
    return host, offered


def apply_ucx_settings(device_kind: str, env: MutableMapping[str, str] | None = None,
                       offered=None, device_id: int | None = None) -> dict:
    """Add the UCX settings for ``device_kind`` memory (on device ``device_id``: the GPU whose
    nearest NIC carries it across hosts) to ``env`` (this process's), before UCX starts."""
    env = os.environ if env is None else env
    host, offered = rdma_facts(device_kind, env, device_id, offered)
    added = ucx_settings(device_kind, env, offered, host)
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
