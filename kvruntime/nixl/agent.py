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
from dataclasses import dataclass

from ..errors import KVRuntimeError, NixlError, TransportError
from ..options import environment
from . import nics, ucxlog
from .binding import NixlBinding, as_str, load_nixl
from .settle import settle
from .transports import apply_ucx_settings, forced_by_user

log = logging.getLogger(__name__)


# NIXL's UCX thread pool for a decode whose NIXL moves host memory: over cma a READ's copies
# run inside the reading process, one core each (process_vm_readv), while the prefill sits idle.
# Spread over two threads a READ of 4096 random 16 KiB blocks went 0.47 -> 0.75 of the
# contiguous request on the 2-core CI host in its first run, 0.52-0.69 in later ones, 1.5x
# faster each time (BENCHMARKS; a staged 1 GiB 243 -> 109 ms with 4 on a 16-core host). A
# prefill keeps none by default: NIXL 1.5.1 segfaulted in its get_new_notifs with threads on
# both sides across the CPU suite (commit 8e95a24), never with them on a decode's.
UCX_READ_THREADS = 4
MAX_UCX_THREADS = 64  # what KVRUNTIME_UCX_THREADS may ask
# Each UCX worker keeps a ~4 MiB receive pool in /dev/shm (posix), and the thread pool is a
# worker a thread: one agent took 5 / 9 / 13 / 21 MiB with 0 / 1 / 2 / 4 threads. A container's
# /dev/shm is 64 MiB unless sized (docker's default), which a TP group's decodes on threads
# outgrew (CI's second host: 4 decode ranks of 3 workers and their prefills, ~68 MB), and a full
# /dev/shm crashed UCX 1.22 (transports.py). So threads are chosen only with this much free.
UCX_THREADS_MIN_SHM = 256 << 20


def shm_free(path: str = "/dev/shm") -> int | None:
    """Bytes free in /dev/shm (None: none there), where UCX's shared memory lives."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def ucx_threads(requested, role: str, nixl_memory: str, cpus: int,
                shm: int | None, environ=None) -> tuple[int, str]:
    """NIXL's UCX threads for this side, and why. ``requested`` (None: choose) wins, then, on
    a decode, KVRUNTIME_UCX_THREADS in ``environ`` (None: the process's);
    a decode whose NIXL moves host memory (``nixl_memory`` "cpu": a host cache or a
    host-staged pool) on a host of 2 cores or more, with ``UCX_THREADS_MIN_SHM`` of /dev/shm
    free (``shm`` bytes), takes one a core, at most ``UCX_READ_THREADS``; anything else none
    (the caller's own polls progress)."""
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 0:
            raise KVRuntimeError(f"ucx_threads must be 0 or more, or None (choose), got "
                                 f"{requested!r}")
        return requested, "yours"
    chosen = environment("KVRUNTIME_UCX_THREADS", environ) if role == "decode" else None
    if chosen is not None:
        if not (chosen.isdigit() and len(chosen) <= 2 and int(chosen) <= MAX_UCX_THREADS):
            raise KVRuntimeError(f"KVRUNTIME_UCX_THREADS must be a number of threads from 0 to "
                                 f"{MAX_UCX_THREADS}, got {chosen[:20]!r}; unset it to let "
                                 f"kvruntime choose")
        return int(chosen), "KVRUNTIME_UCX_THREADS"
    if role != "decode":
        return 0, "a prefill's READs are the decode's: its NIXL calls progress in its own loop"
    if nixl_memory != "cpu":
        return 0, f"NIXL moves {nixl_memory} memory here: its copies are the device's"
    if cpus < 2:
        return 0, "one core: the copies run in the caller's polls"
    if shm is None or shm < UCX_THREADS_MIN_SHM:
        have = "no /dev/shm" if shm is None else f"{shm >> 20} MiB free in /dev/shm"
        return 0, (f"{have} (< {UCX_THREADS_MIN_SHM >> 20} MiB; a container's default is 64: "
                   f"--shm-size): each UCX thread's worker takes ~4 MiB of it")
    n = min(cpus, UCX_READ_THREADS)
    return n, f"host memory over cma on {cpus} cores: a READ's copies over {n} threads"


@dataclass(frozen=True)
class LaneFault:
    """Lanes UCX chose that move KV data at a fraction of the speed in reach: what is wrong
    (``text``), what to check (``advice``), and the user's settings that make it their choice
    (``forced_by``: a warning then, not an error)."""

    lanes: tuple[ucxlog.Lane, ...]
    text: str
    advice: str
    forced_by: tuple[str, ...]


def lane_faults(lanes, local_device: bool, remote_device: bool,
                rdma_ports: tuple[str, ...]) -> list[LaneFault]:
    """The faults among ``lanes`` (ucxlog.Lane) — pure: device memory over TCP between peers,
    and, where this host has ACTIVE ``rdma_ports`` (mlx5_0:1...), data to a peer on another
    host over TCP (such a lane is named once, as the latter: the NIC is what it missed)."""
    remote = ucxlog.inter_node_lanes_on_tcp(lanes) if rdma_ports else []
    device = [lane for lane in ucxlog.device_lanes_on_tcp(lanes, local_device, remote_device)
              if lane not in remote]
    faults = []
    if device:
        faults.append(LaneFault(
            tuple(device), f"UCX moves device memory over TCP ({'; '.join(map(str, device))}); "
            f"expect ~1 GB/s instead of the device's speed",
            "check that UCX was built with the device's transports (ucx_info -d lists "
            "cuda_ipc / ze_ipc) and that UCX_TLS, if set, admits them; CUDA reads also need "
            "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on", ("UCX_TLS",)))
    if remote:
        ports = ", ".join(rdma_ports)
        faults.append(LaneFault(
            tuple(remote), f"UCX moves data to a peer on another host over TCP "
            f"({'; '.join(map(str, remote))}) while this host's RDMA "
            f"{'port' if len(rdma_ports) == 1 else 'ports'} {ports} "
            f"{'is' if len(rdma_ports) == 1 else 'are'} ACTIVE; expect ~1 GB/s instead of the "
            f"NIC's speed",
            f"check that ucx_info -d lists rc/ud/dc/srd on {ports} (UCX built with verbs), "
            f"that the peer's host has an ACTIVE RDMA port on the same fabric, and that "
            f"UCX_TLS and UCX_NET_DEVICES, if set, admit them (python -m kvruntime policy "
            f"says the choice across hosts)", ("UCX_TLS", "UCX_NET_DEVICES")))
    return faults


def active_rdma_ports(sysfs: str = "/sys") -> tuple[str, ...]:
    """This host's ACTIVE RDMA ports as UCX names them (mlx5_0:1), from sysfs (nics.py)."""
    return tuple(f"{nic.name}:{port.number}" for nic in nics.rdma_devices(sysfs)
                 for port in nic.active_ports)


def unique_name(role: str) -> str:
    return f"kvr-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class Agent:
    def __init__(
        self,
        name: str,
        binding: NixlBinding | None = None,
        *,
        device_kind: str = "cpu",
        ucx_threads: int = 0,
        progress_thread: bool = False,
        device_id: int | None = None,
    ):
        self.ucx_threads = ucx_threads
        self.binding = binding or load_nixl()
        # device_id: the GPU whose nearest NIC carries its memory to other hosts (transports)
        self.ucx_env = apply_ucx_settings(device_kind, device_id=device_id)
        clash = self.binding.efa_clash()
        if clash and "UCX_MODULES" not in os.environ:  # read when the UCX backend starts, below
            os.environ["UCX_MODULES"] = self.ucx_env["UCX_MODULES"] = "^efa"
            log.info("UCX_MODULES=^efa: %s", clash)
        self.ucx_log = ucxlog.this_process()
        # a peer on another host is reached over these, not TCP (check_device_lanes)
        self.rdma_ports = active_rdma_ports()
        self.name = name
        self.lock = threading.RLock()
        self._closed = False
        self.failed_transfers = 0  # its close first settles what they left in UCX (settle.py)
        api = self.binding.api
        # NIXL's progress thread spins on a whole core (measured: 0.9 CPU while idle); on the
        # 2-core hosts this runs on, two spinning processes starve the copies themselves.
        # Without it, progress happens in our own polls (transfer state, notifications).
        wanted = {"enable_prog_thread": progress_thread, "enable_listen_thread": False,
                  "backends": [], "capture_telemetry": True}
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
            shm = shm_free()
            room = "no /dev/shm" if shm is None else f"{shm >> 20} MiB free in /dev/shm"
            with_threads = f" with {ucx_threads} UCX threads" if ucx_threads else ""
            raise NixlError(f"NIXL could not create its UCX backend{with_threads}: {exc} (UCX "
                            f"needs a working loopback interface, an active-message transport, "
                            f"and ~4 MiB of /dev/shm a worker, one more a UCX thread: {room})"
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

    def notify(self, remote: str, payload: bytes) -> None:
        """A NIXL notification to agent ``remote``, on its own (no transfer carries it)."""
        self.call("send_notif", self.nixl.send_notif, remote, payload)

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
        So are transfers to a peer on another host over TCP while this host has an ACTIVE
        RDMA port (a warning when the user forced UCX_TLS or UCX_NET_DEVICES). Returns the
        offending lanes."""
        bad = lane_faults(self.lanes() or [], local_device, remote_device, self.rdma_ports)
        errors = []
        for fault in bad:
            forced = [n for n in fault.forced_by if forced_by_user(n, self.ucx_env)]
            text = f"{what}: {fault.text}"
            if forced:
                log.warning("%s, as %s (set by you) asks", text,
                            ", ".join(f"{n}={os.environ[n]}" for n in forced))
            else:
                errors.append(f"{text}: {fault.advice}")
        if errors:
            raise TransportError("; ".join(errors))
        return [lane for fault in bad for lane in fault.lanes]

    def close(self) -> None:
        # nixl_agent has no explicit destroy; dropping the last reference tears it down.
        if self._closed:
            return
        self._closed = True
        with self.lock:
            if self.failed_transfers:
                settle(self)
            self.nixl = None


def open_agent(options, cache, role: str) -> tuple[Agent, str]:
    """One side's NIXL agent for ``cache`` under ``options`` (options.Options), and why it has
    the UCX threads it has. NIXL moves host memory only when the side is host-staged (its
    pools), whatever the cache is on; a device cache's GPU names the NIC nearest to it
    (transports.cross_host)."""
    nixl_memory = "cpu" if options.kv_buffer == "host_staged" else options.device_kind
    threads, why = ucx_threads(options.ucx_threads, role, nixl_memory,
                               len(os.sched_getaffinity(0)), shm_free())
    device_id = cache.regions[0].device_id if nixl_memory != "cpu" else None
    return Agent(options.name or unique_name(role), options.binding, device_kind=nixl_memory,
                 ucx_threads=threads, device_id=device_id), why
