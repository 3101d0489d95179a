"""The prefill's side of requests through its staging pool (host-staged, or coalesced NIXL):
a decode's "stage" is queued, gathered chunk by chunk into the pool, each chunk answered as soon
as it is there, and the run held until the decode's "unstage" (or, if it never comes, an expiry
well after the request's deadline). The decode's side is staged.py; the pools, staging.py."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from . import frames, messages
from .errors import KVRuntimeError
from .plan import check_range

log = logging.getLogger(__name__)
EXPIRED_KEPT_S = 600.0  # how long an expired request's late unstage is recognized


class Stages:
    """Staged requests of a prefill's decodes. ``pool``: the prefill's staging pool (None: it
    keeps none, and every stage is refused); ``release(agent, request)``: the request's blocks
    are free; ``wake()``: the progress loop's, since queued requests may fit now."""

    def __init__(self, pool, cache, timeout: float, release, wake):
        self.pool = pool
        self.cache = cache
        self.timeout = timeout
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
        deadline = float(frames.field(message, "deadline", (int, float)))
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
            units = len(src) * (heads[1] - heads[0])
            if units > self.pool.units:
                raise KVRuntimeError(f"a request of {units} units ({len(src)} blocks x "
                                     f"{heads[1] - heads[0]} heads) cannot fit a staging pool "
                                     f"of {self.pool.units} units (the prefill's: "
                                     f"{self.pool.numbers(units)})")
        except KVRuntimeError as exc:
            peer.send(messages.STAGE_FAILED.build(request=request, error=str(exc)), self.timeout)
            return
        with self._lock:
            self._queue.append((peer, request, piece, src, heads, time.monotonic() + left,
                                time.monotonic()))
        self.serve()

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
        started (pushes.py, "stage") gives its caller's blocks back that way. ``more``: a
        piece of a request larger than the pools, others to come (only its run is freed)."""
        request = frames.field(message, "request", str)
        more = message.get("more") is True
        key = (agent, request, _piece(message))
        with self._lock:
            if (agent, request) in self._expired:
                return  # freed and released when it expired
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
    value = message.get("piece", 0)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 31:
        raise KVRuntimeError(f"piece {str(value)[:40]!r} is not a piece number")
    return value
