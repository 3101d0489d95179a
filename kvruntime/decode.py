"""The decode side: connects to prefill servers, pulls blocks or asks for them to be pushed.

``DecodeClient.connect`` measures the handshake (connect, compat check, add agent, prepare the
peer's descriptor list). Connecting again to an address, or meeting an agent name already
loaded, removes the stale agent first: that is how a restarted prefill is picked up.

Requests are asynchronous: ``peer.start_pull``/``start_push`` return a ``TransferHandle`` at
once (see inflight.py); ``client.get_finished()`` collects every request that finished since
the last call, across peers. ``peer.pull``/``push`` are ``start_*(...).wait()``. A push can
also be the prefill's to start: ``peer.expect_push`` names where a request's blocks go, and its
handle is done when the prefill's WRITE of them has landed.

Engines: with ``engine="auto"`` (the default) a peer proved to run on this host as a user
allowed to read its memory is served by the same-node engine (samenode.py: one gather per
request); any other peer, or ``engine="nixl"``, goes through NIXL. ``peer.engine`` and every
``TransferResult.engine`` say which moved the bytes; ``engine="samenode"`` fails the connect
with the reason when it cannot be used.

Threads: a peer may be used from several threads. Frames to the prefill go out under the peer's
send lock; whichever thread polls reads the replies and hands them to their handles by request
id. NIXL calls take the agent lock for one call at a time, never for a transfer's duration.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import replace
import logging
import os
import select
import threading
import time

import numpy as np

from . import frames
from .agent import Agent, unique_name
from .binding import NixlBinding
from .errors import KVRuntimeError, PeerError, TransferError, WaitTimeout
from .handshake import PeerInfo, client_handshake, connect
from .inflight import PENDING, Pace, TransferHandle
from .mailbox import MailboxReader
from .naps import await_readable
from .memory import KVCache
from .plan import Planner, TransferPlan, make_plan, spans_ids
from .registration import Registration, Scratch
from .releases import ReleaseSender
from .samenode import (ENGINES, Batch, SameNodeUnavailable, SharedJob, host_copy_streams,
                       open_engine)
from . import coalesce as coalescing
from .staging import PoolRoute, StagedPull, StagingExhausted, StagingPool, resolve_kv_buffer
from .transports import offered_transports
from .tp import head_rows, rows_per_chunk
from .transfer import Draining, PostedTransfer, Rows, TransferResult

log = logging.getLogger("kvruntime")
_request_ids = itertools.count()
RELEASE_FRAME_IDS = 1024  # request ids a release frame names at most (frames stay small)
MAX_FROM_RING = 65536  # readies taken from a prefill's ring whose frames have not come yet
# How long a prefill may leave a cancel unanswered before its peer is treated as unusable.
SETTLE_SECONDS = 5.0


class PrefillPeer:
    """One handshaked prefill server."""

    def __init__(self, client: "DecodeClient", address, sock, info: PeerInfo, agent: str,
                 handshake_seconds: float):
        self.client = client
        self.address = address
        self.sock = sock
        self.info = info
        self.session = info.session  # the frames' MACs and counts (frames.Session)
        self.agent = agent
        self.handshake_seconds = handshake_seconds
        self.closed = False
        self._broken: str | None = None  # why the peer may not be used any more
        self._losing = False  # _lose is failing our requests (their cleanup may send, fail, lose)
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        # the reader's look at the socket (1 µs; naps.readable's ppoll costs ~5 through ctypes):
        # a poll object serves one thread at a time, the one holding the receive lock
        self._poller = None
        self._pending: dict[str, TransferHandle] = {}  # request id -> handle awaiting frames
        self._unsettled: dict[str, float] = {}  # cancelled push -> when the cancel went out
        self._replies: dict[str, dict | None] = {}  # control call id -> reply (None: waiting)
        # requests done here whose blocks the prefill may free, sent by _flush_releases
        self._releases: list[str] = []
        self._releases_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._engine = None  # a same-node engine (samenode.py) when one serves this peer
        # the prefill's ring of readies, read from its memory as we poll (mailbox.py), and the
        # requests whose ready came that way (their frame, which follows, is dropped)
        self._ring: MailboxReader | None = None
        self._from_ring: OrderedDict[str, None] = OrderedDict()
        # host-staged and on this host: the engine that copies its pool's runs into ours
        self._pool_engine = None
        self._planner: Planner | None = None  # made at the first request (plan.py)
        self.pace = Pace()  # how fast it has moved requests: how long a wait spins (inflight.py)
        self.head_slice = None  # mixed TP: which of its heads go to which of ours (tp.py)
        self.lanes = None  # UCX's protocols of our agent after the connect-time probe (ucxlog)
        self.engine_reason = "not asked"  # why the engine in use was chosen
        # through the pools (staging.py): a host-staged peer's, or a direct NIXL peer's
        # coalesced requests (coalesce.py), and the model auto chooses by
        self.route: PoolRoute | None = None
        self.coalesce_model: coalescing.Model | None = None
        self.coalesce_reason = "not a NIXL peer"  # why requests may (not) go coalesced

    @property
    def engine(self) -> str:
        """What moves this peer's requests: "nixl", "host_staged", or the same-node engine."""
        if self.client.staging is not None:
            return "host_staged"
        return self._engine.name if self._engine is not None else "nixl"

    @property
    def staged_copy(self) -> str | None:
        """Host-staged: what moves a staged run from the prefill's pool into ours (NIXL, or
        the same-node engine's reads); None for a direct peer."""
        if self.client.staging is None:
            return None
        return self._pool_engine.name if self._pool_engine is not None else "nixl"

    def _open_samenode(self, required: bool) -> None:
        """Ask the prefill for its same-node offer and open its memory — for a host-staged
        peer, its staging pool; NIXL stays the path (and the reason is kept) when that cannot
        be proved or opened."""
        staged = self.client.staging is not None
        try:
            offer = self._call({"type": "samenode"}, "samenode", self.client.timeout)
            engine = open_engine(offer, self.sock, self.client.staging.cache if staged else
                                 self.client.cache, self.info.layout, self.info.regions,
                                 self.client.host_streams)
            proved = f"proved: {engine.proved}"
            if staged:
                self._pool_engine = engine
                n = engine.streams
                self.engine_reason = (f"host-staged: pool to pool by process_vm_readv over {n} "
                                      f"thread{'s' if n > 1 else ''} ({proved})")
            else:
                self._engine = engine
                self.engine_reason = proved
                self._ring = MailboxReader.from_offer(offer.get("pid"), offer)
        except KVRuntimeError as exc:
            if required:
                raise SameNodeUnavailable(f"{self.name}: same-node engine unavailable: {exc}"
                                          ) from exc
            self.engine_reason = (f"{'host-staged: ' if staged else ''}NIXL: same-node engine "
                                  f"unavailable: {exc}")
            log.info("%s: %s", self.name, self.engine_reason)

    def _check_engine_heads(self, info: PeerInfo, required: bool) -> None:
        """Mixed TP: keep the same-node engine only if it copies head slices (CUDA IPC on one
        GPU); otherwise NIXL, one descriptor per token row of each block's head slice."""
        engine = self._engine
        if engine is not None and engine.moves_head_slices:
            self.engine_reason += "; mixed TP: one strided copy per region of the head slice"
            return
        why = (f"prefill TP {info.cache_layout.tp_size} / decode TP "
               f"{self.client.cache.layout.tp_size} moves head slices, which the same-node "
               f"engine here does not copy" + (f" ({engine.name})" if engine else ""))
        if engine is not None:
            engine.close()
            self._engine = None
        if required:
            raise SameNodeUnavailable(f"{self.name}: same-node engine unavailable: {why} (use "
                                      f"engine='nixl' or kv_buffer='host_staged')")
        self.engine_reason = f"NIXL: {why}; one descriptor per token row of each head slice"

    @property
    def name(self) -> str:
        return f"prefill {self.address[0]}:{self.address[1]}"

    def _new_request(self) -> str:
        return f"{os.getpid()}-{next(_request_ids)}"

    # -- starting requests -------------------------------------------------------------------
    def start_pull(self, src_blocks, dst_blocks=None, request_id: str | None = None,
                   timeout: float = 30.0, split: int | None = None) -> TransferHandle:
        """Post a READ of the peer's ``src_blocks`` into our ``dst_blocks``; once it is done, a
        release frame tells the prefill side it may free the request's blocks. ``split``:
        NIXL descriptors per run of blocks (None: ``read_split`` chooses)."""
        t0 = time.perf_counter()
        plan, request_id = self._admit(src_blocks, dst_blocks, request_id, timeout)
        handle = self._handle("pull", request_id, plan, timeout, t0)
        if self._engine is not None:
            return self._start_local(handle)
        if self.client.staging is not None or self._coalesced(handle):
            return self._start_staged(handle)
        return self._post_read(handle, split)

    def _coalesced(self, handle: TransferHandle) -> bool:
        """Whether a direct NIXL request goes through the pools (coalesce.py); the choice and
        its reason go into its result."""
        mode = self.client.coalesce
        if self.route is None or mode == "never":
            handle.coalesce = (False, self.coalesce_reason)
            return False
        plan = handle.plan
        heads = self.head_slice.count if self.head_slice else self.client.cache.layout.num_kv_heads
        units = plan.num_blocks * heads
        fits = min(self.route.pool.units, self.route.remote_units)
        if units > fits:
            if mode == "always":  # it could never fit: refused now, not at its deadline
                raise StagingExhausted(
                    f"request {handle.request_id} can never fit the staging pools: {units} "
                    f"units, the decode's pool {self.route.pool.units}, the prefill's "
                    f"{self.route.remote_units}; size the pools (staging_blocks) for the "
                    f"largest request, or coalesce='auto'")
            handle.coalesce = (False, f"{units} units do not fit the pools ({fits} units)")
            return False
        if mode == "always":
            handle.coalesce = (True, "coalesce='always'")
            return True
        if self.coalesce_model is None:
            handle.coalesce = (False, self.coalesce_reason)
            return False
        lay = self.client.cache.layout  # mixed TP, direct: a descriptor a token row
        descriptors = (plan.num_blocks * lay.num_regions * rows_per_chunk(lay)
                       if self.head_slice is not None else plan.descriptor_count)
        handle.coalesce = self.coalesce_model.choose(descriptors, handle.nbytes)
        return handle.coalesce[0]

    def _start_staged(self, handle: TransferHandle) -> TransferHandle:
        """Host-staged (staging.py): the prefill gathers into its pool, we READ the run into
        ours and scatter. A push takes the same road (the outcome is the push's)."""
        if handle.request_id in self._pending:
            raise KVRuntimeError(f"request id {handle.request_id!r} is already in flight on "
                                 f"{self.name}")
        job = StagedPull(self, handle.plan, handle.request_id, time.time() + handle.timeout,
                         self.route)
        pool = self.route.pool
        if job.units > pool.units:  # it could never fit: refused now, not at its deadline
            raise StagingExhausted(f"request {handle.request_id} can never fit the decode's "
                                   f"staging pool: {pool.numbers(job.units)}; size the pool "
                                   f"(staging_blocks) for the largest request")
        handle._attach(job)
        handle.uses_peer = True  # the prefill's "staged" answer comes over the side channel
        self._pending[handle.request_id] = handle
        self.client._track(handle)
        handle._xfer.send()
        return handle

    def read_split(self, plan: TransferPlan) -> int:
        """Pieces per run for a READ of ``plan`` when the caller names none: NIXL spreads a
        request's descriptors over its UCX threads but cannot split one, so host memory with
        several copy streams gets at least one descriptor per stream; anything else 1."""
        threads = self.client.agent.ucx_threads
        if threads < 2 or self.client.cache.mem_type != "DRAM" or self.head_slice is not None:
            return 1
        return -(-threads // plan.descriptor_count)

    def _post_read(self, handle: TransferHandle, split: int | None) -> TransferHandle:
        reg = self.client.registration
        if split is None:
            split = self.read_split(handle.plan)
        rows = None
        if self.head_slice is not None:  # mixed TP, direct: our heads of each token row
            s, src, dst = self.head_slice, *handle.plan.block_ids()
            rows = Rows(head_rows(self.client.cache.layout, reg.region_triples(), dst, s.dst),
                        head_rows(self.info.layout, self.info.regions, src, s.src), self.agent,
                        self.client.cache.mem_type, self.info.mem_type)
            handle.nbytes = rows.nbytes
        # No NIXL notification on the READ: one keeps the READ (and the next one on this
        # connection) from completing until the prefill's UCX worker progresses, which its
        # idle loop does every millisecond (H100 VM: a 16 MiB READ 1043 µs with one, 80
        # without). The release goes over the side channel once the READ is done.
        handle._attach(PostedTransfer(self.client.agent, "READ", handle.plan, reg.local_dlist,
                                      reg.peer_dlist(self.agent), True, b"", split, rows))
        self.client._track(handle)
        return handle

    def start_push(self, src_blocks, dst_blocks=None, request_id: str | None = None,
                   timeout: float = 30.0, split: int = 1) -> TransferHandle:
        """Ask the prefill side to WRITE its ``src_blocks`` into our ``dst_blocks``. Done when
        the prefill's reply is in: it sends it once NIXL has flushed the WRITE (NIXL flushes
        every connection of a transfer before calling it done), i.e. the data has landed."""
        t0 = time.perf_counter()
        plan, request_id = self._admit(src_blocks, dst_blocks, request_id, timeout)
        if request_id in self._pending:
            raise KVRuntimeError(f"request id {request_id!r} is already in flight on {self.name}")
        handle = self._handle("push", request_id, plan, timeout, t0)
        if self.client.staging is not None:
            return self._start_staged(handle)
        if self._engine is None and self._coalesced(handle):  # the pull's road, the push's outcome
            return self._start_staged(handle)
        if self._engine is not None:
            # Same node: we copy out of the prefill's memory ourselves; the outcome (blocks
            # here, the prefill told it may free them) is the push's, at the pull's speed.
            return self._start_local(handle)
        src, dst = plan.block_ids()
        self._pending[request_id] = handle
        self.client._track(handle)
        # The deadline travels as wall-clock time: the prefill refuses a push it reads after
        # it (a stalled prefill must not write into blocks the caller was told are free).
        if 3 * plan.num_runs < 2 * len(src):  # its runs are shorter than its ids: they go
            blocks = {"runs": frames.pack_runs(plan.run_src, plan.run_dst, plan.run_count)}
        else:
            blocks = {"src": frames.pack_ids(src), "dst": frames.pack_ids(dst)}
        self._send({"type": "push", "request": request_id, **blocks,
                    "timeout": timeout, "deadline": time.time() + timeout, "split": split})
        return handle

    def expect_push(self, dst_blocks, request_id: str | None = None,
                    timeout: float = 30.0) -> TransferHandle:
        """Tell the prefill where request ``request_id``'s blocks go here, ahead of time; the
        prefill pushes them when it has them (``PrefillServer.start_push``):

        - over NIXL it WRITEs them, and the handle is done when the WRITE's NIXL notification
          arrives: NIXL sends it once the data has landed. Nothing crosses the side channel
          between the prefill's start and the data's arrival, so a push costs what its WRITE
          costs. The handle's seconds run from the prefill's start to the notification's
          arrival, by the two hosts' wall clocks;
        - on the same-node engine it sends its block ids (a "ready" frame) and we copy them
          out of its memory, as a pull does: one gather, not a WRITE of a descriptor a run
          (on one GPU also not two processes' CUDA contexts taking turns). The handle is done
          when the copy is, timed from the prefill's start (one host, one clock).

        Our UCX worker must progress for the notification to arrive (and, on some
        transports, for the WRITE to finish): a caller's polls do that (``get_finished``,
        ``wait``), or a NIXL progress thread (``ucx_threads``). Past ``timeout`` the request
        fails and the prefill is told to drop it; a WRITE it has started is aborted."""
        t0 = time.perf_counter()
        self._check_request(timeout)
        if self.client.staging is not None:
            raise KVRuntimeError(f"{self.name}: a host-staged decode cannot be pushed into "
                                 f"(NIXL holds its staging pool, not its cache); pull instead")
        if self.info.kv_buffer == "host_staged":
            raise KVRuntimeError(f"{self.name} is host-staged: it pushes nothing directly; pull "
                                 f"instead")
        # our ids, checked here (range, duplicates): the prefill pairs them with its own
        plan = make_plan(self.client.cache.layout, dst_blocks)
        request_id = self._request_id(request_id)
        if request_id in self._pending:
            raise KVRuntimeError(f"request id {request_id!r} is already in flight on {self.name}")
        handle = self._handle("push", request_id, plan, timeout, t0)
        handle.by_prefill = True
        self._pending[request_id] = handle
        self.client._track(handle)
        message = {"type": "expect", "request": request_id,
                   "dst": frames.pack_ids(plan.block_ids()[0]),
                   "timeout": timeout, "deadline": time.time() + timeout}
        if self._engine is not None:  # same node: "send the ids when ready, we copy"
            message["copy"] = True
        self._send(message)
        return handle

    def _copy_pushed(self, handle: TransferHandle, message: dict) -> None:
        """The prefill has the blocks of a request we named with "copy" (a "ready" frame):
        copy them out of its memory into the named ones, as a pull would, and release them
        when done. A ready for a request that already failed (its deadline, its cancel) or
        that cannot be planned gives the blocks straight back (a release): nothing reads
        them."""
        request = handle.request_id
        copied = gave_up = False
        with handle._lock:
            try:
                if handle.state != PENDING:
                    gave_up = True  # failed here first: the answer to its cancel settles it
                    raise KVRuntimeError("it had already failed here")
                if self._engine is None:
                    raise KVRuntimeError("no same-node engine serves this peer here")
                plan = self._pushed_plan(handle.plan, message)
                posted = message.get("posted")
                if isinstance(posted, (int, float)) and not isinstance(posted, bool):
                    # its start on our clock: one host's wall clock, read on both sides
                    handle.started = time.perf_counter() - max(0.0, time.time() - posted)
                handle.plan = plan  # from here it is our copy's, as a pull's
                self._start_local(handle)
                copied = True
            except Exception as exc:  # bad ids, or a launch that failed: this request fails,
                # whoever polled (an engine's get_finished) goes on with the others
                self._release_later([request])
                if gave_up:
                    log.info("%s: ready for request %s given back: %s", self.name, request, exc)
                else:
                    handle._fail(TransferError(f"push of request {request}: the prefill's "
                                               f"ready could not be copied: {exc}"))
        if not copied:  # its blocks go back now (no poll of it may come again), outside its
            self._flush_releases()  # lock: a send that fails fails the peer's handles
        if not gave_up:
            self._settled(handle)  # the prefill has nothing more to say of it

    def _pushed_plan(self, named: TransferPlan, message: dict) -> TransferPlan:
        """The plan of a ready's source blocks (its ``src`` ids, or ``src_spans``) into the
        ones we ``named``, checked against both caches as a pull's. Spans are bounded before
        any id is made from them: as many blocks as we named, each span at least one. One
        span into one run of ours is planned from the three numbers alone."""
        planner = self._planner_now()
        if "src" in message:
            return planner.plan(frames.ids_field(message, "src"), named.block_ids()[0])
        starts, counts = frames.spans_field(message, "src_spans")
        n = named.num_blocks
        if len(counts) == 1 and counts[0] == n:  # one span, bounded by this one comparison
            if named.num_runs == 1:
                return planner.plan_runs(starts, named.run_dst, counts)
        elif not len(counts) or counts.min() < 1 or counts.max() > n or counts.sum() != n:
            raise KVRuntimeError(f"its spans name {int(counts.sum()) if len(counts) else 0} "
                                 f"blocks (each at least one), we named {n}")
        return planner.plan(spans_ids(starts, counts), named.block_ids()[0])

    def _on_notif(self, raw) -> str | None:
        """A NIXL notification from this peer's agent: a push of its own that has landed.
        Returns why it was ignored, if it was."""
        try:
            message = frames.parse_notif(raw, self.session)
        except KVRuntimeError as exc:
            return str(exc)
        request = message.get("request")
        handle = self._pending.get(request) if isinstance(request, str) else None
        if message.get("type") != "pushed" or handle is None or not handle.by_prefill:
            return (f"an unexpected {str(message.get('type'))[:40]!r} notification (request "
                    f"{str(request)[:80]!r})")
        handle._on_reply(message)
        return None

    def start_pulls(self, requests, timeout: float = 30.0) -> list[TransferHandle]:
        """Start many pulls at once — an engine step's worth — and get one handle each.

        ``requests``: ``(src_blocks, dst_blocks or None, request_id or None)`` tuples. Every
        request is checked as by ``start_pull``, and no destination block may appear in two of
        them. On the same-node engine the whole batch is one gather (one id upload, one launch
        per region): a request's host cost is then its planning alone. Over NIXL each request
        is posted as its own READ (released by the poll that sees it done).
        """
        requests = list(requests)
        t0 = time.perf_counter()
        if not requests:
            return []
        self._check_request(timeout)
        # the batch planned at once (plan.py): its checks are each request's and "no block
        # written twice", its host cost a few numpy calls, not a plan per request
        plans, merged = self._planner_now().plan_many([(src, dst) for src, dst, _ in requests])
        admitted = list(zip(plans, [self._request_id(rid) for _, _, rid in requests]))
        if len({rid for _plan, rid in admitted}) != len(admitted):
            raise KVRuntimeError("a request id appears twice in one batch")
        if self._engine is None:
            return [self._post_read(self._handle("pull", rid, plan, timeout, t0), 1)
                    for plan, rid in admitted]
        job = self._engine.start("READ", merged, self.head_slice)
        batch = Batch(job)
        handles = batch.handles
        for plan, rid in admitted:
            handle = self._handle("pull", rid, plan, timeout, t0)
            handle._attach(SharedJob(batch, plan))
            handles.append(handle)
        self.client._track_all(handles)
        return list(handles)

    def _handle(self, op, request_id, plan, timeout, t0) -> TransferHandle:
        handle = TransferHandle(self, op, request_id, plan, timeout, t0)
        if self.head_slice is not None:  # mixed TP: what lands is this peer's share of our heads
            handle.nbytes = (plan.nbytes * self.head_slice.count
                             // self.client.cache.layout.num_kv_heads)
        return handle

    def _start_local(self, handle: TransferHandle) -> TransferHandle:
        handle._attach(self._engine.start("READ", handle.plan, self.head_slice))
        handle.uses_peer = False  # a push too: we copy, and tell the prefill once it is done
        self.client._track(handle)
        return handle

    def _release_later(self, request_ids: list) -> None:
        """``request_ids`` are done here (a pull's READ, a same-node copy): the prefill may
        free their blocks. Sent when the host waits anyway (releases.py): requests seen done
        together go in one frame."""
        with self._releases_lock:
            self._releases.extend(request_ids)
        self.client._releaser.due(self)

    def _flush_releases(self) -> None:
        """Send the pending release ids; one flush at a time, so that a close's waits for the
        backstop's (nothing is sent after the "bye")."""
        with self._flush_lock:
            with self._releases_lock:
                ids, self._releases = self._releases, []
            if not ids or self.closed:  # closed: its close sent what was pending, then "bye"
                return
            for i in range(0, len(ids), RELEASE_FRAME_IDS):
                chunk = ids[i:i + RELEASE_FRAME_IDS]
                try:
                    self._send({"type": "release", "requests": chunk})
                except KVRuntimeError as exc:
                    log.warning("%s: telling the prefill to free requests %s: %s", self.name,
                                ", ".join(chunk), exc)

    def pull(self, src_blocks, dst_blocks=None, request_id: str | None = None,
             timeout: float = 30.0, split: int | None = None) -> TransferResult:
        return self.start_pull(src_blocks, dst_blocks, request_id, timeout, split).wait()

    def push(self, src_blocks, dst_blocks=None, request_id: str | None = None,
             timeout: float = 30.0, split: int = 1) -> TransferResult:
        return self.start_push(src_blocks, dst_blocks, request_id, timeout, split).wait()

    def _admit(self, src_blocks, dst_blocks, request_id, timeout):
        self._check_request(timeout)
        return self._planner_now().plan(src_blocks, dst_blocks), self._request_id(request_id)

    def _check_request(self, timeout) -> None:
        self._check_usable()
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
            raise KVRuntimeError(f"timeout must be a positive number of seconds, got {timeout!r}")

    def _planner_now(self) -> Planner:
        if self._planner is None:  # once per peer: the layouts stay what the connect found
            if self.client.staging is not None or self.head_slice is not None:
                # staged or mixed TP: the caches may differ in heads (and kind, staged); source
                # ids are the peer's
                src_layout = replace(self.client.cache.layout,
                                     num_blocks=self.info.cache_layout.num_blocks)
            else:
                src_layout = self.info.cache_layout
            self._planner = Planner(src_layout, self.client.cache.layout)
        return self._planner

    def _request_id(self, request_id) -> str:
        if request_id is None:
            return self._new_request()
        if not isinstance(request_id, str) or not request_id or len(request_id) > 256:
            raise KVRuntimeError("request_id must be a non-empty string of at most 256 chars")
        return request_id

    # -- control calls -------------------------------------------------------------------------
    def digests(self, blocks, timeout: float = 60.0) -> list[str]:
        blocks = [int(b) for b in blocks]
        reply = self._call({"type": "digests", "blocks": frames.pack_ids(blocks)}, "digests",
                           timeout)
        out = reply.get("digests")
        if not isinstance(out, list) or len(out) != len(blocks):
            raise PeerError("peer answered a digests request with the wrong number of digests")
        return out

    def _call(self, message: dict, reply_type: str, timeout: float) -> dict:
        self._check_usable()
        call_id = f"c{next(_request_ids)}"
        self._replies[call_id] = None
        try:
            self._send({**message, "request": call_id})
            deadline = time.monotonic() + timeout
            while self._replies.get(call_id) is None:
                self._pump()
                if self._broken:
                    raise TransferError(f"{self.name}: {self._broken}")
                if time.monotonic() > deadline:
                    raise WaitTimeout(f"{self.name}: no answer to {message['type']!r} within "
                                      f"{timeout}s")
                # woken by the answer's frame, not a timer: a 0.2 ms sleep ended ~0.26 ms late
                # on the 2-core host, the round trip auto's model charges every request
                self._await_frame(0.0002)
            reply = self._replies[call_id]
        finally:
            self._replies.pop(call_id, None)
        try:
            return frames.expect(reply, reply_type)
        except PeerError as exc:
            raise TransferError(f"{self.name}: {exc}") from exc

    # -- side-channel I/O ----------------------------------------------------------------------
    def _send(self, message: dict) -> None:
        with self._send_lock:
            if self.closed:
                raise PeerError(f"connection to {self.name} is closed; connect again")
            try:
                frames.write_frame(self.sock, message, self.client.timeout, self.session)
                return
            except KVRuntimeError as exc:
                error = exc
        # lost outside the send lock: the close sends "bye" under it, and fails handles,
        # whose locks a thread holding one may be waiting on ours under (a cancel)
        self._lose(f"side channel failed: {error}")
        raise TransferError(f"{self.name}: {error}") from error

    def _await_frame(self, seconds: float) -> None:
        """Until the prefill sends something, at most ``seconds`` (naps.await_readable: any
        fd number, a nanosecond timeout, any number of threads at once; polled, not slept,
        on a host of many cores)."""
        try:
            await_readable(self.sock.fileno(), seconds)
        except (OSError, ValueError):  # closed under us: the next pump says so
            pass

    def _pump(self) -> None:
        """Read whatever frames the prefill has sent and hand them out; make our UCX worker
        progress. Non-blocking; a thread already reading makes this a no-op."""
        self.client._progress_worker()
        if self.closed or not self._recv_lock.acquire(blocking=False):
            return
        try:
            if self._ring is not None and self._pending:  # pushes the prefill may have readied
                self._read_ring()
            if self._poller is None:  # poll, not select: any fd number (naps.py)
                self._poller = select.poll()
                self._poller.register(self.sock, select.POLLIN | select.POLLPRI)
            while not self.closed and self._poller.poll(0):
                try:
                    message = frames.read_frame(self.sock, self.client.timeout,
                                                  session=self.session)
                except KVRuntimeError as exc:
                    self._lose(f"side channel failed: {exc}")
                    return
                self._dispatch(message)
        except (OSError, ValueError) as exc:  # the socket was closed under us
            self._lose(f"side channel failed: {exc}")
        finally:
            self._recv_lock.release()

    def _read_ring(self) -> None:
        """Take the readies the prefill wrote into its ring since the last read (under the
        receive lock). A ring that cannot be read or trusted is given up: the frames carry
        every ready too."""
        try:
            messages = self._ring.read()
        except (KVRuntimeError, OSError) as exc:
            log.warning("%s: its ring of readies is given up (%s); they come by frame", self.name,
                        exc)
            self._ring = None
            return
        for message in messages:
            request = message.get("request")
            if message.get("type") != "ready" or not isinstance(request, str):
                log.warning("%s: its ring holds a %r record; given up, readies come by frame",
                            self.name, message.get("type"))
                self._ring = None
                return
            self._from_ring[request] = None
            while len(self._from_ring) > MAX_FROM_RING:
                self._from_ring.popitem(last=False)
            self._dispatch(message)

    def _dispatch(self, message: dict) -> None:
        kind, request = message.get("type"), message.get("request")
        if kind == "ready" and message.get("ring") is True:
            # its record was written first: taken from the ring already, or now
            if self._ring is not None and request not in self._from_ring:
                self._read_ring()
            if request in self._from_ring:
                del self._from_ring[request]
                return
        if kind == "error" and not isinstance(request, str):
            self._lose(f"prefill closed the connection: {message.get('message')}")
            return
        if request in self._replies:
            self._replies[request] = message
            return
        if kind in ("pushed", "push_failed", "cancelled", "staged", "stage_failed", "ready") \
                and isinstance(request, str):
            handle = self._pending.get(request)
            if handle is not None and kind != "ready":
                handle._on_reply(message)
                return
            if handle is not None and handle.by_prefill:  # a ready: the ids for us to copy
                self._copy_pushed(handle, message)
                return
        if kind == "cancelled":  # its WRITE ended and was answered before our cancel came
            log.info("%s answered a cancel of request %r after its end", self.name, request)
            return
        log.warning("%s sent an unexpected %r frame (request %r); ignored", self.name, kind,
                    request)

    def _cancel(self, handle: TransferHandle) -> None:
        self._unsettled[handle.request_id] = time.monotonic()
        try:
            self._send({"type": "cancel", "request": handle.request_id})
        except KVRuntimeError:
            pass  # the connection is gone: nothing of ours is left on the prefill

    def _settled(self, handle: TransferHandle) -> None:
        """``handle`` expects nothing more from the prefill (finished, or failed and settled)."""
        if self._pending.get(handle.request_id) is handle:
            del self._pending[handle.request_id]
        self._unsettled.pop(handle.request_id, None)

    def _lose(self, why: str) -> None:
        """The side channel is unusable: fail what waits on it and close. Once: a request's
        cleanup may send (a staged run's "unstage"), fail, and land here again while its
        handle's lock is held."""
        if self._losing:
            return
        self._losing = True
        self._broken = self._broken or why
        for handle in list(self._pending.values()):
            handle._on_peer_lost(why)
        self._pending.clear()
        self._unsettled.clear()
        self.close()

    def _check_usable(self) -> None:
        if self.closed:
            raise PeerError(f"connection to {self.name} is closed; connect again")
        if self._broken:
            raise PeerError(f"{self.name} is not usable: {self._broken}; connect again")
        now = time.monotonic()
        stale = [r for r, t in self._unsettled.items() if now - t > SETTLE_SECONDS]
        if stale:
            self._broken = (f"it has not answered the cancel of request {stale[0]} for "
                            f"{SETTLE_SECONDS:.0f}s (stalled?)")
            raise PeerError(f"{self.name} is not usable: {self._broken}; connect again")

    @property
    def in_flight(self) -> int:
        return sum(1 for h in self.client._inflight_handles() if h.peer is self)

    def close(self) -> None:
        if self.closed:
            return
        if not self._losing:  # what finished before the close still frees its blocks there
            self._flush_releases()
        self.closed = True
        for handle in [h for h in self.client._inflight_handles() if h.peer is self]:
            handle._on_peer_lost(self._broken or "the connection was closed")
        try:
            with self._send_lock:
                frames.write_frame(self.sock, {"type": "bye"}, 0.5, self.session)
        except KVRuntimeError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass
        for engine in (self._engine, self._pool_engine):
            if engine is not None:  # opened memory lives exactly as long as the peer
                engine.close()
        self._engine = self._pool_engine = None
        self.client._forget(self)


class DecodeClient:
    def __init__(
        self,
        cache: KVCache,
        *,
        binding: NixlBinding | None = None,
        secret: bytes | None = None,
        timeout: float = 5.0,
        ucx_threads: int = 0,
        host_streams: int | None = None,
        device_kind: str = "cpu",
        name: str | None = None,
        engine: str = "auto",
        kv_buffer: str | None = None,
        staging_blocks: int = 0,
        tp_rank: int = 0,
        coalesce: str = "auto",
    ):
        if engine not in ENGINES:
            raise KVRuntimeError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        kv_buffer = resolve_kv_buffer(kv_buffer, device_kind, offered_transports)
        self.cache = cache
        self.kv_buffer = kv_buffer
        self.secret = secret
        self.timeout = timeout
        self.engine = engine
        self.coalesce = coalescing.check_mode(coalesce)
        self._peers: dict[tuple[str, int], PrefillPeer] = {}
        self._closed = False
        self._inflight: dict[int, TransferHandle] = {}
        self._lock = threading.Lock()
        self._progress_lock = threading.Lock()
        self._releaser = ReleaseSender(name or "decode")
        # failed copies UCX (or the GPU) still runs, polled until they end (transfer.py), and
        # the failed handles that settled since get_settled was last called
        self._draining = Draining()
        self._late_settled: list[TransferHandle] = []
        # agents of closed peers whose removal waits for their drained copies (NIXL's remote
        # metadata, the rkeys a READ in flight uses, must outlive it)
        self._leaving: set[str] = set()
        self.staging: StagingPool | None = None
        # the pool requests go through: the host-staged one, or a direct side's for coalesced
        # NIXL transfers (coalesce.py), registered beside the cache
        self.pool: StagingPool | None = None
        self._pool_reg: coalescing.PoolRegistration | None = None
        self._scratch: Scratch | None = None  # the lane probe's destination (registration.py)
        # host-staged: NIXL only ever moves host memory (the pools), whatever the cache is on
        nixl_memory = "cpu" if kv_buffer == "host_staged" else device_kind
        # the same-node engine's reader threads for host memory (None: by this host's cores)
        self.host_streams, self.host_streams_reason = host_copy_streams(
            len(os.sched_getaffinity(0)), host_streams)
        self.agent = Agent(name or unique_name("decode"), binding, nixl_memory, ucx_threads)
        try:
            if kv_buffer == "host_staged":  # NIXL sees the staging pool, never the cache
                self.staging = StagingPool(cache.layout, staging_blocks or cache.layout.num_blocks,
                                           cache)
                self.pool = self.staging
            elif self.coalesce != "never":
                self.pool = coalescing.make_pool(cache, staging_blocks)
                self._pool_reg = coalescing.PoolRegistration(self.agent, self.pool)
            registered = self.staging.cache if self.staging else cache
            self.registration = Registration(self.agent, registered)
            self.info = PeerInfo(registered.layout, self.agent.name, self.agent.metadata(),
                                 self.registration.region_triples(), registered.mem_type,
                                 kv_buffer, cache.layout if self.staging else None, tp_rank)
        except Exception:
            if self._pool_reg is not None:
                self._pool_reg.close()
            if self.pool is not None:
                self.pool.close()
            self.agent.close()
            raise

    def connect(self, host: str, port: int, timeout: float | None = None) -> PrefillPeer:
        timeout = self.timeout if timeout is None else timeout
        address = (host, port)
        stale = self._peers.get(address)
        if stale is not None:
            stale.close()
        start = time.perf_counter()
        sock = connect(host, port, timeout)
        try:
            info = client_handshake(sock, self.info, self.secret, timeout)
            for peer in list(self._peers.values()):
                if peer.info.agent == info.agent:  # same name from another address
                    peer.close()
            if info.agent in self._leaving:  # the last connection's READs: wait them out
                self._draining.drain(timeout)
                self._poll_draining()
                if info.agent in self._leaving:
                    raise PeerError(f"READs of the last connection to {host}:{port} are still "
                                    f"in flight after {timeout:.1f}s; connect again later")
            if info.agent in self.registration.peers:
                self.registration.forget_peer(info.agent)
            name = self.agent.add_remote(info.metadata)
            try:
                self.registration.prepare_peer(name, info.layout, info.regions, info.mem_type)
            except Exception:
                self.registration.forget_peer(name)
                raise
        except BaseException:
            sock.close()
            raise
        peer = PrefillPeer(self, address, sock, info, name, 0.0)
        try:
            peer.head_slice = self._head_slice(info)
        except KVRuntimeError:
            sock.close()
            self.registration.forget_peer(name)
            raise
        self._peers[address] = peer
        if self.engine == "nixl":
            peer.engine_reason = (f"{'host-staged: ' if self.staging else ''}NIXL: forced "
                                  f"(engine='nixl')")
        else:
            try:
                peer._open_samenode(required=self.engine == "samenode")
                if peer.head_slice is not None and self.staging is None:
                    peer._check_engine_heads(info, required=self.engine == "samenode")
                if peer.closed or peer._broken:  # the side channel broke on the way
                    raise PeerError(f"{peer.name}: the connection failed during the connect: "
                                    f"{peer._broken or 'closed'}; connect again")
            except BaseException:
                peer.close()
                raise
        if peer.engine == "nixl" and "VRAM" in (self.cache.mem_type, info.mem_type):
            try:
                self._check_lanes(peer)
            except BaseException:
                peer.close()
                raise
        if self.staging is not None:
            address, length, device = info.regions[0]
            peer.route = PoolRoute(self.staging, (address, length, device), info.mem_type,
                                   info.layout.num_blocks, "host_staged")
        elif peer.engine == "nixl":
            try:
                self._open_pool(peer)
            except BaseException:
                peer.close()
                raise
        peer.handshake_seconds = time.perf_counter() - start
        return peer

    def _open_pool(self, peer: PrefillPeer) -> None:
        """A direct NIXL peer: ask where its staging pool is and, for auto, measure the pair
        (coalesce.py). A prefill without one, or a bad offer, leaves requests direct, and the
        reason is kept."""
        if self.pool is None:
            peer.coalesce_reason = "coalesce='never'"
            return
        try:
            t = time.perf_counter()
            reply = peer._call({"type": "pool"}, "pool", self.timeout)
            round_trip = time.perf_counter() - t
            peer.route = coalescing.route_from(reply, self.pool)
            if self.coalesce == "auto":  # the model's round trip: the best of three
                for _ in range(2):
                    t = time.perf_counter()
                    peer._call({"type": "pool"}, "pool", self.timeout)
                    round_trip = min(round_trip, time.perf_counter() - t)
        except KVRuntimeError as exc:
            if peer._broken:
                raise
            peer.coalesce_reason = f"direct: {exc}"
            log.info("%s: %s", peer.name, peer.coalesce_reason)
            return
        try:
            coalescing.warm(peer, peer.route)
        except KVRuntimeError as exc:
            log.info("%s: warming the READ of its pool: %s", peer.name, exc)
        if self.coalesce != "auto":
            peer.coalesce_reason = f"coalesce={self.coalesce!r}"
            return
        try:
            peer.coalesce_model = coalescing.probe(peer, peer.route, round_trip)
        except KVRuntimeError as exc:
            log.info("%s: coalescing probe: %s", peer.name, exc)
        peer.coalesce_reason = ("auto: by the connect-time probe" if peer.coalesce_model else
                                "direct: the connect-time probe could not run (our pool busy, "
                                "or the peer's cache too small)")

    def _check_lanes(self, peer: PrefillPeer) -> None:
        """Device memory over NIXL: READ a few bytes of the peer's cache into our scratch, so
        that UCX selects (and logs, ucxlog.py) the protocol this pair's memory takes, then
        refuse a device-memory lane on TCP — before any KV moves, never silently."""
        if self._scratch is None:
            self._scratch = Scratch(self.agent, self.cache)
        address, _length, device = peer.info.regions[0]
        n = Scratch.NBYTES
        rows = Rows(self._scratch.descriptor(n),
                    np.array([[address, n, device]], dtype=np.uint64), peer.agent,
                    self._scratch.mem_type, peer.info.mem_type)
        plan = make_plan(peer.info.layout, [0])
        probe = PostedTransfer(self.agent, "READ", plan, None, None, True, b"", 1, rows)
        until = time.monotonic() + self.timeout
        try:
            while probe.poll() == "PROC":
                if time.monotonic() > until:
                    raise TransferError(f"{peer.name}: the connect-time probe READ did not "
                                        f"finish in {self.timeout:.1f}s")
                time.sleep(0.0002)
            if probe.state != "DONE":
                raise TransferError(f"{peer.name}: the connect-time probe READ failed")
        finally:
            if not probe.abort():  # still in flight: released once UCX ends it
                self._draining.add(probe, lambda: None, peer.agent)
        peer.lanes = self.agent.lanes()
        self.agent.check_device_lanes(peer.name, self._scratch.mem_type == "VRAM",
                                      peer.info.mem_type == "VRAM")

    def _head_slice(self, info: PeerInfo):
        """Which of the peer's heads land in which of ours (tp.py): None when whole blocks
        move (same TP and ranks, direct)."""
        from .tp import direct_slice, slice_from

        args = (info.cache_layout, info.tp_rank, self.cache.layout, self.info.tp_rank)
        if self.staging is not None:
            return slice_from(*args)
        return direct_slice(*args)  # a row range of each block: the handshake checked the kinds

    # -- requests in flight ------------------------------------------------------------------
    def get_finished(self) -> list[TransferHandle]:
        """Poll every request in flight once; return (and forget) those that finished since
        the last call, succeeded or failed. Never blocks."""
        for peer in list(self._peers.values()):
            peer._pump()
        finished = []
        for handle in self._inflight_handles():
            handle._advance()
            if handle.state != PENDING:
                finished.append(handle)
        self._releaser.flush()  # one release frame a peer for all of them
        with self._lock:
            for handle in finished:
                self._inflight.pop(id(handle), None)
        return finished

    def get_settled(self) -> list[TransferHandle]:
        """Failed handles that were reported unsettled and have settled since the last call
        (nothing more lands in their blocks: they may be reused now). Polls what is still
        settling; never blocks."""
        self._progress_settling()
        with self._lock:
            out, self._late_settled = self._late_settled, []
        return out

    def _progress_settling(self) -> None:
        """Poll the copies still in flight after their request failed, and the peers' frames
        (a prefill's answer settles a push)."""
        for peer in list(self._peers.values()):
            peer._pump()
        self._poll_draining()

    def _poll_draining(self) -> None:
        """Poll the drained copies; a closed peer's agent goes once none of them uses it."""
        self._draining.poll()
        for agent in [a for a in list(self._leaving) if not self._draining.holds(a)]:
            self._leaving.discard(agent)
            if agent in self.registration.peers:
                self.registration.forget_peer(agent)

    def _settled_late(self, handle: TransferHandle) -> None:
        with self._lock:
            self._late_settled.append(handle)

    def wait_all(self, handles, timeout: float | None = None) -> list[TransferResult]:
        """Wait for every handle; results in order. Raises the first request's error after
        all have finished (so no handle is left running unseen)."""
        until = None if timeout is None else time.monotonic() + timeout
        results, first_error = [], None
        for handle in handles:
            left = None if until is None else max(0.0, until - time.monotonic())
            try:
                results.append(handle.wait(left))
            except WaitTimeout:
                raise
            except KVRuntimeError as exc:
                first_error = first_error or exc
                results.append(None)
        if first_error is not None:
            raise first_error
        return results

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def _track(self, handle: TransferHandle) -> None:
        with self._lock:
            self._inflight[id(handle)] = handle

    def _track_all(self, handles: list) -> None:
        with self._lock:
            self._inflight.update((id(h), h) for h in handles)

    def _consumed(self, handle: TransferHandle) -> None:
        with self._lock:
            self._inflight.pop(id(handle), None)

    def _inflight_handles(self) -> list[TransferHandle]:
        with self._lock:
            return list(self._inflight.values())

    def _progress_worker(self) -> None:
        """Make our UCX worker progress: over a transport that needs the target's help (tcp),
        a prefill's WRITE into us completes only as we call into the worker. The notifications
        that come are the prefill's own pushes landing (``expect_push``)."""
        if not self._progress_lock.acquire(blocking=False):
            return
        try:
            if len(self._draining) or self._leaving:  # failed copies still in flight
                self._poll_draining()
            try:
                notifs = self.agent.call("get_new_notifs", self.agent.nixl.get_new_notifs)
            except KVRuntimeError as exc:
                log.warning("polling notifications: %s", exc)
                return
            for agent, messages in (notifs or {}).items():
                peer = next((p for p in list(self._peers.values()) if p.agent == agent), None)
                if peer is None:
                    log.warning("ignoring %d NIXL notification(s) from %s: not a peer of ours",
                                len(messages), agent)
                    continue
                ignored = [why for why in map(peer._on_notif, messages) if why]
                if ignored:  # one line a poll: a flood of them is not a flood of lines
                    log.warning("%s: ignored %d notification(s): %s", peer.name, len(ignored),
                                ignored[0])
        finally:
            self._progress_lock.release()

    def _log_late(self, handle: TransferHandle, what: str) -> None:
        log.warning("push request %s to %s reported failed, but %s", handle.request_id,
                  handle.peer.name, what)

    # -- peers -------------------------------------------------------------------------------
    def _forget(self, peer: PrefillPeer) -> None:
        if self._peers.get(peer.address) is peer:
            del self._peers[peer.address]
        if self._draining.holds(peer.agent):  # removed once its copies in flight end
            self._leaving.add(peer.agent)
        elif peer.agent in self.registration.peers:
            self.registration.forget_peer(peer.agent)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for peer in list(self._peers.values()):
            peer.close()
        left = self._draining.drain(self.timeout)
        if left:  # the agent goes now: its worker's end stops them (nothing of ours lands)
            log.error("closing with %d failed READ(s) still in flight after %.1fs", left,
                      self.timeout)
        self._releaser.close()
        if self._scratch is not None:
            self._scratch.close()
        self.registration.close()
        if self._pool_reg is not None:
            self._pool_reg.close()
        if self.pool is not None:
            self.pool.close()
        self.agent.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
