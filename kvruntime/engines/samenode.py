"""The same-node engine: the decode side opens the prefill's KV memory once and moves each
request with one gather, instead of one NIXL descriptor per run of blocks.

NIXL costs ~8-12 µs per descriptor whatever its size (DESIGN §4), so a request of scattered
blocks is descriptor-bound there; a gather over the block list is bound by memory bandwidth.
It needs the two processes on one host, and the decode allowed to read the prefill's memory.
That is *proved*, never assumed, over the authenticated side channel: the prefill keeps a fresh
random token in its memory and sends its pid, the token's address and the token; the decode
reads the token back out of the prefill's address space with ``process_vm_readv``. Only the
same kernel, the same process and a user allowed to read that process's memory can do so (the
kernel checks exactly what ``ptrace`` would). And the pid must hold the socket at the other end
of the side channel (peercred.py): a prefill cannot name another process and have us read its
memory. A peer on another host, in another pid namespace, of another user, or naming a pid
that is not its own fails the proof and NIXL stays the path.

Then, by memory kind:

* host memory (DRAM): ``process_vm_readv`` straight from the prefill's regions into ours, every
  block of the request in as few system calls as ``IOV_MAX`` allows, on a worker thread;
* CUDA memory (VRAM): the prefill exports CUDA IPC handles of its region tensors (torch's own
  IPC reduction); the decode opens each once and moves a request with one gather kernel per
  region on its own stream (gather.py), completion seen through a CUDA event.

Opened memory lives as long as the peer: closing or replacing the peer drops it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from ..errors import KVRuntimeError
from ..host import cudart
from ..host.peercred import owner_uid, prove_peer
from ..host.procmem import read_remote
from ..jobs import CopyJob, TransferResult
from ..layout import KVLayout
from ..plan import TransferPlan
from ..wire import frames

log = logging.getLogger(__name__)

TOKEN_BYTES = 32
# host copies over several threads are cut into pieces of at most this many bytes, dealt out
# in order: one 1 GiB run becomes 64 pieces, so every stream gets about the same bytes
STREAM_PIECE = 16 << 20
ENGINES = ("auto", "nixl", "samenode")


class SameNodeUnavailable(KVRuntimeError):
    """The same-node engine cannot serve this peer (the reason says why)."""


# Host memory between two processes of one host moves by process_vm_readv, one stream ~5.6 GB/s
# on the H100 host (16 cores; its memcpy 10.4 GB/s). The same-node engine splits a request's
# bytes over this many reader threads on hosts with the cores for it (1 GiB: 5.3 -> 19 GB/s
# there). NIXL's own UCX thread pool does the same for a decode's NIXL READs of host memory
# (agent.ucx_threads), where /dev/shm has room for its workers.
HOST_COPY_STREAMS, HOST_COPY_MIN_CPUS = 4, 8
# A connect runs a request's path this many times (PrefillPeer.rehearse), each moving this
# many blocks in as many runs (more than gather.RUN_COPY_MAX: the kernel's path) into scratch
REHEARSALS, REHEARSAL_BLOCKS = 3, 12


def host_copy_streams(cpus: int, requested: int | None) -> tuple[int, str]:
    """Reader threads for the same-node engine's host copies, and why — pure. ``requested``
    (None: choose) wins; ``HOST_COPY_STREAMS`` on hosts of ``HOST_COPY_MIN_CPUS`` cores or
    more, else 1 (the cores go to the copies and the peer process)."""
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise KVRuntimeError(f"host_streams must be a positive integer or None (choose), "
                                 f"got {requested!r}")
        return requested, "yours"
    if cpus < HOST_COPY_MIN_CPUS:
        return 1, f"{cpus} cores (< {HOST_COPY_MIN_CPUS}): one copy stream"
    return HOST_COPY_STREAMS, f"{cpus} cores: a request's bytes over {HOST_COPY_STREAMS} streams"


def split_ranges(local, remote, lengths, parts: int, piece: int) -> list:
    """The copies ``(local[i], remote[i], lengths[i])`` (uint64 arrays) as at most ``parts``
    groups of about equal bytes, for one thread each: ranges longer than ``piece`` are cut into
    pieces first, and consecutive pieces go to one group."""
    lengths = np.asarray(lengths, dtype=np.uint64)
    if parts <= 1 or not len(lengths):
        return [(local, remote, lengths)]
    counts = (lengths + np.uint64(piece - 1)) // np.uint64(piece)  # pieces of each range
    which = np.repeat(np.arange(len(lengths)), counts.astype(np.int64))
    first = np.cumsum(counts) - counts  # index of each range's first piece
    off = (np.arange(len(which), dtype=np.uint64) - first[which]) * np.uint64(piece)
    sizes = np.minimum(lengths[which] - off, np.uint64(piece))
    loc = np.asarray(local, dtype=np.uint64)[which] + off
    rem = np.asarray(remote, dtype=np.uint64)[which] + off
    before = np.cumsum(sizes) - sizes  # bytes ahead of each piece
    group = (before * np.uint64(parts)) // np.uint64(int(sizes.sum()))
    cuts = np.searchsorted(group, np.arange(1, parts), side="left")
    return [(a, b, c) for a, b, c in zip(np.split(loc, cuts), np.split(rem, cuts),
                                         np.split(sizes, cuts)) if len(c)]


# -- the proof ----------------------------------------------------------------------------------
def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class NodeToken:
    """Prefill side: a random token in our memory that a same-node peer can read back."""

    def __init__(self):
        self._token = os.urandom(TOKEN_BYTES)
        self._buf = ctypes.create_string_buffer(self._token, TOKEN_BYTES)

    def offer(self) -> dict:
        return {"pid": os.getpid(), "address": ctypes.addressof(self._buf),
                "token": frames.b64(self._token), "boot_id": _boot_id()}


def prove_same_node(offer: dict) -> tuple[int, None] | tuple[None, str]:
    """(pid, None) when the peer's token reads back from its memory, else (None, why)."""
    pid, address = offer.get("pid"), offer.get("address")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (pid, address)):
        return None, "the peer's offer has no valid pid and token address"
    try:
        token = frames.unb64(offer.get("token"), "token")
    except KVRuntimeError as exc:
        return None, str(exc)
    if len(token) != TOKEN_BYTES:
        return None, "the peer's token has the wrong size"
    if offer.get("boot_id") != _boot_id():
        return None, "the peer runs on another host (boot id differs)"
    buf = ctypes.create_string_buffer(TOKEN_BYTES)
    try:
        read_remote(pid, [ctypes.addressof(buf)], [address], [TOKEN_BYTES])
    except OSError as exc:
        return None, (f"cannot read the peer's memory ({exc}): another pid namespace, another "
                      f"user, or ptrace restrictions")
    if buf.raw != token:
        return None, "the token read back differs: that pid is another process here"
    return pid, None


# -- jobs: what a TransferHandle polls -----------------------------------------------------------
class _HostJob(CopyJob):
    engine = "samenode:process_vm_readv"

    def __init__(self, op, plan, futures: list[Future]):
        super().__init__(op, plan)
        self._futures = futures
        self._left = len(futures)
        self._count_lock = threading.Lock()
        self._ended = threading.Event()
        for f in futures:
            f.add_done_callback(self._one_done)

    def _one_done(self, _future) -> None:
        with self._count_lock:
            self._left -= 1
            if not self._left:
                self._ended.set()

    def block(self, seconds: float) -> None:
        """Sleep until the copy ends, at most ``seconds``: a waiter spinning on ``poll`` would
        hold the GIL that our worker thread needs to finish the copy."""
        self._ended.wait(seconds)

    def abort(self) -> bool:
        """A local read cannot be stopped, but it always ends (a memory copy): wait for it, so
        that nothing writes into the destination once this returns."""
        self._ended.wait()
        return True

    def poll(self) -> str:
        if self.state == "PROC" and self._ended.is_set():
            self.end = time.perf_counter()
            exc = next((f.exception() for f in self._futures if f.exception()), None)
            self.state, self.error = ("ERR", str(exc)) if exc else ("DONE", None)
        return self.state


class _CudaJob(CopyJob):
    engine = "samenode:cuda-ipc"

    def __init__(self, op, plan, event, spare: list):
        super().__init__(op, plan)
        self._event = event
        self._spare = spare  # the engine's events to re-record: the copy's goes back when done

    def poll(self) -> str:
        event = self._event
        if self.state == "PROC" and event is not None and event.query():
            self.end = time.perf_counter()
            self.state = "DONE"
            self._event = None
            self._spare.append(event)
        return self.state

    def block(self, seconds: float) -> None:
        """Until the copy's event has passed, or ``seconds``: polled without a nap (the GPU
        does the work, no thread of ours needs the core; each query lets go of the GIL, and
        ``sched_yield`` the core to a thread that wants it). Any sleep ends a timer slack late
        (naps.py): ``time.sleep(0)`` took 54 µs on the H100 VM, and a nap's wake-up ~0.2 ms on
        the 2 x H200 host was most of a 1 GiB request's overhead. (Should another thread's
        poll hand the event back meanwhile and a new request record it, this waits for that
        one, at most ``seconds``: ``poll`` says what is done.)"""
        event = self._event
        if event is None:
            return
        until = time.perf_counter() + seconds
        while not event.query() and time.perf_counter() < until:
            os.sched_yield()


class Batch:
    """The requests one gather moves (``start_pulls`` on a same-node engine). The first of
    their handles to see the gather end finishes all of them and tells the prefill about all
    of them, in one frame: finishing each handle by its own poll took 8.6 µs a handle on the
    H100 VM (32 of them, a third of their one-GPU copy), and a frame per request was ~12 % of a
    small request's host time there."""

    def __init__(self, job: CopyJob):
        self.job = job
        self.handles: list = []  # filled by the peer as it makes them
        self._lock = threading.Lock()

    def ended(self, peer) -> None:
        """The gather has ended well: each handle not yet finished is (one whose own poll is
        at it right now finishes itself), and every request is released, once."""
        with self._lock:
            handles, self.handles = self.handles, []
        for handle in handles:
            handle.done_elsewhere()
        if handles:
            peer.release_later([h.request_id for h in handles])


class SharedJob:
    """One request's view of a gather that moves a whole batch (a ``jobs.Job``): polled and
    aborted through the batch's job; its result counts its own bytes."""

    waiting: str | None = None

    def __init__(self, batch: Batch, plan: TransferPlan):
        job = batch.job
        self.job = job
        self.plan = plan
        self.batch = batch
        self.engine = job.engine
        self.start = job.start  # each request's own clock (TransferHandle.attach)
        self.block = getattr(job, "block", None)

    @property
    def error(self):
        return self.job.error

    def poll(self) -> str:
        return self.job.poll()

    def finish(self) -> None:
        self.job.finish()

    def release(self, peer, _request_id: str) -> None:
        self.batch.ended(peer)

    def give_back(self, peer, request_id: str) -> None:
        """The batch's gather failed: each request gives its own blocks back."""
        peer.release_later([request_id])

    def abort(self) -> bool:
        return self.job.abort()

    def drop(self) -> None:
        self.job.drop()

    def result(self):
        seconds = (self.job.end or time.perf_counter()) - self.start
        return TransferResult(self.job.op, self.plan.nbytes, seconds, self.plan.num_runs,
                              self.plan.descriptor_count, None, engine=self.engine)


# -- engines -------------------------------------------------------------------------------------
class HostEngine:
    """Reads the prefill's host regions with process_vm_readv (zero-copy, one call per
    ``IOV_MAX`` runs) on worker threads, so a request is started without waiting. With
    ``streams`` > 1 a request's bytes are split over that many threads (one process_vm_readv
    stream moves ~5.6 GB/s on the H100 host, against 10.4 for its memcpy); the count comes from
    host_copy_streams."""

    proved = ""  # what the proof established (open_engine)

    name = "samenode:process_vm_readv"

    def __init__(self, pid: int, remote_regions, local_cache, *, remote_layout: KVLayout,
                 streams: int = 1):
        self.pid = pid
        self.remote = np.array([r[0] for r in remote_regions], dtype=np.uint64)
        self.local = np.array([r.address for r in local_cache.regions], dtype=np.uint64)
        self.layout = remote_layout
        self.streams = max(1, streams)
        self._pool = ThreadPoolExecutor(max_workers=self.streams + 1,
                                        thread_name_prefix="kvr-samenode")

    moves_head_slices = False  # whole blocks only (mixed TP goes through NIXL)

    def start(self, op: str, plan: TransferPlan, heads=None) -> _HostJob:
        if heads is not None:
            raise SameNodeUnavailable("the host-memory engine copies whole blocks only")
        # one piece per (run, region): whole runs, addresses from the run arrays
        chunk = np.uint64(self.layout.chunk_bytes)
        src = plan.run_src.astype(np.uint64) * chunk
        dst = plan.run_dst.astype(np.uint64) * chunk
        local = (self.local[:, None] + dst).reshape(-1)  # region-major: order does not matter
        remote = (self.remote[:, None] + src).reshape(-1)
        lengths = np.tile(plan.run_count.astype(np.uint64) * chunk, len(self.local))
        return self.read(op, plan, local, remote, lengths)

    def scratch_request(self):
        """None: no rehearsal (PrefillPeer.rehearse) for host copies. Their first request
        costs what later ones do, the copy dominating (cpu-2, 16 MiB of random blocks: 0.99-1.14x
        the median with or without one), and rehearsing took 6-11 ms of every connect there."""
        return None

    def read(self, op: str, plan: TransferPlan, local, remote, lengths) -> _HostJob:
        """Start copying the peer's ``remote[i]`` into our ``local[i]``, ``lengths[i]`` bytes
        each (uint64 arrays), over the engine's reader threads."""
        return _HostJob(op, plan, [self._pool.submit(read_remote, self.pid, *part) for part in
                                   split_ranges(local, remote, lengths, self.streams,
                                                STREAM_PIECE)])

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class CudaEngine:
    """The prefill's CUDA regions opened once by IPC handle; one gather per request."""

    proved = ""  # what the proof established (open_engine)

    name = "samenode:cuda-ipc"

    def __init__(self, exported: list, local_cache, remote_layout: KVLayout):
        import torch

        from .gather import BlockGather, HeadGather, work_device
        from .gather import triton as triton_available

        self.layout = remote_layout
        # each region opened on *our* index of its GPU: processes with other
        # CUDA_VISIBLE_DEVICES (one GPU each, as deployments run) number GPUs differently
        self.remote = [open_cuda_ipc({**e, "device": i})
                       for e, i in zip(exported, local_indices(exported, visible_gpus()))]
        local = local_cache.tensors
        if not local or local[0].device.type != "cuda":
            raise SameNodeUnavailable("the decode cache is not in CUDA memory")
        self.device = local[0].device
        # the requests' work goes on a stream of the GPU that holds the peer's memory when a
        # kernel must read it there (gather.py); the caller's stream is still ours
        self.work_device = work_device({t.device for t in self.remote}, self.device)
        self.stream = torch.cuda.Stream(device=self.work_device)
        self.local = [t.reshape(-1).view(torch.uint8) for t in local]
        self.local_layout = local_cache.layout
        # whole blocks (same TP on both sides); a head slice (mixed TP: blocks of another size
        # here) moves by _copy_heads alone
        self.gather = (BlockGather(self.remote, self.local, remote_layout.chunk_bytes,
                                   remote_layout.num_blocks, local_cache.layout.num_blocks,
                                   self.stream)
                       if remote_layout.chunk_bytes == local_cache.layout.chunk_bytes else None)
        # a head slice (mixed TP) by one kernel a region, also across GPUs (gather.py); else
        # torch's index ops, on one GPU only
        self.heads = None
        if self.gather is None and triton_available is not None:
            try:
                self.heads = HeadGather(self.remote, self.local, remote_layout,
                                        local_cache.layout, self.stream)
            except Exception as exc:  # no peer access, a Triton that cannot compile here
                log.info("head slices by torch's index ops, on one GPU only: %s", exc)
        if self.gather is not None:
            self.gather.warm()  # the kernel's compile and load at connect, not in a request
        self._handle = self.stream.cuda_stream
        with torch.cuda.device(self.device):
            self._caller = cudart.Event()  # re-recorded by each request, under the lock
        self._lock = threading.Lock()
        # completion events of finished copies, re-recorded by the next requests (making one
        # costs 5-7 µs of the H100 VM's host time; a request's whole host time is ~60)
        self._spare: list = []

    @property
    def moves_head_slices(self) -> bool:
        """Mixed TP (a head slice of each block) is copied here when the peer's memory is on
        our GPU: one strided gather per region, at the device's speed; on another GPU with
        the head kernel (HeadGather), which writes into ours over NVLink."""
        return self.heads is not None or all(r.device == self.device for r in self.remote)

    def warm_heads(self, heads) -> None:
        """At connect, for a peer whose head slice this engine moves: the kernel compiled
        (or loaded from Triton's cache) and launched once into scratch."""
        if self.heads is not None:
            with cudart.StreamScope(self.stream, self.device.index):
                try:
                    self.heads.warm(heads)
                except Exception as exc:  # the first request compiles it then
                    log.info("warming the head-slice kernel failed: %s", exc)

    def scratch_request(self):
        """``(plan, start)``: ``start()`` begins a request of ``plan`` through this engine's
        own path (PrefillPeer.rehearse), the gather kernel writing into a scratch
        allocation on our GPU, through the engine's own id uploads and compiled kernels
        (nothing new allocated but the scratch, nothing compiled). None for a head-slice
        engine (its kernel's warm-up is warm_heads)."""
        if self.gather is None:
            return None
        import torch

        k = min(REHEARSAL_BLOCKS, self.layout.num_blocks)
        scratch = torch.empty(k * self.layout.chunk_bytes, dtype=torch.uint8,
                              device=self.device)
        gather = self.gather.into([scratch] * len(self.remote), k)
        plan = _scratch_plan(self.layout, k)
        return plan, lambda: self._start("READ", plan, None, gather)

    def start(self, op: str, plan: TransferPlan, heads=None) -> _CudaJob:
        return self._start(op, plan, heads, self.gather)

    def _start(self, op: str, plan: TransferPlan, heads, gather) -> _CudaJob:
        with self._lock:
            # our stream sees what the caller's stream did to the cache before this request
            # (the runtime's own calls: torch's cost 5-40 µs each on the H100 VM, and a small
            # request's whole GPU time is ~25 µs)
            # the stream's device current too (Triton launches there); the caller's on ours
            with cudart.StreamScope(self.stream, self.device.index) as scope:
                scope.after_caller(self._caller, self._handle)
                if heads is None:
                    gather.copy(plan)
                else:
                    self._copy_heads(plan, heads)
                event = (self._spare.pop() if self._spare else cudart.Event()).record(self._handle)
        return _CudaJob(op, plan, event, self._spare)

    def _copy_heads(self, plan: TransferPlan, heads) -> None:
        """Heads ``heads.src`` of the peer's blocks -> heads ``heads.dst`` of ours: each region
        seen as [block][token row][head][bytes of a head], one index_select and one index_put
        per region (both caches have one block kind: the handshake checked it)."""
        import torch

        if self.heads is not None:
            self.heads.copy(*plan.block_ids(), heads)
            return
        src_ids, dst_ids = (torch.as_tensor(ids, device=self.device) for ids in plan.block_ids())
        theirs, ours = self.layout, self.local_layout
        de = theirs.head_dim * theirs.element_bytes
        rows = theirs.chunk_bytes // (theirs.num_kv_heads * de)
        (s0, s1), (d0, d1) = heads.src, heads.dst
        for src, dst in zip(self.remote, self.local):
            s = src[:theirs.region_bytes].view(theirs.num_blocks, rows, theirs.num_kv_heads, de)
            d = dst[:ours.region_bytes].view(ours.num_blocks, rows, ours.num_kv_heads, de)
            d[dst_ids, :, d0:d1] = s.index_select(0, src_ids)[:, :, s0:s1]

    def close(self) -> None:
        import torch

        if self.remote:  # no copy may read memory we let go of
            for device in {self.device, self.work_device}:
                torch.cuda.synchronize(device)
        self.remote = []
        self.gather = None


def _scratch_plan(layout: KVLayout, k: int) -> TransferPlan:
    """A plan of ``k`` runs of one block each, from blocks spread over the peer's cache into
    blocks 0..k-1 of a scratch of ``k`` blocks (our own planner's code: it is rehearsed too)."""
    from dataclasses import replace

    from ..plan import Planner

    src = np.linspace(0, layout.num_blocks - 1, k).astype(np.int64)
    if k > 1 and np.any(np.diff(src) < 2):  # a cache of few blocks: runs merge, still a plan
        src = np.arange(k)
    return Planner(layout, replace(layout, num_blocks=k)).plan(src, np.arange(k))


def visible_gpus() -> dict:
    """This process's CUDA devices: {UUID: index}."""
    import torch

    return {str(torch.cuda.get_device_properties(i).uuid): i
            for i in range(torch.cuda.device_count())}


def local_indices(exported: list, visible: dict) -> list:
    """Our device index of the GPU each exported region lives on, found by its UUID (a
    device index means another GPU in a process with other CUDA_VISIBLE_DEVICES); refused
    when the peer names none, or a GPU this process cannot see."""
    out = []
    for e in exported:
        uuid = e.get("device_uuid") if isinstance(e, dict) else None
        if not isinstance(uuid, str):
            raise SameNodeUnavailable("the peer did not say which GPU its memory is on")
        if uuid not in visible:
            raise SameNodeUnavailable(f"the peer's memory is on GPU {uuid}, which this process "
                                      f"does not see (CUDA_VISIBLE_DEVICES): NIXL moves it")
        out.append(visible[uuid])
    return out


def export_cuda_ipc(tensor) -> dict:
    """What a peer needs to open ``tensor``'s memory (torch's CUDA IPC reduction), as JSON;
    its GPU named by UUID too (indices are per process)."""
    import torch

    storage = tensor.untyped_storage()
    (device, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle,
     event_sync) = storage._share_cuda_()
    return {"device": int(device),
            "device_uuid": str(torch.cuda.get_device_properties(int(device)).uuid),
            "handle": frames.b64(bytes(handle)),
            "storage_bytes": int(size_bytes), "storage_offset": int(offset_bytes),
            "ref_handle": frames.b64(bytes(ref_handle)), "ref_offset": int(ref_offset),
            "event_handle": frames.b64(bytes(event_handle)) if event_handle else None,
            "event_sync": bool(event_sync), "tensor_offset": int(tensor.storage_offset()),
            "nbytes": int(tensor.numel() * tensor.element_size())}


def open_cuda_ipc(e: dict):
    """Open an exported region as a flat uint8 tensor on device ``e["device"]`` (our index of
    the exporter's GPU: local_indices)."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        event_handle = frames.unb64(e["event_handle"], "event") if e.get("event_handle") else None
        t = rebuild_cuda_tensor(
            torch.Tensor, (int(e["nbytes"]),), (1,), int(e["tensor_offset"]),
            torch.UntypedStorage, torch.uint8, int(e["device"]),
            frames.unb64(e["handle"], "handle"), int(e["storage_bytes"]),
            int(e["storage_offset"]), False, frames.unb64(e["ref_handle"], "ref handle"),
            int(e["ref_offset"]), event_handle, bool(e["event_sync"]))
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise SameNodeUnavailable(f"could not open the peer's CUDA memory: {exc}") from exc
    return t


def serve_offer(cache, token: NodeToken) -> dict:
    """Prefill side: the token, and for CUDA memory the IPC export of every region."""
    offer = {**token.offer(), "mem_type": cache.mem_type}  # the fields of its "samenode" reply
    tensors = cache.tensors
    if cache.mem_type == "VRAM":
        if not tensors or tensors[0].device.type != "cuda":
            offer["unavailable"] = "device memory other than CUDA has no IPC export here"
        else:
            try:
                offer["cuda_ipc"] = [export_cuda_ipc(t) for t in tensors]
            except Exception as exc:  # report to the peer, which falls back to NIXL
                offer["unavailable"] = f"CUDA IPC export failed: {exc}"
    return offer


def what_was_proved(pid: int) -> str:
    """The proof's facts, for ``engine_reason``: same host, the pid bound to the connection,
    its memory readable by us, and whose that memory is."""
    uid, ours = owner_uid(pid), os.geteuid()
    if uid == ours:
        who = "same user"
    else:
        who = (f"another user's process (uid {uid}), readable by us as "
               f"{'root' if ours == 0 else f'uid {ours} with the right to trace it'}")
    return (f"same host (boot id), pid {pid} holds the side channel's other end, its token "
            f"read back from its memory; {who}")


def open_engine(offer: dict, sock, local_cache, remote_layout: KVLayout, remote_regions,
                host_streams: int = 1):
    """Decode side: prove the peer is on this node and is the process at the other end of
    ``sock`` (peercred.py), then open its memory (host memory read by ``host_streams``
    threads). Raises SameNodeUnavailable with the reason when it cannot serve."""
    if offer.get("unavailable"):
        raise SameNodeUnavailable(str(offer["unavailable"]))
    pid, why = prove_same_node(offer)
    if why is None:
        why = prove_peer(sock, pid)
    if why is not None:
        raise SameNodeUnavailable(why)
    mem = offer.get("mem_type")
    if mem != local_cache.mem_type:
        raise SameNodeUnavailable(f"peer memory is {mem}, ours {local_cache.mem_type}")
    if mem == "DRAM":
        engine = HostEngine(pid, remote_regions, local_cache, remote_layout=remote_layout,
                            streams=host_streams)
    else:
        exported = offer.get("cuda_ipc")
        if not isinstance(exported, list) or len(exported) != remote_layout.num_regions:
            raise SameNodeUnavailable("the peer exported no CUDA IPC handle per region")
        engine = CudaEngine(exported, local_cache, remote_layout)
    engine.proved = what_was_proved(pid)
    return engine
