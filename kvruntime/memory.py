"""KV memory: host buffers (no torch needed) and device tensors (torch, when present).

Host buffers are anonymous ``mmap`` areas rounded up to 2 MiB and advised ``MADV_HUGEPAGE``
(THP is ``madvise`` on the CI hosts): UCX's cma transport copies page by page, so huge pages
move host KV faster (DESIGN §4). Pages are touched once at allocation so that the first
transfer does not pay the page faults. Addresses are plain ints.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
from dataclasses import dataclass

from .errors import KVRuntimeError, LayoutError
from .layout import CROSS_LAYER, KVLayout

HUGE_PAGE = 2 * 1024 * 1024


@dataclass(frozen=True)
class MemoryRegion:
    address: int
    nbytes: int
    device_id: int
    mem_type: str  # "DRAM" or "VRAM"


class HostBuffer:
    """An anonymous, optionally huge-page backed, prefaulted host allocation."""

    def __init__(self, nbytes: int, huge_pages: bool = True):
        if nbytes <= 0:
            raise KVRuntimeError(f"host buffer size must be positive, got {nbytes}")
        self.nbytes = nbytes
        size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.huge_pages = False
        if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
                self.huge_pages = True
            except OSError:
                pass  # THP disabled ("never"): fall back to 4 KiB pages
        anchor = ctypes.c_char.from_buffer(self._map)
        self.address = ctypes.addressof(anchor)
        del anchor  # release the buffer export so that close() can unmap
        ctypes.memset(self.address, 0, size)  # prefault every page once

    @property
    def view(self) -> memoryview:
        return memoryview(self._map)[: self.nbytes]

    def close(self) -> None:
        if not self._map.closed:
            self._map.close()

    @property
    def closed(self) -> bool:
        return self._map.closed


class KVCache:
    """A layout bound to memory: one ``MemoryRegion`` per layout region."""

    def __init__(self, layout: KVLayout, regions: list[MemoryRegion], owner=None):
        if len(regions) != layout.num_regions:
            raise LayoutError(f"layout needs {layout.num_regions} regions, got {len(regions)}")
        for r in regions:
            if r.nbytes < layout.region_bytes:
                raise LayoutError(f"region of {r.nbytes} bytes is smaller than "
                                  f"{layout.region_bytes}")
        if len({r.mem_type for r in regions}) != 1:
            raise LayoutError("all regions of one cache must be of one memory type")
        self.layout = layout
        self.regions = list(regions)
        self._owner = owner  # keeps host buffers or tensors alive
        self._closed = False

    @property
    def mem_type(self) -> str:
        return self.regions[0].mem_type

    @classmethod
    def allocate_host(cls, layout: KVLayout, huge_pages: bool = True) -> "KVCache":
        """One huge-page backed host buffer, carved into the layout's regions."""
        buf = HostBuffer(layout.total_bytes, huge_pages)
        regions = [MemoryRegion(buf.address + i * layout.region_bytes, layout.region_bytes, 0,
                                "DRAM") for i in range(layout.num_regions)]
        return cls(layout, regions, owner=buf)

    @classmethod
    def from_tensors(cls, layout: KVLayout, tensors: list) -> "KVCache":
        """Wrap torch tensors (one per region, contiguous). cuda/xpu tensors register as VRAM
        with their own device index; cpu tensors as DRAM."""
        regions = []
        for t in tensors:
            if not t.is_contiguous():
                raise LayoutError("KV tensors must be contiguous")
            dev = t.device
            mem = "DRAM" if dev.type == "cpu" else "VRAM"
            idx = 0 if dev.type == "cpu" else (dev.index if dev.index is not None else 0)
            regions.append(MemoryRegion(t.data_ptr(), t.numel() * t.element_size(), idx, mem))
        return cls(layout, regions, owner=list(tensors))

    @classmethod
    def allocate_device(cls, layout: KVLayout, device: str, device_id: int) -> "KVCache":
        """One byte tensor per layout region on ``device:device_id`` (needs torch), registered
        as VRAM. The device id is explicit: no reliance on the current device."""
        torch = _torch_for(device)
        count = getattr(torch, device).device_count()
        if not 0 <= device_id < count:
            raise KVRuntimeError(f"{device} device id {device_id} is outside 0..{count - 1}")
        dev = torch.device(device, device_id)
        tensors = [torch.empty(layout.region_bytes, dtype=torch.uint8, device=dev)
                   for _ in range(layout.num_regions)]
        return cls.from_tensors(layout, tensors)

    @property
    def tensors(self) -> list | None:
        """The torch tensors behind a cache made from tensors (None for host buffers)."""
        return self._owner if isinstance(self._owner, list) else None

    def _byte_views(self) -> list:
        """Each region's tensor as a flat uint8 tensor (offsets in the layout are bytes)."""
        import torch

        return [t.reshape(-1).view(torch.uint8) for t in self.tensors]

    def synchronize(self) -> None:
        """Finish pending device work on the cache (fills), so NIXL sees the final bytes."""
        for t in self.tensors or ():
            if t.device.type != "cpu":
                getattr(_torch_for(t.device.type), t.device.type).synchronize(t.device)

    # -- content access: host memory directly, device tensors through one copy to host -------
    def _host_bytes(self, region: int, offset: int, length: int) -> bytes:
        if self.mem_type != "DRAM":
            raise KVRuntimeError("direct byte access needs host memory")
        return ctypes.string_at(self.regions[region].address + offset, length)

    def fill_random(self, seed: int) -> None:
        """Deterministic pseudo-random content (fast: numpy when present; on the device for
        device tensors)."""
        total = self.layout.region_bytes
        if self.mem_type == "VRAM":
            for i, t in enumerate(self._byte_views()):
                gen = _torch_for(t.device.type).Generator(device=t.device)
                gen.manual_seed(seed * 1000003 + i)
                t.random_(0, 256, generator=gen)
            self.synchronize()
            return
        try:
            import numpy as np

            rng = np.random.default_rng(seed)
            for r in self.regions:
                arr = np.ctypeslib.as_array((ctypes.c_uint8 * total).from_address(r.address))
                arr[:] = rng.integers(0, 256, size=total, dtype=np.uint8)
        except ImportError:
            import random

            rnd = random.Random(seed)
            for r in self.regions:
                ctypes.memmove(r.address, rnd.randbytes(total), total)

    def head_view(self):
        """A copy of the cache as numpy ``[block][2 x layers][token][head][bytes of a head]``,
        whatever the layout kind and memory: what mixed-TP checks compare head by head."""
        import numpy as np

        lay = self.layout
        if self.mem_type == "VRAM":
            self.synchronize()
            regions = [t.cpu().numpy() for t in self._byte_views()]
        else:
            regions = [np.ctypeslib.as_array((ctypes.c_uint8 * lay.region_bytes)
                                             .from_address(r.address)).copy()
                       for r in self.regions]
        de = lay.head_dim * lay.element_bytes
        if lay.kind == CROSS_LAYER:
            return regions[0][:lay.region_bytes].reshape(
                lay.num_blocks, 2 * lay.num_layers, lay.tokens_per_block, lay.num_kv_heads, de)
        return np.stack([r[:lay.region_bytes].reshape(lay.num_blocks, lay.tokens_per_block,
                                                      lay.num_kv_heads, de) for r in regions],
                        axis=1)

    def fill_value(self, value: int) -> None:
        if self.mem_type == "VRAM":
            for t in self._byte_views():
                t.fill_(value)
            self.synchronize()
            return
        for r in self.regions:
            ctypes.memset(r.address, value, self.layout.region_bytes)

    def block_digest(self, block: int) -> str:
        return self.block_digests([block])[0]

    def block_digests(self, blocks) -> list[str]:
        """blake2b of every block's bytes (all its extents, in region order). Device blocks are
        gathered on the device and copied to host once, so host and device caches holding the
        same bytes give the same digests."""
        extents = [self.layout.block_extents(b) for b in blocks]
        data = self._device_bytes(extents) if self.mem_type == "VRAM" else None
        out, pos = [], 0
        for ext in extents:
            h = hashlib.blake2b(digest_size=16)
            for region, offset, length in ext:
                if data is None:
                    h.update(self._host_bytes(region, offset, length))
                else:
                    h.update(data[pos:pos + length])
                    pos += length
            out.append(h.hexdigest())
        return out

    def _device_bytes(self, extents) -> memoryview:
        import torch

        views = self._byte_views()
        parts = [views[region][offset:offset + length]
                 for ext in extents for region, offset, length in ext]
        if not parts:
            return memoryview(b"")
        return memoryview(torch.cat(parts).cpu().numpy()).cast("B")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if isinstance(self._owner, HostBuffer):
            self._owner.close()
        self._owner = None


def _torch_for(device: str):
    """torch, checked to offer ``device`` ("cuda" or "xpu"); a KVRuntimeError says why not."""
    try:
        import torch
    except ImportError:
        raise KVRuntimeError(f"{device} memory needs torch, which is not installed") from None
    module = getattr(torch, device, None)
    if module is None or not module.is_available():
        raise KVRuntimeError(f"torch {torch.__version__} sees no {device} device")
    return torch


def device_unavailable(device: str) -> str | None:
    """None when ``device`` memory can be allocated here, else the reason it cannot."""
    if device == "cpu":
        return None
    try:
        _torch_for(device)
    except KVRuntimeError as exc:
        return str(exc)
    return None


def thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
        return text[text.index("[") + 1: text.index("]")]
    except (OSError, ValueError):
        return "unknown"


def page_size() -> int:
    return os.sysconf("SC_PAGE_SIZE")
