"""What a decode peer and its requests need of their client, in one small object: the book of
requests in flight, the releases that go out as a request ends, the copies that failed still
running, and the failed requests that settled since the client was last asked.

``DecodeClient`` makes one ``ClientPort`` and hands it to each peer at its connect; a peer, its
handles (inflight.py) and its engine (engines/engine.py) reach the client through it alone
(``peer.port``), never through the client's own fields.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)


class ClientPort:
    """A decode client's side that its peers and their handles use (see module doc)."""

    def __init__(self, *, releaser, draining, timeout: float, progress_settling):
        self.timeout = timeout  # the client's: a connect's calls, a close's wait for answers
        self._releaser = releaser  # releases.ReleaseSender
        self._draining = draining  # transfer.Draining: failed copies still in flight
        self._progress_settling = progress_settling  # DecodeClient.progress_settling
        self._lock = threading.Lock()
        self._inflight: dict = {}  # id(handle) -> handle, until reported
        self._late_settled: list = []  # failed handles that settled since get_settled

    # -- requests in flight --------------------------------------------------------------------
    def track(self, handle) -> None:
        with self._lock:
            self._inflight[id(handle)] = handle

    def track_all(self, handles) -> None:
        with self._lock:
            self._inflight.update((id(h), h) for h in handles)

    def consumed(self, handle) -> None:
        """``handle`` was reported (its wait returned, get_finished listed it)."""
        with self._lock:
            self._inflight.pop(id(handle), None)

    def consumed_all(self, handles) -> None:
        with self._lock:
            for handle in handles:
                self._inflight.pop(id(handle), None)

    def handles(self) -> list:
        with self._lock:
            return list(self._inflight.values())

    def of(self, peer) -> list:
        """The requests in flight that ``peer`` started."""
        return [h for h in self.handles() if h.peer is peer]

    def __len__(self) -> int:
        return len(self._inflight)

    # -- what goes back to the prefill, and what is still running ------------------------------
    def flush_releases(self) -> None:
        """Send the releases gathered so far (releases.py): one frame a peer."""
        self._releaser.flush()

    def drain_later(self, xfer, on_end, owner: str) -> None:
        """A failed copy still in flight: polled until it ends, then ``on_end()``."""
        self._draining.add(xfer, on_end, owner)

    def progress_settling(self) -> None:
        """Poll the failed copies still in flight and the peers' frames."""
        self._progress_settling()

    def settled_late(self, handle) -> None:
        """``handle`` failed unsettled and has settled now (``get_settled`` lists it)."""
        with self._lock:
            self._late_settled.append(handle)

    def take_settled(self) -> list:
        with self._lock:
            out, self._late_settled = self._late_settled, []
        return out

    def log_late(self, handle, what: str) -> None:
        log.warning("push request %s to %s reported failed, but %s", handle.request_id,
                    handle.peer.name, what)
