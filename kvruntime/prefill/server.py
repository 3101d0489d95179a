"""The prefill side: owns the KV cache, listens on the side channel, serves decode peers.

Per connection: handshake (auth, compat, metadata both ways), then control requests (push,
cancel, digests) until the peer leaves. Any bad frame closes *that* connection and releases the
peer's agent, prepared list and WRITEs in flight; the server keeps serving the others.

Pushes are asynchronous here too: the connection thread posts the WRITE and goes back to
reading, so one decode can keep many pushes in flight. Every WRITE carries a NIXL notification
(a "pushed", sealed with the session's key) that is the decode's answer: nothing crosses the
side channel between the post and the data's arrival, and no thread of ours wakes for it. A
progress thread polls the WRITEs: one that ended releases its request, one that failed is
answered by a ``push_failed`` frame. Released request ids, per decode agent, come from the
decodes' release frames (pulls and same-node copies) and from our own WRITEs that ended
(pushes).

A push can also be ours to start, as an engine does once a request's KV is computed: the
decode names the blocks beforehand (an ``expect`` frame) and ``start_push`` posts the WRITE.
Pushes are the one use kvruntime has for NIXL notifications: one on a READ would keep it from
completing until the other side's UCX worker progressed. A push whose deadline (the decode's
wall clock) has passed when it is read is refused. A WRITE once posted cannot be stopped (UCX
cancels no RMA, transfer.py): one still running at its deadline, at a cancel, or when its
decode leaves is polled until UCX ends it, and its answer (the notification: it landed late;
``push_failed``: it ended in error) is what settles the decode's failed request; a departed
decode's agent is removed once its WRITEs have ended.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections import deque
from contextlib import ExitStack
from dataclasses import dataclass, field, replace

from .. import native
from ..engines import coalesce as coalescing
from ..engines.samenode import NodeToken, serve_offer
from ..errors import KVRuntimeError, PeerError
from ..host.peercred import peer_uid
from ..layout import KVLayout
from ..memory import KVCache
from ..nixl.agent import open_agent
from ..nixl.transports import offered_transports, shm_am_across_users
from ..numbers import check_seconds
from ..options import Options
from ..plan import Planner, make_plan
from ..pools.staging import StagingPool, resolve_kv_buffer
from ..tp import HeadSlice, direct_slice
from ..wire import frames, messages
from ..wire.channel import Channel
from ..wire.handshake import PeerInfo, serve_handshake
from ..wire.listener import Listener
from ..wire.mailbox import Mailbox
from ..wire.releases import Released
from .progress import Progress
from .pushes import Pushes, Writes
from .stages import MAX_STAGE_SECONDS, Stages
from .warm import Warms

log = logging.getLogger(__name__)




@dataclass
class _Peer:  # one decode's connection
    info: PeerInfo
    agent: str
    channel: Channel  # its side channel's socket and session (channel.py)
    head_slice: HeadSlice | None = None  # mixed TP, direct: our heads -> its heads (tp.py)
    lanes_checked: bool = False  # UCX's lanes for its device memory looked at (ucxlog.py)
    opened: bool = False  # it asked for our same-node offer: it may copy our pushes itself
    mailbox: Mailbox | None = None  # what it reads of our readies before their frames
    # request -> where its blocks go, for the pushes we start (start_push); at most MAX_EXPECTED
    # requests and, together, as many blocks as its cache has (kept by pushes.Pushes)
    expected: dict = field(default_factory=dict)
    expected_blocks: int = 0
    # pushes we started whose "ready" went to it (it copies them itself: same-node, or
    # through the pools) and that it has not released yet: its release frame or unstage says
    # when, and if its connection ends first, its end does (pushes.Pushes, _drop_peer)
    readied: set = field(default_factory=set)

    _planner: Planner | None = None  # its pushes' planner, made at the first one

    def planner(self, ours: KVLayout) -> Planner:
        """Plans our blocks into its cache (mixed TP, direct: counted in its heads)."""
        if self._planner is None:
            src = (ours if self.head_slice is None else
                   replace(self.info.layout, num_blocks=ours.num_blocks))
            self._planner = Planner(src, self.info.layout)
        return self._planner

    def send(self, message: dict, timeout: float) -> None:
        """The connection thread and the progress loop both answer on its channel."""
        self.channel.send(message, timeout)


# What a server keeps of refused connections: the newest, and a count of all.
REFUSED_KEPT = 256


@dataclass
class ServerStats:
    connections: int = 0
    handshakes: int = 0
    refused: deque = field(default_factory=lambda: deque(maxlen=REFUSED_KEPT))  # (addr, why)
    refused_total: int = 0
    late_pushes: int = 0  # pushes refused because their deadline passed before we read them
    accept_errors: int = 0  # accept() failures (EMFILE, ENFILE, ENOBUFS...) survived
    over_limit: int = 0  # connections closed at once: too many open, or handshaking per address
    warmed: int = 0  # decodes whose memory our UCX mapped at their connect (warm.py)
    warm_failed: int = 0  # decodes whose mapping READ failed: their first push maps it

    def refuse(self, addr, why: str) -> None:
        self.refused.append((f"{addr[0]}:{addr[1]}", why))
        self.refused_total += 1


class PrefillServer:
    def __init__(self, cache: KVCache, options: Options | None = None, *,
                 host: str = "127.0.0.1", port: int = 0, on_release=None,
                 max_connections: int = 256, max_handshaking_per_address: int = 16,
                 max_stage_seconds: float = MAX_STAGE_SECONDS, **shared):
        """Serve ``cache`` on ``host``:``port`` (0: any free port; ``address`` says which).
        ``options`` (options.py), or its fields as keyword arguments, are what a decode
        client takes too; ``on_release(request)`` is called as requests are released;
        ``max_connections`` and ``max_handshaking_per_address`` bound what a flood of
        connections can hold; ``max_stage_seconds`` caps how far ahead of its arrival a
        decode's stage may set its deadline (a run never unstaged is freed 5 s after it)."""
        check_seconds("max_stage_seconds", max_stage_seconds)
        o = self.options = Options.of(options, shared)
        # the mode asked for, else KVRUNTIME_KV_BUFFER, else by the device (staging.py)
        o = self.options = replace(o, kv_buffer=resolve_kv_buffer(o.kv_buffer, o.device_kind,
                                                                  offered_transports))
        coalescing.check_mode(o.coalesce)
        self.cache = cache
        self.kv_buffer = o.kv_buffer
        # the C block-id reader built or loaded now (native.py), not by a first request (on
        # 2 x H100 its load was 1 of a first same-node pull's 2 ms; a build takes seconds)
        log.debug("native id reader: %s", native.status())
        self.staging: StagingPool | None = None
        # the pool staged requests are gathered into: the host-staged one, or a direct
        # server's for its decodes' coalesced requests (coalesce.py; none for "never")
        self.pool: StagingPool | None = None
        self.secret = o.secret
        self.timeout = o.timeout
        self.stats = ServerStats()
        self.released = Released(on_release)  # what decodes said may be freed (releases.py)
        self._work = threading.Event()
        self._token = NodeToken()
        self._peers: dict[str, _Peer] = {}
        # Adding and dropping a peer are atomic: a reconnecting decode reuses its agent name,
        # and the old connection's teardown must not remove the new connection's agent.
        self._peers_lock = threading.RLock()
        self._stop = threading.Event()
        self._closed = False
        # Each part's end is pushed as it is made; close() ends them in the reverse order (a
        # constructor that fails half way ends those it made): stop and stop accepting, drop
        # each peer, our pushes and WRITEs, then the memory and the agent under them.
        with ExitStack() as stack:
            self.agent, self.ucx_threads_reason = open_agent(o, cache, "prefill")
            stack.callback(self.agent.close)
            self.staging, self.pool, self.registration = coalescing.open_pools(
                stack, self.agent, cache, o.kv_buffer, o.coalesce, o.staging_blocks)
            # our WRITEs and the pushes they serve (prefill/pushes.py)
            self.writes = Writes(self.agent, self.registration, cache, timeout=o.timeout,
                                 release=self._release, wake=self._work.set,
                                 peers_lock=self._peers_lock,
                                 warms=Warms(self.agent, cache, self.stats))
            stack.callback(self.writes.close)
            self.pushes = Pushes(self.writes, self.stats, self._peers,
                                 staged=self.staging is not None,
                                 pooled=self.pool is not None and self.staging is None)
            stack.callback(self.pushes.close)
            # requests through our pool: gathered, answered chunk by chunk, held (stages.py)
            self.stages = Stages(self.pool, cache, timeout=o.timeout, release=self._release,
                                 wake=self._work.set, max_seconds=max_stage_seconds)
            stack.callback(self._drop_peers)
            # accepting within limits, a thread a connection (listener.py); bound last, so
            # that everything a connection is served by is there first
            self.listener = Listener(
                host, port, self.stats, serve=self._serve_connection, stop=self._stop,
                max_connections=max_connections,
                max_handshaking_per_address=max_handshaking_per_address)
            stack.callback(self.listener.close)
            stack.callback(self._stop.set)
            if o.secret is None and not _loopback(host):
                # NIXL metadata grants access to the registered memory: without a secret,
                # anyone who can reach this port can read (and write) this cache.
                log.warning("PrefillServer on %s:%s has NO shared secret: any host that "
                            "reaches this port gets read/write access to the KV cache; pass "
                            "secret=... (or bind to 127.0.0.1)", host, self.address[1])
            registered = self.staging.cache if self.staging else cache
            self.info = PeerInfo(registered.layout, self.agent.name, self.agent.metadata(),
                                 self.registration.region_triples(), registered.mem_type,
                                 o.kv_buffer, cache.layout if self.staging else None,
                                 o.tp_rank, o.app)
            self._teardown = stack.pop_all()
        self.listener.spawn(self.listener.accept_loop, "kvr-accept")
        progress = Progress(self.agent, self.writes, self.pushes, self.stages, stop=self._stop,
                            work=self._work)
        self.listener.spawn(progress.run, "kvr-progress")

    @property
    def address(self) -> tuple[str, int]:
        return self.listener.address

    # -- serving -----------------------------------------------------------------------------
    def _serve_connection(self, sock: socket.socket, addr) -> None:
        peer = None
        admitted = []

        def admit(info: PeerInfo) -> None:  # before "ready": the decode may send at once
            admitted.append(self._add_peer(info, sock))
            self.listener.admitted(addr[0])

        try:
            serve_handshake(sock, self.info, self.secret, self.timeout, admit,
                            lambda: shm_am_across_users(os.geteuid(), peer_uid(sock),
                                                        os.environ, "the decode"))
            peer = admitted[0]
            self.stats.handshakes += 1
            if self.staging is None and peer.info.kv_buffer != "host_staged":
                # a decode we may WRITE into: its memory mapped soon (by the progress loop's
                # idle passes, warm.AFTER from now), not by its first push
                self.writes.warms.add(peer)
            while not self._stop.is_set():
                try:
                    message = peer.channel.read(None)
                except PeerError as exc:
                    log.info("connection from %s:%s ended: %s", addr[0], addr[1], exc)
                    return  # the decode side left
                if messages.BYE.is_(message):
                    return
                self._handle(peer, message)
        except KVRuntimeError as exc:
            if not self._stop.is_set():
                log.warning("closing connection from %s:%s: %s", addr[0], addr[1], exc)
                self.stats.refuse(addr, str(exc))
        except Exception as exc:  # never let one connection take the server down
            log.exception("unexpected error serving %s:%s", addr[0], addr[1])
            self.stats.refuse(addr, repr(exc))
        finally:
            # hung up first, its runs freed after: a decode whose READ of a run is still in
            # flight sees the hang-up before it scatters what it read (staged.py), so a run
            # we reuse once freed never lands in its cache
            self.listener.hang_up(sock)
            peer = peer or (admitted[0] if admitted else None)
            if peer is not None:
                self._drop_peer(peer)
            else:
                self.listener.admitted(addr[0])

    def _add_peer(self, info: PeerInfo, sock: socket.socket) -> _Peer:
        with self._peers_lock:
            old = self._peers.get(info.agent)
            if old is not None:  # the same agent name again: a restarted or reconnected peer
                old.channel.end()  # hung up before its runs are freed (_serve_connection)
                self._drop_peer(old)
            self.writes.admit(info.agent)  # its previous connection's WRITEs: waited out
            name = self.agent.add_remote(info.metadata)
            try:
                self.registration.prepare_peer(name, info.layout, info.regions, info.mem_type)
            except Exception:
                self.agent.remove_remote(name)
                raise
            peer = _Peer(info, name, Channel(sock, info.session),
                         head_slice=self._head_slice(info))
            self._peers[name] = peer
            return peer

    def _head_slice(self, info: PeerInfo) -> HeadSlice | None:
        """The heads a direct mixed-TP decode rank takes from us (its pushes write just those
        rows); None for whole blocks, and for pairs the decode itself refuses at connect."""
        if self.staging is not None or info.kv_buffer == "host_staged":
            return None
        try:
            return direct_slice(self.cache.layout, self.info.tp_rank, info.cache_layout,
                                info.tp_rank)
        except KVRuntimeError:
            return None

    def _drop_peer(self, peer: _Peer) -> None:
        """Release ``peer``'s list and agent, once; a no-op when a newer connection of the same
        agent name has replaced it (its teardown then belongs to that connection)."""
        with self._peers_lock:
            if self._peers.get(peer.agent) is not peer:
                return
            del self._peers[peer.agent]
            self.writes.drop(peer)
            # no unstage of its can come now: its pool runs are freed, its requests released
            released = self.stages.drop(peer.agent)
            # nor a release: pushes we readied for it and it never released (killed before it
            # polled, or gone mid-copy) are released now, once. It only ever READs what we
            # readied (our memory, opened or staged): nothing of it writes our blocks after
            # this, and a decode fails its requests before it hangs up (PrefillPeer.close).
            readied, peer.readied = peer.readied - released, set()
            for request in sorted(readied):
                log.info("push %s: decode %s left before releasing it; released", request,
                         peer.agent)
                self._release(peer.agent, request)

    def _handle(self, peer: _Peer, message: dict) -> None:
        kind = message["type"]
        layout = self.cache.layout
        if kind == messages.PUSH.type:
            self.pushes.start_write(peer, message)
        elif kind == messages.EXPECT.type:
            self.pushes.expect(peer, message)
        elif kind == messages.CANCEL.type:
            self.pushes.cancel(peer, frames.field(message, "request", str))
        elif kind == messages.SAMENODE.type:  # a decode asks to open our memory (samenode.py)
            # host-staged: what a same-node decode may read is our staging pool
            offer = serve_offer(self.staging.cache if self.staging else self.cache, self._token)
            peer.opened = "unavailable" not in offer
            if peer.opened and self.staging is None:  # ours to push from: readies by ring too
                peer.mailbox = peer.mailbox or Mailbox()
                offer.update(peer.mailbox.offer())
            peer.send(messages.SAMENODE.build(**{**offer, "request": message.get("request")}),
                      self.timeout)
        elif kind == messages.POOL.type:  # a direct decode asks where our pool is (coalesce.py)
            offer = coalescing.offer(self.pool if self.staging is None else None,
                                     "coalesce='never' on this prefill")
            peer.send(messages.POOL.build(**offer, request=message.get("request")),
                      self.timeout)
        elif kind == messages.STAGE.type:
            self.stages.stage(peer, message)
        elif kind == messages.UNSTAGE.type:
            self.stages.unstage(peer.agent, message)
        elif kind == messages.RELEASE.type:  # pulls, same-node copies done: blocks may be freed
            for request in frames.names_field(message, "requests"):
                self._release(peer.agent, request)
        elif kind == messages.DIGESTS.type:
            blocks = frames.ids_field(message, "blocks")
            make_plan(layout, blocks)  # validates the ids
            peer.send(messages.DIGESTS.build(request=message.get("request"),
                                             digests=self.cache.block_digests(blocks.tolist())),
                      self.timeout)
        else:  # a type of the catalog a decode does not send, or none of it
            raise KVRuntimeError(f"unknown request type {kind!r}")

    # -- pushes we start (prefill/pushes.py) ------------------------------------------------------
    def start_push(self, request: str, src_blocks, peer: str | None = None,
                   timeout: float = 30.0) -> None:
        """Push our ``src_blocks`` into the blocks a decode named for ``request``
        (``PrefillPeer.expect_push``): a WRITE with a NIXL notification that tells it they
        landed, or, to a same-node decode that opened our memory, their ids (a "ready" frame)
        for it to copy them itself, as a pull. Returns once the WRITE is posted (the ids
        sent). If no decode has named them yet, the push waits (at most ``timeout``) and is
        started when one does. ``peer``: the decode agent the request is for; None: whichever
        decode names ``request``.

        When the WRITE has ended, or the decode has copied them, or the push was dropped,
        ``get_released`` lists the request and our blocks may be reused (with agent ``""``
        for a push no decode ever named); so does the end of the decode's connection (closed,
        killed) before it said so: at once for a ready, once it has ended for a WRITE. A
        failed WRITE is the decode's to report (it gets a ``push_failed`` frame); a same-node
        copy that fails once started is released once it reads nothing any more, as a failed
        pull is; one that may still be reading them (a READ that could not be aborted) is
        not, until the decode's connection ends (it only reads our blocks). Raises
        ``KVRuntimeError`` for bad ids or a count other than the decode named (its request
        stays expected: push again), or a WRITE NIXL refuses (the decode is told); then
        nothing is released, the blocks are the caller's."""
        self.pushes.start_push(request, src_blocks, peer, timeout)

    def expects(self, request: str, peer: str | None = None) -> bool:
        """Whether a decode (agent ``peer``, or any) has named the blocks for ``request``: a
        ``start_push`` of it now is posted at once."""
        return self.pushes.expects(request, peer)

    def _release(self, agent: str, request: str) -> None:
        peer = self._peers.get(agent)
        if peer is not None:  # a push we readied for it ends here (its release, its unstage)
            peer.readied.discard(request)
        self.released.add(agent, request)

    def wait_released(self, request: str, timeout: float, peer: str | None = None) -> bool:
        """True once a decode said ``request``'s blocks may be freed (from the decode agent
        ``peer``, or any). Consumes the release, so a request id may be used again."""
        return self.released.wait(request, timeout, peer)

    def get_released(self) -> list[tuple[str, str]]:
        """Every (decode agent, request id) released since the last call: the blocks an
        engine's step loop may free now (vLLM's ``get_finished`` "done sending" set). A
        decode releases a request once nothing of it reads them: when its copy is done, and
        also when it failed but ended or was aborted (not when a READ it could not abort may
        still be reading)."""
        return self.released.take_all()

    @property
    def peers(self) -> list[str]:
        return list(self._peers)

    # -- shutdown ----------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._teardown.close()  # in the order the constructor gave (there)

    def _drop_peers(self) -> None:
        for peer in list(self._peers.values()):
            self._drop_peer(peer)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _loopback(host: str) -> bool:
    return host in ("127.0.0.1", "::1", "localhost") or host.startswith("127.")
