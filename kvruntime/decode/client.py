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

import collections
import itertools
import logging
import os
import threading
import time
from contextlib import ExitStack
from dataclasses import replace

from .. import native
from ..engines import choice as engines
from ..engines import coalesce as coalescing
from ..engines.engine import Engine, NotChosen
from ..engines.samenode import ENGINES, host_copy_streams
from ..engines.staged import StagedPull
from ..errors import IncompatiblePeerError, KVRuntimeError, PeerError, WaitTimeout
from ..host.peercred import peer_uid
from ..jobs import TransferResult
from ..memory import KVCache
from ..nixl.agent import open_agent
from ..nixl.transfer import Draining, PostedTransfer, Rows, check_split, split_runs
from ..nixl.transports import offered_transports, shm_am_across_users
from ..numbers import check_seconds
from ..options import Options
from ..pace import Pace
from ..plan import Planner, TransferPlan
from ..pools.staging import StagingPool, resolve_kv_buffer
from ..tp import head_rows
from ..wire import frames, messages
from ..wire.channel import PeerChannel
from ..wire.handshake import PeerInfo, client_handshake, connect
from ..wire.releases import Pending, ReleaseSender
from . import pushes as pushed
from .inflight import PENDING, TransferHandle
from .port import ClientPort

log = logging.getLogger(__name__)

# the sessions of forgotten peers kept to tell a late notification from a forged one
RETIRED_SESSIONS = 8
_request_ids = itertools.count()


class PrefillPeer:
    """One handshaked prefill server."""

    def __init__(self, client: "DecodeClient", address, sock, *, info: PeerInfo, agent: str,
                 handshake_seconds: float):
        self.client = client
        self.port = client.port  # what it and its requests need of the client (port.py)
        self.address = address
        self.info = info
        self.agent = agent
        self.handshake_seconds = handshake_seconds
        # frames to and from the prefill (channel.py): requests awaiting frames, control calls
        self.channel = PeerChannel(sock, info.session, self.name, timeout=client.timeout,
                                   progress=client.progress_worker, on_ready=self.copy_ready,
                                   on_lost=self.close)
        # requests done here whose blocks the prefill may free (releases.py)
        self.releases = Pending(self, client.releaser)
        # what moves its requests (engines/engine.py), chosen once at the connect (choice.py)
        self.mover: Engine = NotChosen()
        self._planner: Planner | None = None  # made at the connect (plan.py)
        self.pace = Pace()  # how fast it has moved requests: how long a wait spins (pace.py)
        self.head_slice = None  # mixed TP: which of its heads go to which of ours (tp.py)
        # each push over NIXL is numbered in its frame, and its notification must name the
        # number: a replayed notification of an earlier request of the same id names another
        self.push_numbers = itertools.count(1)
        self.warm_notes = 0  # "warm" notifications it sent at our connect (prefill/warm.py)
        # a close runs once, in the thread that claims it: the client's, or one whose send
        # found the connection gone (the release sender's); the other waits for its end
        self._close_claim = threading.Lock()
        self._closing = False
        self._close_done = threading.Event()

    # what its engine says of itself, for reports and results (engines/engine.py)
    engine = property(lambda self: self.mover.name, doc='What moves its requests: "nixl", '
                      '"host_staged", or the same-node engine ("samenode:...").')
    engine_reason = property(lambda self: self.mover.reason, doc="Why that engine.")
    staged_copy = property(lambda self: self.mover.staged_copy, doc="Host-staged: what moves a "
                           "staged run from the prefill's pool into ours; None for a direct peer.")
    samenode = property(lambda self: self.mover.samenode, doc="The same-node engine, or None.")
    route = property(lambda self: self.mover.route, doc="The way through the staging pools.")
    coalesce_model = property(lambda self: self.mover.coalesce_model)
    coalesce_reason = property(lambda self: self.mover.coalesce_reason)
    lanes = property(lambda self: self.mover.lanes, doc="UCX's lanes after the connect's probe.")

    @property
    def closed(self) -> bool:
        return self.channel.closed

    @property
    def broken(self) -> str | None:
        """Why the peer may not be used any more (None: it may)."""
        return self.channel.broken

    @property
    def name(self) -> str:
        return f"prefill {self.address[0]}:{self.address[1]}"

    def use(self, engine: Engine) -> None:
        """Its engine, chosen at the connect (engines/choice.py); then its first request's
        costs paid now (the planner, a same-node engine's rehearsal)."""
        self.mover = engine
        self.planner()
        engine.rehearse(self)

    # -- starting requests -------------------------------------------------------------------
    def start_pull(self, src_blocks, dst_blocks=None, request_id: str | None = None,
                   timeout: float = 30.0, split: int | None = None) -> TransferHandle:
        """Post a READ of the peer's ``src_blocks`` into our ``dst_blocks``; once it is done, a
        release frame tells the prefill side it may free the request's blocks. ``split``:
        NIXL descriptors per run of blocks (None: ``read_split`` chooses). The engine chooses
        the road: our copy on the same-node engine; the pools for a host-staged peer or a
        coalesced request; else one READ with the caches' lists."""
        t0 = time.perf_counter()
        if split is not None:
            check_split(split)
        plan, request_id = self._admit(src_blocks, dst_blocks, request_id, timeout)
        return self.mover.pull(self, self.make_handle("pull", request_id, plan, timeout, t0),
                               split)

    def start_push(self, src_blocks, dst_blocks=None, request_id: str | None = None,
                   timeout: float = 30.0, split: int = 1) -> TransferHandle:
        """Ask the prefill side to WRITE its ``src_blocks`` into our ``dst_blocks``. Done when
        the prefill's reply is in: it sends it once NIXL has flushed the WRITE (NIXL flushes
        every connection of a transfer before calling it done), i.e. the data has landed.
        The same-node engine copies it itself, a coalesced one goes as a pull (the outcome is
        the push's)."""
        t0 = time.perf_counter()
        check_split(split)
        plan, request_id = self._admit(src_blocks, dst_blocks, request_id, timeout)
        self.channel.check_new(request_id)
        return self.mover.push(self, self.make_handle("push", request_id, plan, timeout, t0),
                               split)

    def expect_push(self, dst_blocks, request_id: str | None = None,
                    timeout: float = 30.0) -> TransferHandle:
        """Tell the prefill where request ``request_id``'s blocks go here, ahead of time; the
        prefill pushes them when it has them (``PrefillServer.start_push``): over NIXL its
        WRITE's notification finishes the handle, on the same-node engine we copy them on
        its "ready" (decode/pushes.py says how, and what a caller's polls must do). Past
        ``timeout`` the request fails and the prefill is told to drop it; a WRITE it has
        started is aborted."""
        return pushed.expect(self, dst_blocks, request_id, timeout, time.perf_counter())

    def start_pulls(self, requests, timeout: float = 30.0) -> list[TransferHandle]:
        """Start many pulls at once — an engine step's worth — and get one handle each.

        ``requests``: ``(src_blocks, dst_blocks or None, request_id or None)`` tuples. Every
        request is checked as by ``start_pull``, and no destination block may appear in two of
        them. On the same-node engine the whole batch is one gather (one id upload, one launch
        per region): a request's host cost is then its planning alone. Over NIXL each request
        is posted as its own READ (released by the poll that sees it done), or goes through
        the pools where ``start_pull`` would take it there (a host-staged peer, a coalesced
        request): each request takes ``start_pull``'s road.
        """
        requests = list(requests)
        t0 = time.perf_counter()
        if not requests:
            return []
        self.check_request(timeout)
        # the batch planned at once (plan.py): its checks are each request's and "no block
        # written twice", its host cost a few numpy calls, not a plan per request
        plans, merged = self.planner().plan_many([(src, dst) for src, dst, _ in requests])
        admitted = list(zip(plans, [self.name_request(rid) for _, _, rid in requests]))
        if len({rid for _plan, rid in admitted}) != len(admitted):
            raise KVRuntimeError("a request id appears twice in one batch")
        return self.mover.pulls(self, admitted, merged, timeout, t0)

    # -- the roads an engine starts a request on (engines/engine.py) ---------------------------
    def start_staged(self, handle: TransferHandle, route, new: bool = True) -> TransferHandle:
        """Through the pools by ``route`` (staging.py: host-staged, or coalesced): the prefill
        gathers into its pool chunk by chunk, we READ each chunk into ours and scatter it. A
        push takes the same road (the outcome is the push's), and so does a push the prefill
        started (``new`` False: its handle already waits for frames, decode/pushes.py's
        ready)."""
        if new:
            self.channel.check_new(handle.request_id)
        # larger than the pools: in pieces; not even a block fits: refused now (StagedPull)
        job = StagedPull(self, handle.plan, handle.request_id,
                         deadline_wall=time.time() + handle.deadline - time.monotonic(),
                         route=route)
        # the prefill's "staged" answers come over the side channel
        handle.attach(job, uses_peer=True)
        if new:
            self.channel.expect(handle)
        self.port.track(handle)
        job.send()
        return handle

    def post_read(self, handle: TransferHandle, split: int | None) -> TransferHandle:
        """One NIXL READ with the caches' lists (mixed TP: our heads of each token row)."""
        reg = self.client.registration
        if split is None:
            split = self.read_split(handle.plan)
        rows = None
        if self.head_slice is not None:  # mixed TP, direct: our heads of each token row
            s, src, dst = self.head_slice, *handle.plan.block_ids()
            rows = Rows(head_rows(self.client.cache.layout, reg.region_triples(), dst, s.dst),
                        head_rows(self.info.layout, self.info.regions, src, s.src), self.agent,
                        self.client.cache.mem_type, self.info.mem_type)
        # No NIXL notification on the READ: one keeps the READ (and the next one on this
        # connection) from completing until the prefill's UCX worker progresses, which its
        # idle loop does every millisecond (H100 VM: a 16 MiB READ 1043 µs with one, 80
        # without). The release goes over the side channel once the READ is done.
        handle.attach(PostedTransfer(
            self.client.agent, "READ", plan=handle.plan, local_dlist=reg.local_dlist,
            remote_dlist=reg.peer_dlist(self.agent), rows=rows, split=split),
            nbytes=None if rows is None else rows.nbytes)
        self.port.track(handle)
        return handle

    def start_local(self, handle: TransferHandle, job) -> TransferHandle:
        """The same-node engine's copy ``job`` moves it (a push too: we copy, and tell the
        prefill once it is done)."""
        handle.attach(job, uses_peer=False)
        self.port.track(handle)
        return handle

    def ask_push(self, handle: TransferHandle, split: int) -> TransferHandle:
        """A push the prefill WRITEs: asked for with a "push" frame (decode/pushes.py)."""
        return pushed.ask(self, handle, split)

    def read_split(self, plan: TransferPlan) -> int:
        """Pieces per run for a READ of ``plan`` when the caller names none (``split_runs``)."""
        return split_runs(plan.descriptor_count, self.read_threads)

    @property
    def read_threads(self) -> int:
        """The UCX threads a READ from this peer spreads over: the agent's for host memory
        read whole blocks at a time, else 1."""
        if self.client.cache.mem_type != "DRAM" or self.head_slice is not None:
            return 1
        return self.client.agent.ucx_threads

    def make_handle(self, op, request_id, plan, timeout, t0, *,
                    by_prefill: bool = False) -> TransferHandle:
        # mixed TP: what lands is this peer's share of our heads
        nbytes = (plan.nbytes if self.head_slice is None else
                  plan.nbytes * self.head_slice.count // self.client.cache.layout.num_kv_heads)
        return TransferHandle(self, op, request_id, plan=plan, timeout=timeout, started=t0,
                              nbytes=nbytes, by_prefill=by_prefill)

    def release_later(self, request_ids: list) -> None:
        """``request_ids`` are done here (a pull's READ, a same-node copy): the prefill may
        free their blocks. Sent when the host waits anyway (releases.py): requests seen done
        together go in one frame."""
        self.releases.add(request_ids)

    def pull(self, src_blocks, dst_blocks=None, request_id: str | None = None,
             timeout: float = 30.0, split: int | None = None) -> TransferResult:
        return self.start_pull(src_blocks, dst_blocks, request_id, timeout, split).wait()

    def push(self, src_blocks, dst_blocks=None, request_id: str | None = None,
             timeout: float = 30.0, split: int = 1) -> TransferResult:
        return self.start_push(src_blocks, dst_blocks, request_id, timeout, split).wait()

    def _admit(self, src_blocks, dst_blocks, request_id, timeout):
        self.check_request(timeout)
        return self.planner().plan(src_blocks, dst_blocks), self.name_request(request_id)

    def check_request(self, timeout) -> None:
        self.channel.check_usable()
        check_seconds("timeout", timeout)

    def planner(self) -> Planner:
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

    def name_request(self, request_id) -> str:
        if request_id is None:
            return f"{os.getpid()}-{next(_request_ids)}"
        if not isinstance(request_id, str) or not request_id or len(request_id) > 256:
            raise KVRuntimeError("request_id must be a non-empty string of at most 256 chars")
        return request_id

    # -- control calls -------------------------------------------------------------------------
    def digests(self, blocks, timeout: float = 60.0) -> list[str]:
        blocks = [int(b) for b in blocks]
        reply = self.channel.call(messages.DIGESTS, timeout, blocks=frames.pack_ids(blocks))
        out = reply.get("digests")
        if not isinstance(out, list) or len(out) != len(blocks):
            raise PeerError("peer answered a digests request with the wrong number of digests")
        return out

    def copy_ready(self, handle: TransferHandle, message: dict) -> None:
        """A "ready" for a push we copy ourselves (decode/pushes.py)."""
        pushed.copy_ready(self, handle, message)

    def on_notif(self, raw) -> str | None:
        """A NIXL notification from this peer's agent (decode/pushes.py); why it was ignored, if it
        was."""
        return pushed.on_notif(self, raw)

    # -- the side channel (channel.py) ------------------------------------------------------------
    def send(self, message: dict) -> None:
        """One frame to the prefill; a failed send loses the peer (and raises)."""
        self.channel.send(message)

    def pump(self) -> None:
        """Read the prefill's frames and hand them out; make our UCX worker progress."""
        self.channel.pump()

    def await_frame(self, seconds: float) -> None:
        self.channel.await_frame(seconds)

    def advance_pooled(self, waiting: TransferHandle) -> None:
        """Poll our other requests through the pools while ``waiting`` is waited on: a piece
        the prefill staged holds its pool units until its READ ends, which only a poll of its
        own handle drives; a caller waiting on one handle of a batch (start_pulls) left the
        others' READs unposted while the first waited for those units, until its deadline."""
        for handle in self.port.of(self):
            if handle is not waiting and handle.pooled:
                handle.advance()

    def settled(self, handle: TransferHandle) -> None:
        self.channel.settled(handle)

    def cancel(self, handle: TransferHandle) -> None:
        self.channel.cancel(handle.request_id)

    @property
    def in_flight(self) -> int:
        return len(self.port.of(self))

    def close(self) -> None:
        with self._close_claim:
            claimed, self._closing = not self._closing, True
        if not claimed:  # another thread closes it, or this one, re-entered through a send
            return
        try:
            self._close()
        finally:
            self._close_done.set()

    def wait_closed(self, timeout: float) -> bool:
        """Wait for a close another thread runs; False if it has not ended in ``timeout``."""
        return self._close_done.wait(timeout)

    def _close(self) -> None:
        if not self.channel.losing:  # what finished before the close still frees its blocks
            self.releases.flush()
            if not self.broken:
                pushed.settle_on_close(self)
        self.channel.closed = True  # nothing goes out now but the "bye"
        for handle in self.port.of(self):
            handle.on_peer_lost(self.broken or "the connection was closed")
        self.channel.hang_up()
        self.mover.close()  # opened memory lives exactly as long as the peer
        self.client.forget(self)


class DecodeClient:
    def __init__(self, cache: KVCache, options: Options | None = None, *,
                 host_streams: int | None = None, engine: str = "auto", **shared):
        """A decode's client for ``cache``. ``options`` (options.py), or its fields as keyword
        arguments, are what a prefill server takes too; ``engine``: "auto", "nixl" or
        "samenode" (engines/choice.py); ``host_streams``: the same-node engine's reader threads for
        host memory (None: by this host's cores)."""
        o = self.options = Options.of(options, shared)
        if engine not in ENGINES:
            raise KVRuntimeError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
        # the mode asked for, else KVRUNTIME_KV_BUFFER, else by the device (staging.py)
        o = self.options = replace(o, kv_buffer=resolve_kv_buffer(o.kv_buffer, o.device_kind,
                                                                  offered_transports))
        self.cache = cache
        self.kv_buffer = o.kv_buffer
        self.secret = o.secret
        # the C block-id reader built or loaded now (native.py), not by a first request (on
        # 2 x H100 its load was 1 of a first same-node pull's 2 ms; a build takes seconds)
        log.debug("native id reader: %s", native.status())
        self.timeout = o.timeout
        self.engine = engine
        self.coalesce = coalescing.check_mode(o.coalesce)
        self._peers: dict[tuple[str, int], PrefillPeer] = {}
        self._closed = False
        self._progress_lock = threading.Lock()
        self.releaser = ReleaseSender(o.name or "decode")
        # failed copies UCX (or the GPU) still runs, polled until they end (transfer.py)
        self.draining = Draining()
        # what its peers and their requests need of it: the requests in flight, the failed
        # ones that settled since get_settled was last called (port.py)
        self.port = ClientPort(releaser=self.releaser, draining=self.draining,
                               timeout=o.timeout, progress_settling=self.progress_settling)
        # agents of closed peers whose removal waits for their drained copies (NIXL's remote
        # metadata, the rkeys a READ in flight uses, must outlive it)
        self._leaving: set[str] = set()
        # the sessions of the last peers forgotten: a notification one of them sealed that
        # lands after we connected again is late, not forged (pushes.of_an_earlier_connection)
        self._retired: collections.deque = collections.deque(maxlen=RETIRED_SESSIONS)
        self.late_notifs = 0
        self.staging: StagingPool | None = None
        # the pool requests go through: the host-staged one, or a direct side's for coalesced
        # NIXL transfers (coalesce.py), registered beside the cache
        self.pool: StagingPool | None = None
        # the same-node engine's reader threads for host memory (None: by this host's cores)
        self.host_streams, self.host_streams_reason = host_copy_streams(
            len(os.sched_getaffinity(0)), host_streams)
        # Each part's end is pushed as it is made; close() ends them in the reverse order (a
        # constructor that fails half way ends those it made): each peer, our failed READs
        # still in flight, the release sender and the probe, then the memory and the agent.
        with ExitStack() as stack:
            # NIXL's UCX threads: None chooses by what NIXL moves, the cores and /dev/shm
            self.agent, self.ucx_threads_reason = open_agent(o, cache, "decode")
            stack.callback(self.agent.close)
            self._probe = engines.LaneProbe(self.agent, cache, draining=self.draining,
                                            timeout=o.timeout)
            self.staging, self.pool, self.registration = coalescing.open_pools(
                stack, self.agent, cache, o.kv_buffer, self.coalesce, o.staging_blocks)
            registered = self.staging.cache if self.staging else cache
            # what our gather into our pool costs, for auto's model: the client's, measured
            # once now, not by each connect's probe (coalesce.py)
            self.gather_cost = None
            if self.coalesce == "auto" and self.staging is None:
                start = time.perf_counter()
                self.gather_cost = coalescing.measure_gather(self.pool, cache.layout)
                log.info("%s: our gather into the pool: %s in %.1f ms", self.agent.name,
                         self.gather_cost, (time.perf_counter() - start) * 1e3)
            stack.callback(self._probe.close)
            stack.callback(self.releaser.close)
            stack.callback(self._drain)
            stack.callback(self._close_peers)
            # what the same-node engine's first connect would pay (its gather kernel), paid
            # now: None where no same-node CUDA engine can serve, else what was done
            start = time.perf_counter()
            self.prewarmed = engines.prewarm(engine, o.kv_buffer, cache)
            if self.prewarmed is not None:
                log.info("%s: %s in %.0f ms", self.agent.name, self.prewarmed,
                         (time.perf_counter() - start) * 1e3)
            # a direct cache's scratch is the prefill's to WRITE at our connect (warm.py)
            self.info = PeerInfo(registered.layout, self.agent.name, self.agent.metadata(),
                                 self.registration.region_triples(), registered.mem_type,
                                 o.kv_buffer, cache.layout if self.staging else None, o.tp_rank,
                                 o.app, None if self.staging else self._probe.triple)
            self._teardown = stack.pop_all()

    def connect(self, host: str, port: int, timeout: float | None = None) -> PrefillPeer:
        timeout = self.timeout if timeout is None else timeout
        address = (host, port)
        stale = self._peers.get(address)
        if stale is not None:
            stale.close()
        start = time.perf_counter()
        sock = connect(host, port, timeout)
        added = []  # the prefill's agent, once added

        def admit(info: PeerInfo) -> None:  # while the prefill admits us (client_handshake)
            for peer in list(self._peers.values()):
                if peer.info.agent == info.agent:  # same name from another address
                    peer.close()
            if info.agent in self._leaving:  # the last connection's READs: wait them out
                self.draining.drain(timeout)
                self._poll_draining()
                if info.agent in self._leaving:
                    raise PeerError(f"READs of the last connection to {host}:{port} are still "
                                    f"in flight after {timeout:.1f}s; connect again later")
            if info.agent in self.registration.peers:
                self.registration.forget_peer(info.agent)
            added.append(self.agent.add_remote(info.metadata))
            self.registration.prepare_peer(added[0], info.layout, info.regions, info.mem_type)

        try:
            refusal = shm_am_across_users(os.geteuid(), peer_uid(sock), os.environ,
                                          f"the prefill {host}:{port}")
            if refusal is not None:  # before its metadata: our agent never meets it
                raise IncompatiblePeerError(refusal, ["uid"])
            info = client_handshake(sock, self.info, self.secret, timeout, admit)
            name = added[0]
        except BaseException:
            sock.close()
            if added:  # its list (if made), then its agent
                self.registration.forget_peer(added[0])
            raise
        peer = PrefillPeer(self, address, sock, info=info, agent=name, handshake_seconds=0.0)
        try:
            peer.head_slice = engines.head_slice(info, self.info, self.cache.layout,
                                                 self.staging is not None)
        except KVRuntimeError:
            sock.close()
            self.registration.forget_peer(name)
            raise
        self._peers[address] = peer
        try:
            peer.use(engines.choose(peer, self.engine, self._probe))
        except BaseException:
            peer.close()
            raise
        peer.handshake_seconds = time.perf_counter() - start
        return peer

    # -- requests in flight ------------------------------------------------------------------
    def get_finished(self) -> list[TransferHandle]:
        """Poll every request in flight once; return (and forget) those that finished since
        the last call, succeeded or failed. Never blocks."""
        for peer in list(self._peers.values()):
            peer.pump()
        finished = []
        for handle in self.port.handles():
            handle.advance()
            if handle.state != PENDING:
                finished.append(handle)
        self.releaser.flush()  # one release frame a peer for all of them
        self.port.consumed_all(finished)
        return finished

    def get_settled(self) -> list[TransferHandle]:
        """Failed handles that were reported unsettled and have settled since the last call
        (nothing more lands in their blocks: they may be reused now). Polls what is still
        settling; never blocks."""
        self.progress_settling()
        return self.port.take_settled()

    def progress_settling(self) -> None:
        """Poll the copies still in flight after their request failed, and the peers' frames
        (a prefill's answer settles a push)."""
        for peer in list(self._peers.values()):
            peer.pump()
        self._poll_draining()

    def _poll_draining(self) -> None:
        """Poll the drained copies; a closed peer's agent goes once none of them uses it."""
        self.draining.poll()
        for agent in [a for a in list(self._leaving) if not self.draining.holds(a)]:
            self._leaving.discard(agent)
            if agent in self.registration.peers:
                self.registration.forget_peer(agent)

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
        return len(self.port)

    def track(self, handle: TransferHandle) -> None:
        self.port.track(handle)

    def inflight_handles(self) -> list[TransferHandle]:
        return self.port.handles()

    def progress_worker(self) -> None:
        """Make our UCX worker progress: over a transport that needs the target's help (tcp),
        a prefill's WRITE into us completes only as we call into the worker. The notifications
        that come are the prefill's own pushes landing (``expect_push``)."""
        if not self._progress_lock.acquire(blocking=False):
            return
        try:
            if len(self.draining) or self._leaving:  # failed copies still in flight
                self._poll_draining()
            try:
                notifs = self.agent.call("get_new_notifs", self.agent.nixl.get_new_notifs)
            except KVRuntimeError as exc:
                log.warning("polling notifications: %s", exc)
                return
            for agent, notes in (notifs or {}).items():
                peer = next((p for p in list(self._peers.values()) if p.agent == agent), None)
                late, ignored = 0, []
                for note in notes:
                    why = peer.on_notif(note) if peer else "not a peer of ours"
                    if why is None:
                        continue
                    if pushed.of_an_earlier_connection(self._retired, agent, note):
                        late += 1
                    else:
                        ignored.append(why)
                if late:
                    self.late_notifs += late
                    log.debug("%s: dropped %d notification(s) of an earlier connection",
                              agent, late)
                if ignored:  # one line a poll: a flood of them is not a flood of lines
                    log.warning("%s: ignored %d notification(s): %s",
                                peer.name if peer else agent, len(ignored), ignored[0])
        finally:
            self._progress_lock.release()

    # -- peers -------------------------------------------------------------------------------
    def forget(self, peer: PrefillPeer) -> None:
        if self._peers.get(peer.address) is peer:
            del self._peers[peer.address]
            self._retired.append((peer.agent, peer.channel.session))
        if self.draining.holds(peer.agent):  # removed once its copies in flight end
            self._leaving.add(peer.agent)
        elif peer.agent in self.registration.peers:
            self.registration.forget_peer(peer.agent)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._teardown.close()  # in the order the constructor gave (there)

    def _close_peers(self) -> None:
        for peer in list(self._peers.values()):
            peer.close()
            if not peer.wait_closed(self.timeout):  # closed by another thread, still going
                log.error("%s: its close in another thread has not ended after %.1fs; "
                          "closing the client anyway", peer.name, self.timeout)

    def _drain(self) -> None:
        left = self.draining.close(self.timeout)
        if left:  # released: the agent goes with them, and UCX's connections (transfer.py)
            log.error("closing with %d failed READ(s) still in flight after %.1fs: dropped "
                      "with the NIXL agent", left, self.timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
