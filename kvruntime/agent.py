"""One NIXL agent with its UCX backend, behind a lock, with NIXL's quirks smoothed over.

Every call into NIXL goes through this class so that the server's connection threads, its
notification poller and the caller never use the agent concurrently, and so that NIXL's
exceptions become kvruntime errors that say what was being done.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import uuid

from .binding import NixlBinding, as_str, load_nixl
from .errors import NixlError, TransportError
from . import ucxlog
from .transports import apply_ucx_settings, forced_by_user

log = logging.getLogger(__name__)


def unique_name(role: str) -> str:
    return f"kvr-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class Agent:
    def __init__(
        self,
        name: str,
        binding: NixlBinding | None = None,
        device_kind: str = "cpu",
        ucx_threads: int = 0,
        progress_thread: bool = False,
    ):
        self.ucx_threads = ucx_threads
        self.binding = binding or load_nixl()
        self.ucx_env = apply_ucx_settings(device_kind)
        self.ucx_log = ucxlog.this_process()
        self.name = name
        self.lock = threading.RLock()
        self._closed = False
        api = self.binding.api
        # NIXL's progress thread spins on a whole core (measured: 0.9 CPU while idle); on the
        # 2-core hosts this runs on, two spinning processes starve the copies themselves.
        # Without it, progress happens in our own polls (transfer state, notifications).
        wanted = {"enable_prog_thread": progress_thread, "enable_listen_thread": False, "backends": [],
                  "capture_telemetry": True}
        accepted = inspect.signature(self.binding.config_class).parameters
        config = self.binding.config_class(**{k: v for k, v in wanted.items() if k in accepted})
        try:
            self.nixl = self.binding.agent_class(name, config)
        except Exception as exc:
            raise NixlError(f"NIXL ({self.binding.module_name}) could not create agent "
                            f"{name}: {exc}") from exc
        params = {}
        if ucx_threads > 0:
            # NIXL's UCX thread-pool engine splits one request's descriptors over its threads
            # only from split_batch_size descriptors on (default 1024): let a few large
            # descriptors run in parallel.
            params = {"num_threads": str(ucx_threads), "split_batch_size": "1"}
        if "UCX" not in self.nixl.get_plugin_list():
            raise NixlError(
                f"NIXL ({self.binding.module_name}) has no UCX plugin; plugins found: "
                f"{', '.join(self.nixl.get_plugin_list()) or 'none'} "
                f"(check NIXL_PLUGIN_DIR)"
            )
        try:
            self.nixl.create_backend("UCX", params)
        except Exception as exc:
            raise NixlError(f"NIXL could not create its UCX backend: {exc} (UCX needs a "
                            f"working loopback interface and an active-message transport)"
                            ) from exc
        self.telemetry = hasattr(self.nixl, "get_xfer_telemetry")
        _ = api

    def call(self, what: str, fn, *args, **kwargs):
        """Run ``fn`` under the agent lock; NIXL exceptions become NixlError naming ``what``."""
        with self.lock:
            try:
                return fn(*args, **kwargs)
            except NixlError:
                raise
            except Exception as exc:
                raise NixlError(f"NIXL {what} failed: {type(exc).__name__}: {exc}") from exc

    def metadata(self) -> bytes:
        return bytes(self.call("get_agent_metadata", self.nixl.get_agent_metadata))

    def add_remote(self, metadata: bytes) -> str:
        return as_str(self.call("add_remote_agent", self.nixl.add_remote_agent, metadata))

    def remove_remote(self, name: str) -> None:
        self.call("remove_remote_agent", self.nixl.remove_remote_agent, name)

    def descriptor_count(self, handle) -> int | None:
        """Descriptors NIXL posted for ``handle`` (after merging), when telemetry exists."""
        if not self.telemetry:
            return None
        try:
            with self.lock:
                return int(self.nixl.get_xfer_telemetry(handle).descCount)
        except Exception:  # telemetry off or absent in this NIXL build
            return None

    def lanes(self) -> list[ucxlog.Lane] | None:
        """The protocols UCX selected for this agent so far, with their transports (None when
        the user routes UCX's log elsewhere)."""
        if self.ucx_log is None:
            return None
        self.ucx_log.read()
        return ucxlog.lanes_of(self.ucx_log.lanes, self.name)

    def transports(self) -> dict[str, list[str]] | None:
        """The transports UCX selected for this agent's peers, by kind of operation."""
        lanes = self.lanes()
        return None if lanes is None else ucxlog.summary(lanes)

    def check_device_lanes(self, what: str, local_device: bool, remote_device: bool
                           ) -> list[ucxlog.Lane]:
        """Transfers of these memory kinds (ours, the peer's: device memory or not) that UCX
        put on TCP are an error (a loud warning when the user forced UCX_TLS): never silent.
        Returns the offending lanes."""
        bad = ucxlog.device_lanes_on_tcp(self.lanes() or [], local_device, remote_device)
        if not bad:
            return []
        text = (f"{what}: UCX moves device memory over TCP ({'; '.join(map(str, bad))}); "
                f"expect ~1 GB/s instead of the device's speed")
        if forced_by_user("UCX_TLS", self.ucx_env):
            log.warning("%s, as UCX_TLS=%s (set by you) asks", text, os.environ["UCX_TLS"])
            return bad
        raise TransportError(text + ": check that UCX was built with the device's transports "
                             "(ucx_info -d lists cuda_ipc / ze_ipc) and that UCX_TLS, if set, "
                             "admits them; CUDA reads also need UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on")

    def close(self) -> None:
        # nixl_agent has no explicit destroy; dropping the last reference tears it down.
        if self._closed:
            return
        self._closed = True
        with self.lock:
            self.nixl = None
