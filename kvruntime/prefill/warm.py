"""A decode's memory mapped by our UCX at its connect, so that our first WRITE into it costs
what the later ones do: small READs of its cache's regions into a scratch of ours, then a small
WRITE into the scratch it named in its handshake and a "warm" notification, posted and polled by
the progress loop while the decode is still choosing its engine.

UCX maps a peer's memory at the first transfer that touches it, inside the call that posts it:
over CUDA IPC the peer's handle is opened there (2 x H200: the first 64 MiB push's WRITE took
2.2 ms to post, later ones 80 µs; the decode's own connect-time probe READ pays the same for
its pulls, engines/choice.py). A READ is the one transfer that may touch a decode's memory
before it asks for anything: it writes only our scratch. Each READ maps up to ``BATCH``
regions, one READ a progress pass, so that other NIXL calls interleave with a cache of many
regions. A READ that fails is logged, never fatal: the first push pays the mapping then.
A decode that leaves with one in flight has it kept until UCX ends it (pushes.Writes.drop),
its agent removed only then, as for its WRITEs.

The READs open the decode's memory. A first push still paid more after them (2 x H200, 64 MiB,
by the timeline: our plan of its blocks ~250 µs, the WRITE's post and first poll ~900 µs more
than a later push's), and a READ is not a put: UCX chooses its protocol per operation, memory
kind and device the first time one is made. A READ's few bytes cannot be written back (the
decode may be writing that block meanwhile), so a direct decode registers a scratch of its own
cache's memory kind and device (engines/choice.LaneProbe) and names it in its info; after the
READs we WRITE a few bytes of ours into it, and make our plan of its blocks
(``peer.planner``). Measured on 2 x H200 (64 MiB, a push after a pull, two runs each, the READs
alone before): the first push 1406-1423 µs -> 1143-1173 µs; what it pays beyond a later push
(~400-700 µs) is not accounted for.

The WRITE carries no notification: one would keep it in flight until the decode's worker
progressed (the notification's active message), and a decode that is busy connecting, or
closes and connects again at once, may not (measured: a bench's ten handshakes in a row left
one in flight, and the decode's reconnect was refused). A push's answer is a notification,
though, and the first active message to a peer costs more than later ones (UCX chooses its
protocol, and over shared memory attaches the peer's receive queue, at the first send). So
beside the WRITE goes a notification on its own (NIXL's ``send_notif``: no transfer of ours
waits for it), a sealed "warm" that the decode drops (decode/pushes.on_notif). Measured on
2 x H200 (64 MiB, a push after a pull, two runs each interleaved with the tree before it): the
first push 1106-1115 µs -> 795-915 µs, its median 474-528 µs.

The READs are posted ``AFTER`` the handshake, once a same-node decode has asked to open our
memory, and none is posted for such a decode, which copies our pushes itself and is never
written into: so nothing of them competes with its connect for the agent's lock or the host's
cores. (On one 2 x H200 host our answer to a same-node offer took 2.0 ms beside such a post, on
another 1.9 ms with no post at all; NIXL 1.4.0's binding releases the GIL while it posts: that
the answer waited for the post is not borne out.)

Only device memory is mapped so (``wanted``): host memory moves by cma or tcp, where UCX maps
nothing ahead of a WRITE, and a READ of a few bytes goes by active messages that need the
decode's progress (an idle decode would hold it in flight). The READs are polled at the
progress loop's idle pace: the push they prepare for is not waiting on them.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from ..errors import KVRuntimeError
from ..nixl.registration import Scratch
from ..nixl.transfer import PostedTransfer, Rows
from ..wire import frames, messages

log = logging.getLogger(__name__)

BATCH = 8  # regions one warming READ maps
AFTER = 0.01  # seconds after its handshake a decode's first READ is posted (its offer ~1 ms)
PIECE = Scratch.NBYTES // BATCH  # bytes read of each region, each into its own scratch slice


def wanted(ours: str, theirs: str) -> bool:
    """Whether a decode's memory is mapped at its connect: NIXL memory types, ours and its."""
    return "VRAM" in (ours, theirs)


class Warms:
    """The decodes whose memory is still to be mapped (``add``), and the READs and WRITEs doing
    it."""

    def __init__(self, agent, cache, stats):
        self.agent = agent
        self.cache = cache
        self.stats = stats  # the server's: ``warmed``, ``warm_failed``
        self._lock = threading.Lock()  # held across a post: a drop never meets half a post
        # decode agent -> (peer, its regions not mapped, its scratch not written yet or None,
        # monotonic time its first transfer is due)
        self._queued: dict[str, tuple] = {}
        self._posted: dict[str, tuple] = {}  # decode agent -> (peer, PostedTransfer)
        self._scratch: Scratch | None = None
        self._keep_scratch = False  # a transfer of it was dropped in flight: never freed
        self.reads = 0  # READs posted (tests read it)
        self.writes = 0  # WRITEs posted into decodes' scratches
        self.notes = 0  # "warm" notifications sent beside them

    @property
    def pending(self) -> bool:
        return bool(self._queued) or bool(self._posted)

    def add(self, peer) -> None:
        """Map ``peer``'s regions and write its scratch (its handshake's, already checked) at
        the next passes, if ``wanted``."""
        if not wanted(self.cache.mem_type, peer.info.mem_type):
            return
        regions = [(int(a), int(n), int(d)) for a, n, d in peer.info.regions if int(n) > 0]
        if regions or peer.info.scratch is not None:
            with self._lock:
                self._queued[peer.agent] = (peer, regions, peer.info.scratch,
                                            time.monotonic() + AFTER)

    def progress(self) -> bool:
        """Poll the transfers in flight, post the next ones; True while any decode is not
        done."""
        if not self.pending:
            return False
        with self._lock:
            for agent, (peer, xfer) in list(self._posted.items()):
                state = xfer.poll()
                if state == "PROC":
                    continue
                xfer.finish()
                del self._posted[agent]
                if state != "DONE":
                    self._give_up(peer, f"its {xfer.op} failed in NIXL")
                elif agent not in self._queued:
                    self.stats.warmed += 1
            now = time.monotonic()
            for agent, (peer, regions, scratch, due) in list(self._queued.items()):
                if peer.opened:  # same-node: it copies what we push, nothing is written
                    del self._queued[agent]
                elif agent not in self._posted and now >= due:
                    self._post(peer, regions, scratch, first=due > 0)
            return self.pending

    def _post(self, peer, regions: list, scratch, first: bool) -> None:
        """``peer``'s next transfer: a READ of up to ``BATCH`` of its ``regions``, and once they
        are all read, the WRITE into its ``scratch``."""
        if regions:
            batch, regions, write = regions[:BATCH], regions[BATCH:], None
        else:
            batch, write, scratch = None, scratch, None
        if regions or scratch is not None:
            self._queued[peer.agent] = (peer, regions, scratch, 0.0)
        else:
            del self._queued[peer.agent]
        try:
            if first:  # (its first post) our plan of its blocks, not in its first push
                peer.planner(self.cache.layout)
            if self._scratch is None:
                self._scratch = Scratch(self.agent, self.cache)
            s = self._scratch
            if batch is not None:
                local = np.array([[s.address + i * PIECE, min(PIECE, n), s.device_id]
                                  for i, (_a, n, _d) in enumerate(batch)], dtype=np.uint64)
                remote = np.array([[a, min(PIECE, n), d] for a, n, d in batch],
                                  dtype=np.uint64)
                op = "READ"
            else:
                address, length, device = write
                n = min(PIECE, length)
                local = s.descriptor(n)
                remote = np.array([[address, n, device]], dtype=np.uint64)
                op = "WRITE"  # no notification (module doc)
            rows = Rows(local, remote, peer.agent, s.mem_type, peer.info.mem_type)
            self._posted[peer.agent] = (peer, PostedTransfer(self.agent, op, rows=rows))
            if op == "READ":
                self.reads += 1
            else:
                self.writes += 1
        except (KVRuntimeError, RuntimeError, MemoryError) as exc:  # NIXL's refusal, or no
            self._give_up(peer, str(exc))  # memory for the scratch (torch's OOM is a RuntimeError)
            return
        if write is not None:
            self._note(peer)

    def _note(self, peer) -> None:
        """The "warm" notification to ``peer``; one that NIXL refuses is logged, not fatal: the
        first push's answer pays UCX's first active message then."""
        try:
            self.agent.notify(peer.agent, frames.encode_notif(messages.WARM.build(),
                                                              peer.info.session))
            self.notes += 1
        except KVRuntimeError as exc:
            log.info("the warm notification to %s: %s", peer.agent, exc)

    def _give_up(self, peer, why: str) -> None:
        self._queued.pop(peer.agent, None)
        self.stats.warm_failed += 1
        log.info("mapping the memory of %s at its connect: %s; its first push maps it",
                 peer.agent, why)

    def drop(self, peer):
        """``peer`` left: nothing more is posted for it. Returns its READ if still in flight
        (the caller keeps it until UCX ends it), else None."""
        with self._lock:
            queued = self._queued.get(peer.agent)
            if queued is not None and queued[0] is peer:
                del self._queued[peer.agent]
            posted = self._posted.get(peer.agent)
            if posted is None or posted[0] is not peer:
                return None
            del self._posted[peer.agent]
            if posted[1].abort():
                return None
            self._keep_scratch = True  # its bytes may land there until the agent goes
            return posted[1]

    def close(self) -> None:
        """After every decode was dropped (their READs are the caller's then)."""
        with self._lock:
            self._queued.clear()
            if self._scratch is not None and not self._keep_scratch:
                self._scratch.close()
            self._scratch = None
