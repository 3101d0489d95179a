"""This host's RDMA NICs as sysfs describes them, and the one nearest a GPU.

The wire between hosts is RDMA (DESIGN §9): UCX stripes over every RDMA port it sees unless
``UCX_NET_DEVICES`` narrows it, and a GPU's data crossing the CPU's inter-socket link to reach
a far NIC loses bandwidth. This module only reads; transports.py decides.

Layout read (the kernel's sysfs ABI, Documentation/ABI/stable/sysfs-class-infiniband):

- ``<sysfs>/class/infiniband/<dev>/ports/<n>/state``: ``"4: ACTIVE"`` (number, then name);
- ``.../ports/<n>/link_layer``: ``InfiniBand`` or ``Ethernet`` (RoCE);
- ``.../ports/<n>/rate``: ``"200 Gb/sec (4X HDR)"``;
- ``<sysfs>/class/infiniband/<dev>/device``: a link to the PCI function, whose real path
  names every bridge above it (``/sys/devices/pci0000:17/0000:17:01.0/0000:18:00.0``), and
  its ``numa_node`` (``-1``: none).

Every file may be missing or hold garbage (a driver that half-registered, a container's
partial /sys): such a port or field is skipped or unknown, never an exception.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

# A PCI function's address as sysfs names it: domain:bus:device.function. nvidia-smi writes
# the domain with 8 digits (00000000:18:00.0); sysfs with 4.
_PCI_ADDRESS = re.compile(r"^(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
_ACTIVE = "ACTIVE"
# sysfs attributes are a line or two; anything longer is not what the ABI describes.
_MAX_ATTRIBUTE = 4096


@dataclass(frozen=True)
class Port:
    """One port of an RDMA device: ``number`` (1-based, as UCX_NET_DEVICES writes it), its
    ``state`` name (ACTIVE, DOWN, INIT, ...), ``link_layer`` and ``rate`` as sysfs writes them
    ("" when unreadable)."""

    number: int
    state: str
    link_layer: str
    rate: str

    @property
    def active(self) -> bool:
        return self.state == _ACTIVE


@dataclass(frozen=True)
class Nic:
    """An RDMA device (``mlx5_0``, ``rdmap0``...) with its ports, the real sysfs path of its
    PCI function (None: not a PCI device, or unreadable) and its NUMA node (None: unknown)."""

    name: str
    ports: tuple[Port, ...]
    pci_path: str | None
    numa_node: int | None

    @property
    def active_ports(self) -> tuple[Port, ...]:
        return tuple(p for p in self.ports if p.active)

    def net_device(self) -> str | None:
        """``<name>:<port>`` of its first ACTIVE port, as UCX_NET_DEVICES names it; None when
        no port is up."""
        active = self.active_ports
        return f"{self.name}:{active[0].number}" if active else None

    def __str__(self) -> str:
        ports = ", ".join(f"port {p.number} {p.state or 'state unknown'}"
                          + (f" {p.link_layer}" if p.link_layer else "")
                          + (f" {p.rate}" if p.rate else "") for p in self.ports)
        return f"{self.name} ({ports or 'no ports'})"


def _read(path: str) -> str | None:
    """A sysfs attribute's text, stripped; None when it cannot be read or is not text."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_ATTRIBUTE)
    except OSError:
        return None
    try:
        return raw.decode("ascii").strip()
    except UnicodeDecodeError:
        return None


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _state(text: str | None) -> str:
    """``"4: ACTIVE"`` -> ``"ACTIVE"``; unreadable or garbage -> ""."""
    if not text:
        return ""
    name = text.partition(":")[2].strip() if ":" in text else text
    return name.upper() if re.fullmatch(r"[A-Za-z_]+", name) else ""


def _numa(text: str | None) -> int | None:
    try:
        node = int(text or "")
    except ValueError:
        return None
    return node if node >= 0 else None  # -1: the platform does not say


def _real(path: str) -> str | None:
    """The real path of a sysfs link, or None when it names nothing."""
    if not os.path.exists(path):
        return None
    return os.path.realpath(path)


def rdma_devices(sysfs: str = "/sys") -> list[Nic]:
    """This host's RDMA devices under ``<sysfs>/class/infiniband``, by name; none when the
    class is absent (no RDMA driver loaded). Ports whose directory name is not a number are
    skipped."""
    root = os.path.join(sysfs, "class", "infiniband")
    nics = []
    for name in _listdir(root):
        base = os.path.join(root, name)
        ports = []
        for entry in _listdir(os.path.join(base, "ports")):
            if not entry.isdigit():
                continue
            port = os.path.join(base, "ports", entry)
            ports.append(Port(int(entry), _state(_read(os.path.join(port, "state"))),
                              _read(os.path.join(port, "link_layer")) or "",
                              _read(os.path.join(port, "rate")) or ""))
        device = _real(os.path.join(base, "device"))
        numa = _numa(_read(os.path.join(device, "numa_node"))) if device else None
        nics.append(Nic(name, tuple(sorted(ports, key=lambda p: p.number)), device, numa))
    return nics


def net_interfaces(sysfs: str = "/sys") -> list[str]:
    """This host's network interfaces (``<sysfs>/class/net``): what UCX_NET_DEVICES may name
    beside RDMA ports (tcp's devices)."""
    return _listdir(os.path.join(sysfs, "class", "net"))


def pci_address(text: str) -> str:
    """A PCI address in sysfs's form (``0000:18:00.0``) from ``text`` (``18:00.0``,
    ``00000000:18:00.0``...); ValueError in one line when it is not one."""
    m = _PCI_ADDRESS.match(text.strip()) if isinstance(text, str) else None
    if not m:
        raise ValueError(f"{text!r} is not a PCI address (domain:bus:device.function, "
                         f"e.g. 0000:18:00.0)")
    domain = int(m.group(1) or "0", 16)  # VMD domains (10000) have five digits
    return f"{domain:04x}:{m.group(2).lower()}:{m.group(3).lower()}.{m.group(4)}"


def cuda_pci_address(index: int) -> str | None:
    """The PCI address of CUDA device ``index`` as torch reports it, or None when torch, CUDA
    or the fields (torch >= 2.1 has pci_domain_id/pci_bus_id/pci_device_id) are missing, or
    when this process has not initialized CUDA: asking would initialize it, and a process that
    forks afterwards (a fork server's parent) must not have. A role process with a CUDA cache
    allocated it before its agent, so there the address is known."""
    import sys

    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized():
            return None
        props = torch.cuda.get_device_properties(index)
        return pci_address(f"{int(props.pci_domain_id):x}:{int(props.pci_bus_id):02x}:"
                           f"{int(props.pci_device_id):02x}.0")
    except Exception:  # no torch, no CUDA, an old torch: the address is unknown, not an error
        return None


def _components(path: str) -> list[str]:
    return [part for part in path.split(os.sep) if part]


def shared_path(gpu_path: str, nic: Nic) -> list[str]:
    """The sysfs path components the GPU's and ``nic``'s PCI functions have in common: each
    one more is a bridge nearer to both (the same PCIe switch beats the same root complex,
    which beats another socket's)."""
    if nic.pci_path is None:
        return []
    shared = []
    for a, b in zip(_components(gpu_path), _components(nic.pci_path)):
        if a != b:
            break
        shared.append(a)
    return shared


def _where(shared: list[str]) -> str:
    """Where two PCI functions meet, in words, from their shared path."""
    last = shared[-1] if shared else ""
    if _PCI_ADDRESS.match(last):
        return f"behind the same PCIe bridge {last} as the GPU"
    if last.startswith("pci"):
        return f"under the same PCI root complex {last} as the GPU"
    return "on no PCI path the GPU shares"


def nearest(nics: list[Nic], gpu: str, sysfs: str = "/sys") -> tuple[Nic, str] | None:
    """The NIC with an ACTIVE port nearest the GPU at PCI address ``gpu``, and why: the most
    PCI bridges in common, then the GPU's NUMA node, then the name. None when no NIC has an
    ACTIVE port or the GPU is not in ``<sysfs>/bus/pci/devices`` (then nearness is unknown,
    and a guess by name would be no better than UCX's own choice)."""
    candidates = [n for n in nics if n.active_ports]
    if not candidates:
        return None
    gpu_path = _real(os.path.join(sysfs, "bus", "pci", "devices", pci_address(gpu)))
    if gpu_path is None:
        return None
    gpu_numa = _numa(_read(os.path.join(gpu_path, "numa_node")))

    def key(nic: Nic):
        same_numa = gpu_numa is not None and nic.numa_node == gpu_numa
        return (-len(shared_path(gpu_path, nic)), not same_numa, nic.name)

    ranked = sorted(candidates, key=key)
    best, where = ranked[0], _where(shared_path(gpu_path, ranked[0]))
    if len(ranked) == 1:
        why = f"the only NIC with an ACTIVE port, {where}"
    elif key(best)[0] < key(ranked[1])[0]:
        why = f"{where}, nearer than {ranked[1].name}"
    elif key(best)[1] < key(ranked[1])[1]:
        why = f"as near on PCIe as {ranked[1].name} ({where}), and on the GPU's NUMA node " \
              f"{gpu_numa}"
    else:
        why = f"as near on PCIe and NUMA as {ranked[1].name} ({where}): first by name"
    return best, why


@dataclass(frozen=True)
class RdmaHost:
    """What the cross-host choice needs to know of this host (transports.cross_host): its
    RDMA devices, its network interfaces, whether device memory can be registered with the NIC
    (GPUDirect RDMA), and the GPU in play with its nearest NIC."""

    nics: tuple[Nic, ...] = ()
    net_interfaces: tuple[str, ...] = ()
    nvidia_peermem: bool = False  # NVIDIA's peer-memory module: the NIC maps CUDA memory
    xe_driver: bool = False  # Intel's xe driver, which exports GPU memory as DMA-BUF
    verbs_dmabuf: bool | None = None  # libibverbs has ibv_reg_dmabuf_mr (None: no libibverbs)
    cuda_dmabuf: bool | None = None  # the CUDA driver exports DMA-BUF (None: unknown)
    gpu: str | None = None  # the GPU's PCI address (None: host memory, or not known)
    nearest: tuple[Nic, str] | None = None  # the GPU's nearest NIC with an ACTIVE port, and why

    def active(self) -> list[Nic]:
        return [n for n in self.nics if n.active_ports]

    def ports(self) -> list[str]:
        """Every RDMA port, as UCX_NET_DEVICES names them (mlx5_0:1), whatever its state."""
        return [f"{n.name}:{p.number}" for n in self.nics for p in n.ports]


def verbs_dmabuf() -> bool | None:
    """Whether this host's libibverbs registers DMA-BUF memory (rdma-core >= 34 exports
    ibv_reg_dmabuf_mr); None when no libibverbs loads."""
    import ctypes

    try:
        lib = ctypes.CDLL("libibverbs.so.1")
    except OSError:
        return None
    return hasattr(lib, "ibv_reg_dmabuf_mr")


# CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED in cuda.h (CUDA >= 11.7)
_CU_DMA_BUF_SUPPORTED = 124


def cuda_dmabuf(index: int) -> bool | None:
    """Whether the CUDA driver exports device ``index``'s memory as DMA-BUF, by
    cuDeviceGetAttribute; None when libcuda or the device is not there."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        device, value = ctypes.c_int(), ctypes.c_int()
        if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(device), index) != 0:
            return None
        if cuda.cuDeviceGetAttribute(ctypes.byref(value), _CU_DMA_BUF_SUPPORTED, device) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return bool(value.value)


def read_host(device_kind: str, device_id: int | None = None, sysfs: str = "/sys") -> RdmaHost:
    """This host's facts for the cross-host choice, for ``device_kind`` memory on device
    ``device_id`` (cuda: its PCI address from torch; xpu: not known, so no nearest NIC)."""
    nics = tuple(rdma_devices(sysfs))
    module = os.path.join(sysfs, "module")
    wire = any(n.active_ports for n in nics)  # the rest matters only with RDMA in play
    gpu = cuda_pci_address(device_id) if wire and device_kind == "cuda" and \
        device_id is not None else None
    near = None
    if gpu is not None and len([n for n in nics if n.active_ports]) > 1:
        try:
            near = nearest(list(nics), gpu, sysfs)
        except ValueError:  # torch gave no PCI address we can read: nearness unknown
            near = None
    return RdmaHost(
        nics=nics, net_interfaces=tuple(net_interfaces(sysfs)),
        nvidia_peermem=os.path.isdir(os.path.join(module, "nvidia_peermem")),
        xe_driver=os.path.isdir(os.path.join(module, "xe")),
        verbs_dmabuf=verbs_dmabuf() if wire and device_kind != "cpu" else None,
        cuda_dmabuf=cuda_dmabuf(device_id) if wire and gpu is not None else None,
        gpu=gpu, nearest=near)
