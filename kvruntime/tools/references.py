"""The references every bench row is rated against, measured in the same run as the transfers:
a host memmove, or a device (or peer) copy of the same bytes."""

from __future__ import annotations

import ctypes
import time

from ..memory import HostBuffer


class HostReference:
    """memmove between two host buffers with the bench's page setting."""

    label = "host memmove, same run"

    def __init__(self, nbytes: int, huge_pages: bool):
        self.src = HostBuffer(nbytes, huge_pages)
        self.dst = HostBuffer(nbytes, huge_pages)
        ctypes.memset(self.src.address, 0x5A, nbytes)

    def gbps(self, nbytes: int) -> float:
        t = time.perf_counter()
        ctypes.memmove(self.dst.address, self.src.address, nbytes)
        return nbytes / (time.perf_counter() - t) / 1e9

    def close(self) -> None:
        self.src.close()
        self.dst.close()


class DeviceReference:
    """What bounds a device transfer, timed like the transfers (wall clock from a synchronized
    start to a synchronized end): a device-to-device ``copy_`` (cudaMemcpy) on the decode's
    device when both sides share it; torch's peer copy from the prefill's device to the
    decode's when they differ (the local copy is then reported beside it, never as the bound).
    """

    def __init__(self, nbytes: int, device: str, device_ids):
        import torch

        self.module = getattr(torch, device)
        src_dev = torch.device(device, device_ids[0])
        self.device = torch.device(device, device_ids[1])
        self.peer = device_ids[0] != device_ids[1]
        self.label = (f"{device} peer copy_ {device}:{device_ids[0]} -> {device}:{device_ids[1]},"
                      f" same run" if self.peer else
                      f"{device} device-to-device copy_ on {device}:{device_ids[1]}, same run")
        self.src = torch.full((nbytes,), 0x5A, dtype=torch.uint8,
                              device=src_dev if self.peer else self.device)
        self.dst = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.local_src = (torch.full((nbytes,), 0x5A, dtype=torch.uint8, device=self.device)
                          if self.peer else self.src)

    def _time(self, src, nbytes: int) -> float:
        self.module.synchronize(src.device)
        self.module.synchronize(self.device)
        t = time.perf_counter()
        self.dst[:nbytes].copy_(src[:nbytes])
        self.module.synchronize(src.device)
        self.module.synchronize(self.device)
        return nbytes / (time.perf_counter() - t) / 1e9

    def gbps(self, nbytes: int) -> float:
        return self._time(self.src, nbytes)

    def local_gbps(self, nbytes: int) -> float | None:
        return self._time(self.local_src, nbytes) if self.peer else None

    def close(self) -> None:
        self.src = self.dst = self.local_src = None


class RankReference:
    """What bounds one mixed-TP decode rank: the bytes it receives, copied from where they live
    to where it keeps them, timed like its transfers (from a synchronized start to a
    synchronized end) and started at the same moment as the other ranks' so that their sum is
    measured at once. Device memory: one torch copy per part, from that part's prefill device to
    the rank's (a peer copy across GPUs, a device copy on a shared one), each on a stream of its
    own so that parts from two GPUs overlap as the rank's reads from two prefill ranks do. Host
    memory: one memmove of all of it. ``parts``: (source device id, bytes) per prefill rank."""

    def __init__(self, parts, device: str, device_id: int, huge_pages: bool = True):
        self.nbytes = sum(n for _src, n in parts)
        self.host = None
        if device == "cpu":
            self.host = HostReference(self.nbytes, huge_pages)
            self.label = "host memmove of the rank's bytes, same run"
            return
        import torch

        self.module = getattr(torch, device)
        self.device = torch.device(device, device_id)
        self.sources = [torch.full((n,), 0x5A, dtype=torch.uint8, device=torch.device(device, s))
                        for s, n in parts]
        self.dst = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        self.streams = [self.module.Stream(self.device) for _ in parts]
        self.devices = sorted({self.device.index, *(s for s, _n in parts)})
        self.label = "torch copy_ of the rank's bytes " + ", ".join(
            f"{device}:{s} -> {device}:{device_id}" for s, _n in parts) + ", same run"

    def _sync(self) -> None:
        for d in self.devices:
            self.module.synchronize(d)

    def copy(self) -> tuple[float, float]:
        """(start, end) on the host's monotonic clock (shared by the processes)."""
        if self.host is not None:
            t = time.monotonic()
            ctypes.memmove(self.host.dst.address, self.host.src.address, self.nbytes)
            return t, time.monotonic()
        self._sync()
        t, at = time.monotonic(), 0
        for src, stream in zip(self.sources, self.streams):
            with self.module.stream(stream):
                self.dst[at:at + src.numel()].copy_(src, non_blocking=True)
            at += src.numel()
        self._sync()
        return t, time.monotonic()

    def close(self) -> None:
        if self.host is not None:
            self.host.close()
        self.sources = self.dst = self.streams = None
