"""The decode's side of a request through the staging pools (staging.py): a host-staged peer's,
or a direct NIXL peer's coalesced one (coalesce.py). The prefill gathers the run chunk by chunk
and answers each; each chunk is READ (one descriptor) into a run of our pool as its answer comes
and scattered into the cache as it lands."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from ..errors import KVRuntimeError
from ..jobs import CopyJob, TransferResult
from ..plan import TransferPlan
from ..pools.staging import StagingExhausted, StagingPool, done, wait
from ..wire import frames, messages


@dataclass(frozen=True)
class PoolRoute:
    """How a peer's requests go through the pools: ours, the peer's (its registered region, of
    its memory kind) and the engine name its results carry ("host_staged", or "nixl" for a
    coalesced transfer of a direct peer); ``reader``: host-staged on one host, the same-node
    engine whose reader threads READ the prefill's pool (None: NIXL)."""

    pool: StagingPool
    remote: tuple[int, int, int]  # the peer's pool: (address, bytes, device id)
    remote_mem: str
    remote_units: int
    engine: str
    reader: object = None
    label: str = "coalesced"  # how its copies' errors name it: "host_staged", "coalesced"


@dataclass
class _Chunk:
    rows: tuple[int, int]  # rows of the run (staging.py: row r * n + b)
    xfer: object  # PostedTransfer, or the same-node engine's read
    event: object = None  # its scatter's (a device event, a host scatter's future)
    scattered: bool = False


class StagedPull(CopyJob):
    """Decode side of one request through the pools, polled like a PostedTransfer (see module
    doc): the prefill gathers the run chunk by chunk and answers each ("staged" with its
    rows); each chunk is READ as its answer comes and scattered as it lands, so the gather
    of one, the READ of the next and the scatter of the one before run side by side."""

    # its end says nothing more: the request's "unstage" (sent by its cleanup, done or
    # failed) frees the prefill's pool blocks and releases the request
    tells_prefill = False

    def __init__(self, peer, plan: TransferPlan, request_id: str, *, deadline_wall: float,
                 route: PoolRoute):
        super().__init__("READ", plan)
        self.peer = peer
        self.route = route
        # what moves it, as its errors name it (jobs.Job): the READs of the prefill's pool runs,
        # by NIXL or the route's reader; its result names route.engine (PoolRoute)
        reader = "NIXL" if route.reader is None else route.reader.name
        self.engine = f"{route.label} {reader} READ"
        tp = peer.head_slice  # which of the prefill's heads, to which of ours
        self._src_heads = tp.src if tp else None
        self._dst_heads = tp.dst if tp else None
        self._hs = tp.count if tp else peer.client.cache.layout.num_kv_heads
        self.request_id = request_id
        self._deadline_wall = deadline_wall
        self._unstaged = False
        self._src_ids, self._dst_ids = plan.block_ids()
        self._pieces = pieces(plan.num_blocks, self._hs, route, request_id)
        self._piece = 0
        self._descriptors = 0  # chunks READ by the pieces before this one
        # the next piece asked for once this one's READs have all ended (the prefill's run is
        # free then: it gathers the next while we scatter this one), its answers kept until
        # this one has landed
        self._asked_next = False
        self._next_answers: list[dict] = []
        self._queued: dict[int, str] = {}  # piece -> the prefill's pool, as it queued its stage
        self._begin()

    def _begin(self) -> None:
        """Start piece ``self._piece``: its blocks, rows, and the "stage" that asks for it
        (its number only when there are several: a request of one piece is what it was)."""
        lo, hi = self._pieces[self._piece]
        self._units = (hi - lo) * self._hs
        self._rows = 2 * self.peer.client.cache.layout.num_layers * (hi - lo)
        # what it waits for, for the deadline's error: the prefill's run, then our pool blocks
        self.waiting = self._why_unstaged(self.route.pool)
        self._remote: tuple[int, int] | None = None
        self._local: int | None = None
        self._ready: list[tuple[int, int]] = []  # row ranges the prefill has gathered
        self._chunks: list[_Chunk] = []
        # the destination ids on a device pool's device, once for the chunks' scatters:
        # uploaded once the first READ is posted, not before the stage frame goes out,
        # where its 100-150 µs (2 x H100) delayed every piece's first answer
        self._dst_blocks = self._dst_ids[lo:hi]
        self._dst = None
        self._message = self._stage(self._piece)

    def _stage(self, piece: int) -> dict:
        """The "stage" that asks for piece ``piece``."""
        lo, hi = self._pieces[piece]
        return messages.STAGE.build(
            request=self.request_id, src=frames.pack_ids(self._src_ids[lo:hi]),
            deadline=self._deadline_wall, **self._piece_field(piece),
            **({} if self._src_heads is None else {"heads": list(self._src_heads)}))

    def _piece_field(self, piece: int | None = None) -> dict:
        if len(self._pieces) == 1:
            return {}
        return {"piece": self._piece if piece is None else piece}

    @property
    def _answering(self) -> int:
        """The piece the prefill's answers are for now: this one, or the next once asked for
        (this one's answers have all come by then)."""
        return self._piece + self._asked_next

    @property
    def last_piece(self) -> bool:
        """No piece of the request comes after the one answered now (its answers then end)."""
        return self._answering + 1 == len(self._pieces)

    @property
    def units(self) -> int:
        """Pool units a piece of the request takes (a block's heads of ours, each one unit)."""
        return self._units

    def send(self) -> None:
        """Ask the prefill to stage (once the handle holds this job: another thread's poll may
        hand it the answer at once)."""
        self.peer.send(self._message)

    def _ask_next(self) -> None:
        """Every READ of this piece has ended: the prefill's run of it is free (its "unstage"
        says more come: the request is not released) and the next piece is asked for now,
        while this one's last scatters run (2 x H100, 1 GiB through 256 MiB pools: the wire
        idled ~1.25 ms between pieces, ~0.4 of it this piece's last scatter and its end)."""
        self._asked_next = True
        self.peer.send(messages.UNSTAGE.build(request=self.request_id, more=True,
                                              **self._piece_field()))
        self.peer.send(self._stage(self._piece + 1))

    def _next_piece(self) -> None:
        """This piece has landed: our units of it are free, and the next one (asked for
        already) becomes this one, with the answers that came for it meanwhile."""
        self.route.pool.release(self._local, self._remote[1])
        self._local = None
        self._descriptors += len(self._chunks)
        self._piece += 1
        self._asked_next = False
        self._begin()
        early, self._next_answers = self._next_answers, []
        for message in early:
            self.on_reply(message)

    def on_reply(self, message: dict) -> None:
        if self.state != "PROC":
            return
        if messages.STAGE_QUEUED.is_(message):
            piece, pool = message.get("piece", 0), message.get("pool")
            if isinstance(piece, int) and isinstance(pool, str) and len(self._queued) < len(
                    self._pieces) and 0 <= piece < len(self._pieces):
                self._queued[piece] = pool[:300]
            return
        if message.get("type") != "staged":
            self._fail(f"the prefill could not stage it: {message.get('error')}")
            return
        if self._asked_next:  # the next piece's: kept until this one has landed
            if len(self._next_answers) >= self._rows + 1:  # more than any run's chunks
                self._fail("the prefill answered the next piece with more chunks than rows")
                return
            self._next_answers.append(message)
            return
        start, count, rows = message.get("start"), message.get("count"), message.get("rows")
        at = self._ready[-1][1] if self._ready else 0
        if not (isinstance(start, int) and isinstance(count, int) and count == self._units
                and start >= 0 and start + count <= self.route.remote_units
                and self._remote in (None, (start, count))
                and isinstance(rows, list) and len(rows) == 2
                and all(isinstance(r, int) and not isinstance(r, bool) for r in rows)
                and rows[0] == at and at < rows[1] <= self._rows):
            self._fail(f"the prefill answered with a malformed staged run ({count!r} units at "
                       f"{start!r}, rows {str(rows)[:40]}; {self._units} units, rows from {at} "
                       f"of {self._rows} expected)")
            return
        self._remote = (start, count)
        self._ready.append((rows[0], rows[1]))

    def poll(self) -> str:
        if self.state != "PROC":
            return self.state
        pool = self.route.pool
        if self._remote is None:  # the prefill has not staged it: why, as far as we know
            self.waiting = self._why_unstaged(pool)
        if self._remote is not None and self._local is None:
            self._local = pool.try_acquire(self._remote[1])
            if self._local is None:
                self.waiting = ("the decode's staging pool is exhausted: "
                                f"{pool.numbers(self._units)}")
                return self.state  # waits for pool blocks until the handle's deadline
            self.waiting = "its READ of the staged run had not ended (peer dead or stalled)"
        if self._local is not None and len(self._chunks) < len(self._ready):
            try:
                for rows in self._ready[len(self._chunks):]:
                    self._chunks.append(_Chunk(rows, read_rows(
                        self.peer, self.route, self.plan, (self._local, self._remote[0]),
                        self._hs, rows)))
            except KVRuntimeError as exc:
                self._fail(str(exc))
                return self.state
            if self._dst is None:  # while the first READ runs
                self._dst = pool.ids(self._dst_blocks)
        for chunk in self._chunks:
            if chunk.scattered:
                continue
            st = chunk.xfer.poll()
            if st == "DONE" and self.peer.channel.hung_up():
                # the prefill frees a run only after it hangs up (prefill/server.py): what
                # this READ read may be another request's, gathered into the run since
                chunk.xfer.finish()
                self._fail("the prefill hung up before this READ's end was seen: the run it "
                           "read may have been reused; not scattered")
                return self.state
            if st == "DONE":  # its rows land while the next chunks are still read
                chunk.xfer.finish()
                chunk.event = pool.scatter_async(self._local, self._dst, self._dst_heads,
                                                 chunk.rows)
                chunk.scattered = True
            elif st == "ERR":
                chunk.xfer.finish()
                self._fail(f"the READ of the staged blocks failed (prefill gone?): "
                           f"{getattr(chunk.xfer, 'error', None) or 'NIXL state ERR'}")
                return self.state
        if (not self._asked_next and self._piece + 1 < len(self._pieces) and self._chunks
                and self._chunks[-1].rows[1] == self._rows
                and all(c.scattered for c in self._chunks)):
            try:
                self._ask_next()
            except KVRuntimeError as exc:
                self._fail(str(exc))
                return self.state
        if (self._chunks and self._chunks[-1].rows[1] == self._rows
                and all(c.scattered and done(c.event) for c in self._chunks)):
            for chunk in self._chunks:
                try:
                    wait(chunk.event)  # a host scatter's error is raised here
                except Exception as exc:
                    self._fail(f"scattering the staged blocks failed: {exc}")
                    return self.state
            if self._piece + 1 < len(self._pieces):
                try:
                    self._next_piece()
                except KVRuntimeError as exc:
                    self._fail(str(exc))
                return self.state
            self._done("DONE")
        return self.state

    def _why_unstaged(self, pool) -> str:
        """What a piece the prefill has not staged waits for: the prefill's pool, with its
        numbers once it said it queued the stage; ours too when it could not take the run."""
        why = self._queued.get(self._piece) or ("the prefill had not staged it (its pool busy, "
                                                "or it stalled or died)")
        if pool.largest_free_run() < self._units:
            why += f"; the decode's staging pool is exhausted too: {pool.numbers(self._units)}"
        return why

    def block(self, seconds: float) -> None:
        """Sleep until something this request waits for may have happened, at most
        ``seconds`` (``TransferHandle.wait`` calls it instead of spinning: on a host of few
        cores a spinning waiter takes the core the prefill's gather or our scatter needs).
        A READ in flight is polled (its completion is NIXL's to report); otherwise the next
        frame of the prefill, or the first scatter still running, ends the sleep."""
        if any(not c.scattered for c in self._chunks):
            os.sched_yield()  # polled again at once, the core offered to the others first
            return
        running = [c.event for c in self._chunks if c.event is not None and not done(c.event)]
        if running and self._ready and self._ready[-1][1] == self._rows:
            # every chunk is here: only the scatters are left
            if hasattr(running[0], "result"):  # a host scatter's thread: woken as it ends
                from concurrent.futures import wait as wait_futures

                wait_futures(running[:1], timeout=seconds)
            else:  # a device's: polled (a nap would outlast a device scatter's ~0.1 ms)
                os.sched_yield()
            return
        self.peer.await_frame(seconds)

    def _fail(self, why: str) -> None:
        self.error = why
        self._done("ERR")

    def _done(self, state: str) -> None:
        self.state = state
        self.end = time.perf_counter()
        self._cleanup()

    def _cleanup(self) -> None:
        """Stop what has ended, then free our pool blocks and tell the prefill to free its
        own. A READ still in flight (a posted READ cannot be stopped, transfer.py) keeps our
        pool blocks taken until it ends (the client drains it): it may still write into them.
        The cache's blocks are ours alone to write (the scatter): one not started yet never
        starts, one running is waited for here, before the request is reported."""
        reading = [c.xfer for c in self._chunks if not c.scattered and not c.xfer.released]
        running = [xfer for xfer in reading if not xfer.abort()]
        for chunk in self._chunks:
            event = chunk.event
            if event is not None and hasattr(event, "cancel"):
                event.cancel()  # queued, not started: it never runs
            try:
                wait(event)  # a scatter still running (the pool's stream or thread only)
            except Exception:  # cancelled, or failed: either way it writes nothing more
                pass
        if self._local is not None:
            local, units, pool = self._local, self._remote[1], self.route.pool
            self._local = None
            free_once_read(pool, local, units, running, self.peer.client.draining,
                           self.peer.agent)
        if not self._unstaged and not self.peer.broken:  # gone: the prefill frees ours
            self._unstaged = True
            try:
                # the piece the prefill holds or gathers now: the last it is told of
                self.peer.send(messages.UNSTAGE.build(
                    request=self.request_id, **self._piece_field(self._answering)))
            except KVRuntimeError:
                pass  # the connection is gone: the prefill frees everything of ours

    def abort(self) -> bool:
        """True: the cache's blocks are written only by our scatter, which stops here (a READ
        still running lands in our pool blocks, kept taken until it ends)."""
        if self.state != "PROC":
            return True
        self.state = "ERR"
        self._cleanup()
        return True

    def result(self):
        nbytes = self.plan.num_blocks * self._hs * self.route.pool.layout.block_bytes
        return TransferResult("READ", nbytes, self.seconds, self.plan.num_runs,  # our heads
                              self._descriptors + len(self._chunks), None,
                              engine=self.route.engine)


def read_rows(peer, route: PoolRoute, plan: TransferPlan, units: tuple[int, int], hs: int,
              rows: tuple[int, int]):
    """READ rows ``rows`` of the prefill's run at unit ``units[1]`` of its pool into the same
    rows of ours at ``units[0]`` (runs of ``hs`` heads): one range (the run is region-major,
    rows are contiguous), one descriptor; the same-node engine's reader threads on one host."""
    import numpy as np

    from ..nixl.transfer import PostedTransfer, Rows

    unit, row = route.pool.layout.block_bytes, route.pool.row_bytes(hs)
    off, length = rows[0] * row, (rows[1] - rows[0]) * row
    local = route.pool.cache.regions[0]
    local_at = local.address + units[0] * unit + off
    remote_at = route.remote[0] + units[1] * unit + off
    engine = route.reader  # same host: our reader threads instead of NIXL
    if engine is not None:
        return engine.read("READ", plan, np.array([local_at], dtype=np.uint64),
                           np.array([remote_at], dtype=np.uint64),
                           np.array([length], dtype=np.uint64))
    rows_ = Rows(np.array([[local_at, length, local.device_id]], dtype=np.uint64),
                 np.array([[remote_at, length, route.remote[2]]], dtype=np.uint64),
                 peer.agent, local.mem_type, route.remote_mem)
    return PostedTransfer(peer.client.agent, "READ", plan=plan, rows=rows_)


def free_once_read(pool, start: int, units: int, running: list, draining, owner: str) -> None:
    """Free ``units`` units of ``pool`` at ``start`` now, or, while READs into them are still
    in flight (``running``, held by ``draining`` with their ``owner``), once the last ends."""
    if not running:
        pool.release(start, units)
        return
    left = [len(running)]

    def ended():  # the last READ into them has ended: the units are free again
        left[0] -= 1
        if not left[0]:
            pool.release(start, units)

    for xfer in running:
        draining.add(xfer, ended, owner)


def pieces(blocks: int, heads: int, route: PoolRoute, request_id: str) -> list[tuple[int, int]]:
    """The block ranges a request of ``blocks`` blocks (``heads`` units each) moves in: one,
    or, larger than either side's pool, pieces as large as both pools hold, one after
    another. A pool that cannot hold one block's heads can never serve it: refused now."""
    fits = min(route.pool.units, route.remote_units)
    per = fits // heads
    if per < 1:
        raise StagingExhausted(f"request {request_id} can never fit the staging pools: a "
                               f"block is {heads} units, the decode's pool holds "
                               f"{route.pool.units}, the prefill's {route.remote_units}; size "
                               f"the pools (staging_blocks) for at least one block")
    return [(lo, min(blocks, lo + per)) for lo in range(0, blocks, per)]
