"""Registering a KV cache with NIXL once, and preparing descriptor lists once per peer.

Prepared lists hold one descriptor per (region, block) — index ``region * num_blocks + block``
— so any request is a list of indices; NIXL merges consecutive indices of adjacent memory, so a
run of blocks goes out as one descriptor (see plan.py). ``close`` releases everything once.
"""

from __future__ import annotations

import logging

from ..errors import NixlError
from ..layout import KVLayout
from ..memory import KVCache
from .agent import Agent

log = logging.getLogger(__name__)


def block_descriptors(layout: KVLayout, regions, device_id_of=None):
    """Nx3 numpy array of (address, length, device id) per (region, block)."""
    import numpy as np

    if len(regions) * layout.num_blocks > np.iinfo(np.int32).max:  # plan.nixl_indices: int32
        raise NixlError(f"{len(regions)} regions x {layout.num_blocks} blocks is more "
                        f"descriptors than NIXL's int32 indices reach")
    chunk = layout.chunk_bytes
    offsets = np.arange(layout.num_blocks, dtype=np.uint64) * np.uint64(chunk)
    rows = []
    for address, _length, device in regions:
        block = np.empty((layout.num_blocks, 3), dtype=np.uint64)
        block[:, 0] = np.uint64(address) + offsets
        block[:, 1] = chunk
        block[:, 2] = device
        rows.append(block)
    return np.concatenate(rows)


class Registration:
    def __init__(self, agent: Agent, cache: KVCache):
        self.agent = agent
        self.cache = cache
        self._reg = None
        self._local = None
        self._remote: dict[str, object] = {}
        self._closed = False
        regions = [(r.address, r.nbytes, r.device_id, "") for r in cache.regions]
        self._reg = agent.call("register_memory", agent.nixl.register_memory, regions,
                               cache.mem_type)
        try:
            descs = block_descriptors(cache.layout, self.region_triples())
            self._local = agent.call("prep_xfer_dlist (local)", agent.nixl.prep_xfer_dlist,
                                     "NIXL_INIT_AGENT", descs, cache.mem_type)
        except Exception:
            self.close()
            raise

    def region_triples(self) -> tuple[tuple[int, int, int], ...]:
        return tuple((r.address, r.nbytes, r.device_id) for r in self.cache.regions)

    @property
    def local_dlist(self):
        return self._local

    def prepare_peer(self, peer_agent: str, layout: KVLayout, regions, mem_type: str):
        """The peer's prepared list, made once per peer (replacing a stale one)."""
        self.release_peer(peer_agent)
        descs = block_descriptors(layout, regions)
        handle = self.agent.call(f"prep_xfer_dlist (peer {peer_agent})",
                                 self.agent.nixl.prep_xfer_dlist, peer_agent, descs, mem_type)
        self._remote[peer_agent] = handle
        return handle

    def peer_dlist(self, peer_agent: str):
        try:
            return self._remote[peer_agent]
        except KeyError:
            raise NixlError(f"no prepared descriptor list for peer {peer_agent}") from None

    def release_peer(self, peer_agent: str) -> None:
        handle = self._remote.pop(peer_agent, None)
        if handle is not None:
            self._release(handle, f"peer list of {peer_agent}")

    def forget_peer(self, peer_agent: str) -> None:
        """A peer is gone: its prepared list, then its agent (NIXL's remote metadata, its
        endpoints) — a failure is logged, the peer is gone either way."""
        self.release_peer(peer_agent)
        try:
            self.agent.remove_remote(peer_agent)
        except NixlError as exc:
            log.warning("removing agent %s: %s", peer_agent, exc)

    def _release(self, handle, what: str) -> None:
        try:
            with self.agent.lock:
                handle.release()
        except Exception as exc:  # keep closing the rest
            log.warning("releasing %s failed: %s", what, exc)

    @property
    def peers(self) -> list[str]:
        return list(self._remote)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for name in list(self._remote):
            self.release_peer(name)
        if self._local is not None:
            self._release(self._local, "local list")
            self._local = None
        if self._reg is not None:
            try:
                self.agent.call("deregister_memory", self.agent.nixl.deregister_memory, self._reg)
            except NixlError as exc:
                log.warning("%s", exc)
            self._reg = None


class Scratch:
    """A few bytes of the cache's own memory kind (same device), registered with NIXL: the
    destination of a connect-time probe READ, so that UCX selects, and prints, the protocol a
    peer's memory takes before any KV moves (decode/client.py: the lane check)."""

    NBYTES = 256

    def __init__(self, agent: Agent, cache: KVCache):
        from ..memory import HostBuffer

        self.agent = agent
        tensors = cache.tensors
        if tensors and tensors[0].device.type != "cpu":
            import torch

            self._owner = torch.empty(self.NBYTES, dtype=torch.uint8, device=tensors[0].device)
            self.address, self.device_id = self._owner.data_ptr(), cache.regions[0].device_id
        else:
            self._owner = HostBuffer(self.NBYTES, huge_pages=False)
            self.address, self.device_id = self._owner.address, 0
        self.mem_type = cache.mem_type
        self._reg = agent.call("register_memory (probe)", agent.nixl.register_memory,
                               [(self.address, self.NBYTES, self.device_id, "")], self.mem_type)

    def descriptor(self, nbytes: int):
        import numpy as np

        return np.array([[self.address, min(nbytes, self.NBYTES), self.device_id]],
                        dtype=np.uint64)

    def close(self) -> None:
        if self._reg is not None:
            try:
                self.agent.call("deregister_memory (probe)", self.agent.nixl.deregister_memory,
                                self._reg)
            except NixlError as exc:
                log.warning("%s", exc)
            self._reg = None
            if hasattr(self._owner, "close"):
                self._owner.close()
