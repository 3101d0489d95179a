"""The prefill's pushes: WRITEs into a decode's cache, the ones it asks for and the ones we start.

A push the decode asks for (a "push" frame) is posted by the connection thread, which goes back
to reading. A push we start (``start_push``, as an engine does once a request's KV is computed)
goes into blocks the decode named beforehand (an "expect" frame), or to a same-node decode that
opened our memory as a "ready" with our ids for it to copy. A push started before its decode
named the blocks waits (an offer) until one does, or its deadline. Every WRITE carries a NIXL
notification, a "pushed" sealed with the session's key: that is the decode's answer when it
lands, with no frame or wake-up of ours on its way (protocol 13). ``progress`` (the server's
progress loop) polls the WRITEs: one that ended releases its request, one that failed is
answered by a ``push_failed`` frame.

A WRITE once posted cannot be stopped (UCX cancels no RMA, transfer.py): one still running at
its deadline, at a cancel, or when its decode leaves is polled until UCX ends it and only then
answered; a departed decode's WRITEs are kept (``drop``) and its agent removed once they end.
Every request whose blocks are free again goes to the server's ``release``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from ..errors import KVRuntimeError
from ..nixl.transfer import MAX_SPLIT, Draining, PostedTransfer, Rows
from ..numbers import check_seconds
from ..pace import Pace
from ..plan import Planner, make_plan
from ..tp import head_rows
from ..wire import frames, messages

log = logging.getLogger(__name__)

# Requests one decode may have announced (expect) and we not pushed yet.
MAX_EXPECTED = 65536
# A named request past its deadline is dropped this much later by the progress loop (the
# decode's own timer, and its cancel, come first); start_push never writes one past it.
EXPECTED_GRACE = 0.5


@dataclass
class _Write:
    peer: object  # the decode's connection (prefill/server.py)
    request: str
    xfer: PostedTransfer
    deadline: float  # monotonic: the decode's deadline, or our own timeout if sooner (a
    # WRITE past it runs on, as nothing stops a posted WRITE, and is answered when it ends)
    ours: bool = False  # we started it (start_push): released even when it fails


@dataclass
class _Expected:  # a decode's blocks for a request we will push (its "expect" frame)
    dst: object  # int64 ids, checked against its layout
    deadline: float  # monotonic: the decode's deadline
    number: int  # its frame's push number, which the WRITE's notification names
    copies: bool = False  # it copies them itself once we say "ready" (same-node, or pooled)


@dataclass
class _Offer:  # a push started before any decode expected it: posted when one does
    agent: str | None  # the decode it is for; None: whichever expects the request first
    src: object  # int64 ids, checked against our layout
    deadline: float  # monotonic
    posted: float  # wall clock of the start_push call (the decode times the push from it)


def push_number(message: dict) -> int:
    """A "push" or "expect" frame's number (messages.py), which its WRITE's notification
    names: a positive integer below 2**63."""
    return frames.integer(message, "number", 1, 1 << 63)


class Writes:
    """Our WRITEs in flight, each answered once UCX ends it, and those of departed decodes.

    ``release(agent, request)`` says a request's blocks are free; ``wake()`` wakes the progress
    loop; ``peers_lock`` is the server's, held while a decode's agent is added or removed."""

    def __init__(self, agent, registration, cache, *, timeout: float, release, wake,
                 peers_lock, warms):
        self.agent = agent
        self.warms = warms  # decodes' memory mapped at their connect (warm.py)
        self.registration = registration
        self.cache = cache
        self.timeout = timeout
        self.release = release
        self.wake = wake
        self._peers_lock = peers_lock
        self._writes: dict[tuple[str, str], _Write] = {}  # (decode agent, request) -> WRITE
        # guards the WRITEs, and also the pushes' expected requests and offers (Pushes)
        self.lock = threading.RLock()
        # WRITEs of decodes that left, still in flight (transfer.py), and the agents whose
        # removal waits for them (NIXL's rkeys of a WRITE in flight must outlive it)
        self._orphans = Draining()
        self._leaving: dict[str, int] = {}
        # how fast our WRITEs have ended: how long the progress loop spins on one (``spinning``)
        self._pace = Pace()
        self._spin_until = 0.0  # perf_counter

    @property
    def in_flight(self) -> int:
        """WRITEs posted and not yet answered."""
        return len(self._writes)

    def holds(self, agent: str, request: str) -> bool:
        return (agent, request) in self._writes

    @property
    def spinning(self) -> bool:
        """Whether the progress loop should poll without sleeping: a WRITE is in flight that
        should end soon, by how fast ours have (pace.Pace: 1.5x its expected time, at
        least 2 ms, at most 50). A sleep between polls ends ~50-250 µs late on the VMs, and
        a WRITE that the device runs is answered only once a poll sees it end."""
        return bool(self._writes) and time.perf_counter() < self._spin_until

    # -- a decode's connection --------------------------------------------------------------------
    def admit(self, agent: str) -> None:
        """A decode (re)connects as ``agent``: its previous connection's WRITEs are waited out
        first (at most the timeout), since its agent is removed once they end."""
        if agent in self._leaving:
            self._orphans.drain(self.timeout)
            if agent in self._leaving:
                raise KVRuntimeError(f"WRITEs of this agent's previous connection are still "
                                     f"in flight after {self.timeout:.1f}s; retry later")

    def drop(self, peer) -> None:
        """``peer`` left (under the server's peers lock): its WRITEs end before its agent and
        list go; one still in flight is kept until UCX ends it. A push of ours (start_push)
        is released once its WRITE has ended, here or then: no answer can reach the decode
        now, and the release is what gives our caller its blocks back."""
        running, ended = [], []  # running: (transfer, request of ours to release or None)
        with self.lock:
            for write in [w for w in self._writes.values() if w.peer is peer]:
                del self._writes[(peer.agent, write.request)]
                if not write.xfer.abort():
                    running.append((write.xfer, write.request if write.ours else None))
                elif write.ours:
                    ended.append(write.request)
        warm = self.warms.drop(peer)  # the READ or WRITE that maps its memory, if in flight
        if warm is not None:
            running.append((warm, None))
        for request in ended:  # nothing of ours is read by its WRITE any more
            self.release(peer.agent, request)
        if not running:
            self.registration.forget_peer(peer.agent)
            return
        log.warning("%d transfer(s) with departed %s still in flight; its agent goes once "
                    "they end", len(running), peer.agent)
        self._leaving[peer.agent] = len(running)
        for xfer, request in running:
            self._orphans.add(xfer, lambda agent=peer.agent, r=request: self._orphan_ended(
                agent, r))

    def _orphan_ended(self, agent: str, request: str | None = None) -> None:
        """A departed decode's WRITE, or mapping READ (warm.py), has ended (UCX completed it);
        ``request``: a push of ours, released now that its WRITE reads our blocks no more."""
        if request is not None:
            self.release(agent, request)
        with self._peers_lock:
            left = self._leaving[agent] - 1
            if left:
                self._leaving[agent] = left
                return
            del self._leaving[agent]
            self.registration.forget_peer(agent)

    def close(self) -> None:
        left = self._orphans.close(self.timeout)
        if left:  # released: the agent goes with them, and UCX's connections (transfer.py)
            log.error("closing with %d transfer(s) still in flight after %.1fs: dropped with "
                      "the NIXL agent", left, self.timeout)
        self.warms.close()

    # -- posting, polling, answering --------------------------------------------------------------
    def post(self, peer, request: str, number: int, plan, deadline: float, split: int = 1,
             posted: float | None = None) -> None:
        """Post a WRITE of ``plan`` into ``peer``'s cache and keep it in flight. Its NIXL
        notification is the decode's answer: a "pushed" naming the push's ``number`` (its
        frame's), with the descriptors it posts (mixed TP: a token row's heads each), and for
        a push we started (``posted``: the wall clock of its ``start_push``), when it
        started."""
        s, rows = peer.head_slice, None
        if s is not None:  # mixed TP, direct: the decode rank's heads of each token row
            src_ids, dst_ids = plan.block_ids()
            rows = Rows(head_rows(self.cache.layout, self.registration.region_triples(),
                                  src_ids, s.src),
                        head_rows(peer.info.layout, peer.info.regions, dst_ids, s.dst),
                        peer.agent, self.cache.mem_type, peer.info.mem_type)
        notify = messages.PUSHED.build(
            request=request, number=number, descriptors=len(rows.local) if rows is not None else
            plan.descriptor_count, **({} if posted is None else {"posted": posted}))
        notif = frames.encode_notif(notify, peer.info.session)
        with self.lock:
            if (peer.agent, request) in self._writes:
                raise KVRuntimeError(f"request {request!r} is already in flight")
            xfer = PostedTransfer(
                self.agent, "WRITE", plan=plan, local_dlist=self.registration.local_dlist,
                remote_dlist=self.registration.peer_dlist(peer.agent), rows=rows, notif=notif,
                split=split)
            self._writes[(peer.agent, request)] = _Write(peer, request, xfer, deadline,
                                                         posted is not None)
            self._spin_until = max(self._spin_until, xfer.start + self._pace.spin_seconds(
                "WRITE", xfer.nbytes))
        # a WRITE done as it was posted (host memory by cma, copied in the call) is answered
        # from here: waking the progress loop to see it cost ~50 µs a push on the 2-core host
        if self.progress():
            self.wake()

    def cancel(self, peer, request: str) -> bool:
        """A cancel of ``request``: False if no WRITE of it is in flight. A posted WRITE cannot
        be stopped, only answered once it ends (under ``lock``)."""
        write = self._writes.get((peer.agent, request))
        if write is None:
            return False
        state = write.xfer.poll()
        if state != "PROC":
            write.xfer.finish()
            self._end_write(write, None if state == "DONE" else
                            "the WRITE failed in NIXL (decode gone?)")
        return True

    def progress(self) -> bool:
        """One pass over the WRITEs in flight; True while any remain. One past its deadline
        runs on (nothing stops a posted WRITE) and is answered as it ends: the decode, which
        failed it at its deadline, counts its blocks as written until that answer."""
        if len(self._orphans):
            self._orphans.poll()
        with self.lock:
            for write in list(self._writes.values()):
                state = write.xfer.poll()
                if state == "DONE":
                    write.xfer.finish()
                    self._end_write(write, None)
                    # after the answer: the first WRITE's look at UCX's log is not the push's
                    self._check_lanes(write.peer)
                elif state == "ERR":
                    write.xfer.finish()
                    self._end_write(write, "the WRITE failed in NIXL (decode gone?)")
            return bool(self._writes) or bool(len(self._orphans))

    def _check_lanes(self, peer) -> None:
        """After a peer's first WRITE of device memory, or of any memory where this host has
        an ACTIVE RDMA port (the peer may be on another host): a lane on TCP is logged as an
        error (the decode's connect-time probe covers its READs; ucxlog.py)."""
        if peer.lanes_checked or ("VRAM" not in (self.cache.mem_type, peer.info.mem_type)
                                  and not self.agent.rdma_ports):
            return
        peer.lanes_checked = True
        try:
            self.agent.check_device_lanes(f"push to {peer.agent}", self.cache.mem_type == "VRAM",
                                          peer.info.mem_type == "VRAM")
        except KVRuntimeError as exc:
            log.error("%s", exc)

    def _end_write(self, write: "_Write", error: str | None) -> None:
        """A WRITE that ended well (error None: the decode has its notification, and the
        blocks may be freed) or in error (answered by frame); under _writes_lock."""
        del self._writes[(write.peer.agent, write.request)]
        if error is None:
            self._pace.seen("WRITE", write.xfer.nbytes, write.xfer.seconds)
            self.release(write.peer.agent, write.request)
            return
        # it ended in error (UCX completed it): nothing more of it lands
        reply = messages.PUSH_FAILED.build(request=write.request, error=error)
        if write.ours:  # nothing reads the caller's blocks now
            self.release(write.peer.agent, write.request)
        try:
            write.peer.send(reply, self.timeout)
        except KVRuntimeError as exc:
            log.warning("answering push %s of %s: %s", write.request, write.peer.agent, exc)


class Pushes:
    """The pushes of one prefill server: those a decode asks for, those we start into blocks
    a decode named, and those we started before any decode named them (offers).

    The server's connections are ``peers`` (agent -> connection); ``writes`` posts and answers
    the WRITEs, and its ``release``/``wake`` serve the pushes too."""

    def __init__(self, writes: Writes, stats, peers: dict, *, staged: bool, pooled: bool):
        self.writes = writes
        # the server's, as the WRITEs have them
        self.cache, self.timeout, self._release, self._wake = (
            writes.cache, writes.timeout, writes.release, writes.wake)
        self.stats = stats
        self.peers = peers
        self.staged = staged  # host-staged: nothing is pushed directly
        self.pooled = pooled  # a direct side's staging pool: a decode may pull pushes through it
        self._own = Planner(self.cache.layout)  # our ids alone (pushes' sources), made once
        # request -> a push waiting for its decode (under writes.lock, as the connections'
        # expected requests are)
        self._offers: dict[str, _Offer] = {}

    @property
    def waiting(self) -> bool:
        """Whether any push waits for its decode or any named request for its push (the
        progress loop then calls ``expire``)."""
        return bool(self._offers) or any(p.expected for p in list(self.peers.values()))

    # -- what decodes name ------------------------------------------------------------------------
    def _name(self, peer, request: str, expected: "_Expected") -> None:
        """Keep ``request``'s blocks (under _writes_lock), within the bounds: a decode
        names each of its blocks for one push at a time."""
        n = len(expected.dst)
        if len(peer.expected) >= MAX_EXPECTED:
            raise KVRuntimeError(f"{MAX_EXPECTED} requests are already expected from this "
                                 f"decode")
        if peer.expected_blocks + n > peer.info.layout.num_blocks:
            raise KVRuntimeError(f"{peer.expected_blocks} blocks are already named for pushes "
                                 f"not started; {n} more would be more than the decode's "
                                 f"{peer.info.layout.num_blocks}")
        peer.expected[request] = expected
        peer.expected_blocks += n

    def _unname(self, peer, request: str) -> "_Expected | None":
        expected = peer.expected.pop(request, None)
        if expected is not None:
            peer.expected_blocks -= len(expected.dst)
        return expected

    # -- pushes a decode asks for -----------------------------------------------------------------
    def start_write(self, peer, message: dict) -> None:
        """Post the WRITE a push asks for, unless its deadline has passed: a decode that gave
        up on the request may already have reused the blocks (a stalled prefill reads the
        request late). Its notification answers; the progress loop finishes it."""
        request = frames.field(message, "request", str)
        number = push_number(message)
        if "runs" in message:  # a few runs instead of many ids: planned from them, not again
            runs, src, dst = frames.runs_field(message, "runs"), None, None
        else:
            runs = None
            src, dst = frames.ids_field(message, "src"), frames.ids_field(message, "dst")
        timeout = frames.seconds(message, "timeout", positive=True)
        deadline = frames.seconds(message, "deadline")
        split = frames.integer(message, "split", 1, MAX_SPLIT + 1, default=1)
        left = deadline - time.time()
        if left <= 0:
            self.stats.late_pushes += 1
            log.warning("refusing push %s from %s: its deadline passed %.3fs ago", request,
                        peer.agent, -left)
            peer.send(messages.PUSH_FAILED.build(
                request=request, error=f"its deadline passed {-left:.3f}s before the prefill "
                                       f"read it; nothing was written"), self.timeout)
            return
        try:
            planner = peer.planner(self.cache.layout)
            plan = planner.plan(src, dst) if runs is None else planner.plan_runs(*runs)
            self.writes.post(peer, request, number, plan, time.monotonic() + min(left, timeout),
                             split)
        except KVRuntimeError as exc:
            peer.send(messages.PUSH_FAILED.build(request=request, error=str(exc)), self.timeout)

    # -- pushes we start: the decode said where the blocks go (expect), we say when ---------------
    def start_push(self, request: str, src_blocks, peer: str | None = None,
                   timeout: float = 30.0) -> None:
        """``PrefillServer.start_push`` (its docstring says what happens when)."""
        posted = time.time()
        if not isinstance(request, str) or not 0 < len(request) <= 256:
            raise KVRuntimeError("request must be a non-empty string of at most 256 chars")
        check_seconds("timeout", timeout)
        if self.staged:
            raise KVRuntimeError("a host-staged prefill pushes nothing directly: its decodes "
                                 "pull from the staging pool")
        with self.writes.lock:
            target = self._expected_by(request, peer)
            if target is not None and time.monotonic() > target[1].deadline:
                self._unname(target[0], request)  # the decode gave up: its blocks are not ours
                self._push_failed(target[0], request, "the prefill had not pushed it by its "
                                  "deadline", release=False)
                target = None
            if target is None:
                if peer is not None and peer not in self.peers:
                    raise KVRuntimeError(f"no decode agent {peer!r} is connected")
                if request in self._offers:
                    raise KVRuntimeError(f"request {request!r} is already waiting for its "
                                         f"decode")
                src = self._own.plan(src_blocks).block_ids()[0]  # checked now
                self._offers[request] = _Offer(peer, src, time.monotonic() + timeout, posted)
                self._wake()  # the progress loop expires it
                return
            dst_peer, expected = target
            # our ids' range and duplicates, and as many as the decode named
            plan = self._push_plan(dst_peer, src_blocks, expected)
            self._unname(dst_peer, request)
        deadline = min(expected.deadline, time.monotonic() + timeout)
        try:
            self._push_now(dst_peer, request, expected.number, plan, deadline, posted,
                           expected.copies)
        except KVRuntimeError as exc:  # raised: our blocks are the caller's, not released
            self._push_failed(dst_peer, request, str(exc), release=False)
            raise

    def expects(self, request: str, peer: str | None = None) -> bool:
        """Whether a decode (agent ``peer``, or any) has named the blocks for ``request``: a
        ``start_push`` of it now is posted at once."""
        with self.writes.lock:
            try:
                return self._expected_by(request, peer) is not None
            except KVRuntimeError:  # several decodes named it
                return True

    def _expected_by(self, request: str, agent: str | None):
        """(peer, _Expected) of the decode that named ``request``; under _writes_lock."""
        if agent is not None:
            peer = self.peers.get(agent)
            found = peer is not None and request in peer.expected
            return (peer, peer.expected[request]) if found else None
        named = [p for p in list(self.peers.values()) if request in p.expected]
        if len(named) > 1:
            raise KVRuntimeError(f"request {request!r} is named by {len(named)} decodes "
                                 f"({', '.join(p.agent for p in named[:3])}...): pass peer=")
        return (named[0], named[0].expected[request]) if named else None

    def _push_plan(self, peer, src_blocks, expected: "_Expected"):
        """Our ``src_blocks`` for the blocks a decode named: the plan of a WRITE into them, or,
        to a decode that copies them itself (and checks both sides again), our ids alone,
        checked against our cache and counted against its (the pair's plan took 65-119 µs of
        a 4096-block push's 160-230 on an H100 host, its destinations read the general way)."""
        if not expected.copies:
            return peer.planner(self.cache.layout).plan(src_blocks, expected.dst)
        plan = self._own.plan(src_blocks)
        if plan.num_blocks != len(expected.dst):
            raise KVRuntimeError(f"{plan.num_blocks} source blocks but the decode named "
                                 f"{len(expected.dst)}")
        return plan

    def _push_now(self, peer, request: str, number: int, plan, deadline: float, posted: float,
                  copies: bool) -> None:
        """Our blocks for ``request`` go to ``peer`` now: a same-node decode that asked to copy
        them (``copies``) gets their ids, as spans (first id, count) where those are fewer,
        and copies them itself, as a pull, releasing them once done; any other gets a WRITE
        whose notification tells it they landed."""
        if copies:
            if 2 * plan.num_runs < plan.num_blocks:
                ids = {"src_spans": frames.pack_spans(plan.run_src, plan.run_count)}
            else:
                ids = {"src": frames.pack_ids(plan.block_ids()[0])}
            message = messages.READY_IDS.build(request=request, posted=posted, **ids)
            # from here its release (or its connection's end: prefill._drop_peer) ends it
            peer.readied.add(request)
            try:
                if peer.mailbox is not None:  # it may read it there before the frame comes
                    message["ring"] = peer.mailbox.post(frames.encode_payload(message))
                peer.send(message, self.timeout)
            except KVRuntimeError:
                peer.readied.discard(request)  # our caller's blocks again: start_push raises
                raise
            return
        self.writes.post(peer, request, number, plan, deadline, 1, posted)

    def _push_failed(self, peer, request: str, error: str, release: bool) -> None:
        """A push of ours that will not be written: the decode hears why; ``release``: blocks
        of ours were given to it (start_push returned), and are free now."""
        if release:
            self._release(peer.agent, request)
        try:
            peer.send(messages.PUSH_FAILED.build(request=request, error=error), self.timeout)
        except KVRuntimeError as exc:
            log.warning("telling %s that push %s failed: %s", peer.agent, request, exc)

    def expect(self, peer, message: dict) -> None:
        """A decode names the blocks a request of ours goes into; posted at once when we have
        already started that push, else kept until ``start_push`` or its deadline."""
        request = frames.field(message, "request", str)
        dst = frames.ids_field(message, "dst")
        number = push_number(message)
        timeout = frames.seconds(message, "timeout", positive=True)
        left = frames.seconds(message, "deadline") - time.time()
        # the decode copies them itself once we say "ready": same-node, or through the pools
        # (it asks us to stage them, as a pull: stages.py)
        pooled = message.get("stage") is True
        copies = message.get("copy") is True or pooled
        taken = None  # a push of ours that waited for this decode: its blocks are ours to free
        try:
            if self.staged:
                raise KVRuntimeError("this prefill is host-staged: it pushes nothing directly")
            if pooled and not self.pooled:
                raise KVRuntimeError("it asks to pull the push through the staging pools but "
                                     "this prefill keeps none (coalesce='never')")
            if copies and not pooled and not peer.opened:
                raise KVRuntimeError("it asks to copy the push itself but has not opened this "
                                     "prefill's memory (same-node engine)")
            if left <= 0:
                self.stats.late_pushes += 1
                raise KVRuntimeError(f"its deadline passed {-left:.3f}s before the prefill read "
                                     f"it; nothing was written")
            make_plan(peer.info.layout, dst)  # its range and duplicates, before we keep it
            deadline = time.monotonic() + min(left, timeout)
            with self.writes.lock:
                if request in peer.expected or self.writes.holds(peer.agent, request):
                    raise KVRuntimeError(f"request {request!r} is already in flight")
                offer = self._offers.get(request)
                if offer is None or offer.agent not in (None, peer.agent):
                    self._name(peer, request, _Expected(dst, deadline, number, copies))
                    self._wake()  # the progress loop expires it
                    return
                taken = self._offers.pop(request)
            if len(taken.src) != len(dst):
                raise KVRuntimeError(f"{len(dst)} blocks named, but the prefill pushes "
                                     f"{len(taken.src)}")
            plan = self._push_plan(peer, taken.src, _Expected(dst, deadline, number, copies))
            self._push_now(peer, request, number, plan, min(deadline, taken.deadline),
                           taken.posted, copies)
        except KVRuntimeError as exc:
            self._push_failed(peer, request, str(exc), release=taken is not None)

    def expire(self) -> None:
        """Drop expectations and offers past their deadlines: the decode hears it (none of our
        blocks were promised to it yet); a push no decode named is released with agent ""
        (its blocks are ours again)."""
        now = time.monotonic()
        late = []
        with self.writes.lock:
            for peer in list(self.peers.values()):
                for request in [r for r, e in peer.expected.items()
                                if now > e.deadline + EXPECTED_GRACE]:
                    self._unname(peer, request)
                    late.append((peer, request))
            for request in [r for r, o in self._offers.items() if now > o.deadline]:
                offer = self._offers.pop(request)
                log.warning("push %s: no decode%s named its blocks before its deadline; "
                            "dropped", request, f" {offer.agent}" if offer.agent else "")
                self._release(offer.agent or "", request)
        for peer, request in late:
            self._push_failed(peer, request, "the prefill had not pushed it by its deadline",
                              release=False)

    def close(self) -> None:
        """The server closes: pushes no decode named are dropped and released with agent ""
        (their blocks are the caller's again; the progress loop that would expire them is
        stopped)."""
        with self.writes.lock:
            dropped, self._offers = sorted(self._offers), {}
        for request in dropped:
            log.info("push %s: the server closed before a decode named its blocks; released",
                     request)
            self._release("", request)

    def cancel(self, peer, request: str) -> None:
        with self.writes.lock:
            if self.writes.cancel(peer, request):
                return
            if self._unname(peer, request) is not None:  # named, not pushed yet
                peer.send(messages.CANCELLED.build(request=request, state="not pushed"),
                          self.timeout)
                return
        # Not in flight: it was refused, or finished and answered before this cancel (frames
        # of one connection are answered in order), so the decode already knows which.
        peer.send(messages.CANCELLED.build(request=request, state="not in flight"), self.timeout)
