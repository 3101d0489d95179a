"""The prefill's side of requests through its staging pool (host-staged, or coalesced NIXL):
a decode's "stage" is queued, gathered chunk by chunk into the pool, each chunk answered as soon
as it is there, and the run held until the decode's "unstage" (or, if it never comes, the end of
the decode's connection, or an expiry well after the request's deadline, which is capped at
``max_seconds`` from the stage's arrival). The decode's side is staged.py; the pools, staging.py."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from ..errors import KVRuntimeError
from ..plan import check_range
from ..wire import frames, messages

log = logging.getLogger(__name__)
EXPIRED_KEPT_S = 600.0  # how long an expired request's late unstage is recognized
# How far ahead of its arrival a stage's deadline may lie (PrefillServer's max_stage_seconds):
# a run is held until the unstage or the deadline's expiry, so a decode naming a deadline
# 10^7 s ahead would otherwise keep the units of a run it never unstages for good.
MAX_STAGE_SECONDS = 300.0


class Stages:
    """Staged requests of a prefill's decodes. ``pool``: the prefill's staging pool (None: it
    keeps none, and every stage is refused); ``release(agent, request)``: the request's blocks
    are free; ``wake()``: the progress loop's, since queued requests may fit now;
    ``max_seconds``: how far ahead a stage's deadline is taken (a later one is capped).

    One run a (decode, request, piece): a second stage of one queued, gathered or held is
    refused (a stage_failed that says so), never let replace the first: the first's run may
    still be READ by the decode, and a replaced record was a run nothing would ever free."""

    def __init__(self, pool, cache, *, timeout: float, release, wake,
                 max_seconds: float = MAX_STAGE_SECONDS):
        self.pool = pool
        self.cache = cache
        self.timeout = timeout
        self.max_seconds = max_seconds
        self._release = release
        self._wake = wake
        # (agent, request, piece) -> (start, n, expiry); a request larger than the pools
        # comes in pieces, one after another (staged.py)
        self._staged: dict[tuple[str, str, int], tuple[int, int, float]] = {}
        self._queue: deque = deque()  # (peer, request, piece, ids, heads, deadline, queued at)
        # pieces being gathered now, and those of them unstaged meanwhile (freed, and the
        # request released, once the gather has stopped reading the blocks)
        self._gathering: set = set()
        self._early: dict = {}  # -> its unstage's "more"
        # requests released by expiry, (agent, request) -> when: a late unstage releases
        # nothing more (their blocks may be the caller's again by then)
        self._expired: dict = {}
        # requests between pieces (a piece unstaged with "more", the next not staged yet):
        # (agent, request), released if the decode's connection ends before the next comes
        self._between: set = set()
        self._lock = threading.Lock()

    @property
    def queued(self) -> bool:
        """Requests wait for pool blocks."""
        return bool(self._queue)

    @property
    def held(self) -> bool:
        """Runs are held for decodes that have not unstaged them yet."""
        return bool(self._staged)

    def stage(self, peer, message: dict) -> None:
        """Queue a request's gather into pool blocks; the progress loop (or this call, when
        blocks are free) serves the queue in order. Nothing here waits: the connection thread
        must go on reading, since the unstage frames that free blocks come through it."""
        request = frames.field(message, "request", str)
        src = frames.ids_field(message, "src")
        deadline = frames.seconds(message, "deadline")
        piece = _piece(message)
        try:
            if self.pool is None:
                raise KVRuntimeError("this prefill has no staging pool (coalesce='never')")
            if not len(src):
                raise KVRuntimeError("a stage must name at least one block")
            # what keeps the gather's reads inside our cache; no plan (its runs are the
            # decode's business, and a block read twice harms nothing here): 68 us of a 1 GiB
            # request's critical path on the H100 VM, the range check ~10
            check_range("source", src, self.cache.layout.num_blocks)
            heads = _heads(message.get("heads"), self.cache.layout.num_kv_heads)
            left = deadline - time.time()
            if left <= 0:
                raise KVRuntimeError(f"its deadline passed {-left:.3f}s before it was read")
            left = min(left, self.max_seconds)  # held no longer than our cap, whatever it says
            units = len(src) * (heads[1] - heads[0])
            if units > self.pool.units:
                raise KVRuntimeError(f"a request of {units} units ({len(src)} blocks x "
                                     f"{heads[1] - heads[0]} heads) cannot fit a staging pool "
                                     f"of {self.pool.units} units (the prefill's: "
                                     f"{self.pool.numbers(units)})")
            key = (peer.agent, request, piece)
            with self._lock:
                if (key in self._staged or key in self._gathering
                        or any((e[0].agent, e[1], e[2]) == key for e in self._queue)):
                    raise KVRuntimeError(f"request {request!r} (piece {piece}) is already "
                                         f"staged: one run a request piece, until its unstage")
                self._between.discard(key[:2])
                self._queue.append((peer, request, piece, src, heads, time.monotonic() + left,
                                    time.monotonic()))
        except KVRuntimeError as exc:
            peer.send(messages.STAGE_FAILED.build(request=request, error=str(exc)), self.timeout)
            return
        self.serve()
        with self._lock:  # not served at once: the decode hears of our pool's numbers now
            queued = any((e[0].agent, e[1], e[2]) == key for e in self._queue)
        if queued:
            peer.send(messages.STAGE_QUEUED.build(
                request=request, pool=f"the prefill's staging pool is exhausted: "
                                      f"{self.pool.numbers(units)}",
                **({"piece": piece} if "piece" in message else {})), self.timeout)

    def serve(self) -> None:
        """Gather queued requests, in order, while pool blocks are free; fail those whose
        deadline passed while they waited, with the numbers."""
        while True:
            with self._lock:
                if not self._queue:
                    return
                peer, request, piece, src, heads, deadline, queued = self._queue[0]
                n = len(src) * (heads[1] - heads[0])
                if time.monotonic() > deadline:
                    self._queue.popleft()
                    start, reply = None, messages.STAGE_FAILED.build(
                        request=request,
                        error=f"the prefill's staging pool is exhausted: "
                              f"{self.pool.numbers(n)}; waited "
                              f"{time.monotonic() - queued:.3f}s until the request's deadline")
                else:
                    start = self.pool.try_acquire(n)
                    if start is None:
                        return  # the head waits for blocks (FIFO: no starving large requests)
                    self._queue.popleft()
                    self._gathering.add((peer.agent, request, piece))
                    reply = None
            if reply is None:
                self._gather_answering(peer, (request, piece), src, heads, start, n,
                                       deadline)
                continue
            try:
                peer.send(reply, self.timeout)
            except KVRuntimeError as exc:
                log.warning("answering stage %s of %s: %s", request, peer.agent, exc)

    def _gather_answering(self, peer, which: tuple[str, int], src, heads, start: int, n: int,
                          deadline: float) -> None:
        """Gather a request's run chunk by chunk (staging.StagingPool.chunks), answering each
        ("staged" with its rows) as soon as it is in the pool: the decode READs one chunk while
        the next is gathered."""
        request = which[0]
        key = (peer.agent, *which)
        try:
            self._gather_chunks(peer, key, src, heads, start, n, deadline)
        finally:
            with self._lock:
                self._gathering.discard(key)
                early = self._early.pop(key, None)  # its unstage's "more", if one came
                held = self._staged.pop(key, None) if early is not None else None
            if early is not None:  # unstaged while we gathered: freed now it has stopped
                if held is not None:
                    self.pool.release(held[0], held[1])
                if not early:  # no more pieces come: the request is done
                    self._release(peer.agent, request)
                self._wake()

    def _gather_chunks(self, peer, key: tuple[str, str, int], src, heads, start: int, n: int,
                       deadline: float) -> None:
        request = key[1]
        pool = self.pool
        ids = pool.ids(src)  # a device pool's: uploaded once for every chunk
        chunks = pool.chunks(len(ids), heads[1] - heads[0])
        gathered = pool.gathers(ids, start, heads, chunks)  # each chunk's rows, once in the pool
        try:
            for i in range(len(chunks)):
                last = i == len(chunks) - 1
                try:
                    rows = next(gathered)
                except Exception as exc:
                    gathered.close()  # the copies still queued end first
                    pool.release(start, n)  # READs of its answered chunks fail the request there
                    reply = messages.STAGE_FAILED.build(request=request,
                                                        error=f"gather failed: {exc}")
                else:
                    reply = messages.STAGED.build(request=request, start=start, count=n,
                                                  rows=list(rows), last=last)
                    if last:
                        # freed by unstage; or, if the decode never says, well after its deadline
                        # (its READs have been aborted by then). Kept only now: an unstage read by
                        # the connection thread while the progress loop gathers must not free the
                        # run under the gather (it is then freed at that expiry).
                        self._staged[key] = (start, n, deadline + 5.0)
                try:
                    peer.send(reply, self.timeout)
                except KVRuntimeError as exc:
                    log.warning("answering stage %s of %s: %s", request, peer.agent, exc)
                    if messages.STAGED.is_(reply):  # its READs may run on: freed at the expiry
                        self._staged[key] = (start, n, deadline + 5.0)
                    return
                if messages.STAGE_FAILED.is_(reply):
                    return
        finally:
            gathered.close()  # every way out: the copies still queued end first

    def unstage(self, agent: str, message: dict) -> None:
        """The decode is done with a request (its last chunk scattered, or it failed): its run
        is freed and the request released — at once, or, while it is being gathered, once
        the gather stops reading its blocks; one still queued is dropped. Every request a
        decode stages ends in one release, a refused or failed one too: a push the prefill
        started (prefill/pushes.py, "stage") gives its caller's blocks back that way. ``more``: a
        piece of a request larger than the pools, others to come (only its run is freed)."""
        request = frames.field(message, "request", str)
        more = message.get("more") is True
        key = (agent, request, _piece(message))
        with self._lock:
            if (agent, request) in self._expired:
                return  # freed and released when it expired
            if more:
                self._between.add(key[:2])
            else:
                self._between.discard(key[:2])
            staged = self._staged.pop(key, None)
            if staged is None and key in self._gathering:
                self._early[key] = more
                return
            if staged is None:
                for entry in [e for e in self._queue if (e[0].agent, e[1], e[2]) == key]:
                    self._queue.remove(entry)
        if staged is not None:
            self.pool.release(staged[0], staged[1])
        if not more:
            self._release(agent, request)
        self._wake()  # queued requests may fit now

    def drop(self, agent: str) -> set:
        """Decode ``agent``'s connection ended: no unstage of it can come now. Its held runs
        are freed and its queued stages dropped now, a run being gathered once the gather
        stops (as an early unstage); each of its requests is released once. Returns the
        requests released (now, or by the gather's end).

        Why freeing now is safe for us: a decode only ever READs our pool (one-sided, from
        its side); a READ it still has in flight writes nothing of ours, and reads bytes that
        a peer which passed the handshake could read anyway (our NIXL metadata gives it the
        whole registered pool). Its own requests are guarded on its side: a decode fails its
        peer's requests before it hangs up (PrefillPeer.close); when we drop a live one we hang
        up first (server.py), and a READ whose end it sees after the hang-up is not scattered
        (staged.py), so a run we reuse never lands in its cache; a READ lands only in its own
        pool, no scatter follows a failure, and a killed decode reads nothing. Our gathers,
        the only writers, are waited out (the early path)."""
        with self._lock:
            queued = [e for e in self._queue if e[0].agent == agent]
            for entry in queued:
                self._queue.remove(entry)
            gathering = {k for k in self._gathering if k[0] == agent}
            for key in gathering:
                self._early[key] = False  # freed, and the request released, by its gather
            held = [(k, self._staged.pop(k)) for k in list(self._staged)
                    if k[0] == agent and k not in gathering]
            between = {k for k in self._between if k[0] == agent}
            self._between -= between
        later = {k[1] for k in gathering}
        now = ({e[1] for e in queued} | {k[1] for k, _ in held} | {k[1] for k in between}) - later
        for _key, (start, n, _expiry) in held:
            self.pool.release(start, n)
        for request in sorted(now):
            self._release(agent, request)
        if held or queued:
            log.info("decode %s left: %d staged run(s) freed, %d queued stage(s) dropped",
                     agent, len(held), len(queued))
            self._wake()  # queued requests may fit now
        return now | later

    def expire(self) -> None:
        """Runs whose decode never unstaged them (it died, or lost its connection), well after
        their deadline (its READs have been aborted by then): freed, and the request released
        like an unstaged one, so a push the prefill started gives its caller's blocks back."""
        now = time.monotonic()
        expired = []
        with self._lock:
            for key, (start, n, expiry) in list(self._staged.items()):
                if now > expiry:
                    del self._staged[key]
                    expired.append((key, start, n))
                    self._expired[key[:2]] = now
                    self._between.discard(key[:2])
            for old in [k for k, at in self._expired.items() if now - at > EXPIRED_KEPT_S]:
                del self._expired[old]
        for (agent, request, _piece_), start, n in expired:
            log.warning("staged request %s of %s was never unstaged; its pool blocks are freed "
                        "and the request released", request, agent)
            self.pool.release(start, n)
            self._release(agent, request)
        if expired:
            self._wake()  # queued requests may fit now


def _heads(value, num_heads: int) -> tuple[int, int]:
    """A stage request's head range (local to this rank), checked; all heads when absent."""
    if value is None:
        return (0, num_heads)
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            or not 0 <= value[0] < value[1] <= num_heads):
        raise KVRuntimeError(f"stage heads {value!r} is not a range within 0..{num_heads}")
    return (value[0], value[1])


def _piece(message: dict) -> int:
    """A stage or unstage's piece of its request (0 when absent), checked."""
    return frames.integer(message, "piece", 0, 1 << 31, default=0)
