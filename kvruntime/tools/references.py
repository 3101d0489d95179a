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
