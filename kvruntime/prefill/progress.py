"""A prefill server's one progress thread (server.py starts it, its stop event ends it): our
WRITEs in flight, staged requests, pushes waiting for their decode, new decodes' memory mapped
(warm.py), and our UCX worker's progress."""

from __future__ import annotations

import logging
import os
import threading
import time

from ..host.naps import tighten_timer_slack

log = logging.getLogger(__name__)


class Progress:
    """Polls without sleeping while a WRITE should end soon (``Writes.spinning``), tightly
    while WRITEs are in flight, every millisecond otherwise (``work`` set by a new push wakes
    it); its naps end on time (this thread's timer slack is 1 µs, not 50: naps.py)."""

    def __init__(self, agent, writes, pushes, stages, *, stop: threading.Event,
                 work: threading.Event):
        self.agent = agent
        self.writes = writes  # our WRITEs (pushes.py's Writes)
        self.pushes = pushes  # pushes waiting for a decode to name their blocks
        self.stages = stages  # staged requests (stages.py)
        self.stop = stop
        self.work = work

    def run(self) -> None:
        tighten_timer_slack()
        busy = False
        while not self.stop.is_set():
            if busy and self.writes.spinning:  # a WRITE that should end soon: no sleep's delay
                os.sched_yield()
            elif busy or self.stages.queued:
                time.sleep(0.00005)
            else:
                self.work.wait(0.001)
                self.work.clear()
            try:
                if self.stages.held:
                    self.stages.expire()
                if self.pushes.waiting:
                    self.pushes.expire()
                if self.stages.queued:
                    self.stages.serve()
                # our UCX worker's progress (WRITEs in flight, peers' requests); decodes send
                # no notifications (only our pushes carry them), so any that come are logged
                notifs = self.agent.call("get_new_notifs", self.agent.nixl.get_new_notifs)
            except Exception as exc:
                if not self.stop.is_set():
                    log.warning("polling notifications: %s", exc)
                notifs = {}
            for agent, notes in notifs.items():
                log.warning("ignoring %d NIXL notification(s) from %s: kvruntime peers release "
                            "blocks by frame", len(notes), agent)
            try:
                busy = self.writes.progress()
                # a new decode's memory mapped by a READ (warm.py), here: not on its connection
                # thread, which its first frames (a same-node offer) must not wait for; polled
                # at the idle pace (nothing waits on it)
                self.writes.warms.progress()
            except Exception:
                if not self.stop.is_set():
                    log.exception("progressing WRITEs")
                busy = False
