"""When the release frames of finished requests go out: while the host waits anyway.

A request done here (a pull's READ, a same-node copy) lets the prefill free its blocks: the
decode tells it in a "release" frame. Sent by the poll that saw the request end, that frame
was part of every request's time (20-35 µs of a wait's return on an H100 host, more than
kvruntime's whole overhead target). Sent by a thread of its own, it cost more: each frame
took the GIL from the thread that waits on the next request and gave it back late (32 requests
in flight from 4 peers, batched: 0.94-0.98 of one request's rate fell to 0.79-0.84).

So a finished request's id waits (``Pending``, one per peer), and goes out from the first of:
- a poll of a request still in flight (its copy runs on the device meanwhile), any peer's;
- ``get_finished``, after what it collected (an engine's step: one frame a peer);
- the peer's close, before its "bye";
- the backstop thread, for a client that calls nothing more: every ``PERIOD`` it sends what
  has waited a whole period. It sleeps while nothing waits, and lingers awake ``LINGER``
  after the last release it saw, so that a busy client wakes it at most every ``PERIOD``.

On the prefill, ``Released`` keeps what its decodes released until the engine collects it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

from ..errors import KVRuntimeError
from . import messages

log = logging.getLogger(__name__)
FRAME_IDS = 1024  # request ids a release frame names at most (frames stay small)
KEPT = 65536  # released ids a prefill keeps when nobody collects them (the newest)
PERIOD = 0.005  # seconds a release may wait for a poll before the backstop sends it
LINGER = 0.5  # seconds the backstop stays awake after the last release it saw


class ReleaseSender:
    """The peers of one client whose release ids wait (``due``), and their backstop."""

    def __init__(self, name: str):
        self._name = name
        self._due: dict = {}  # peer -> when its oldest waiting id came (monotonic)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    def due(self, peer) -> None:
        """``peer`` (a ``Pending``) has release ids waiting."""
        if peer not in self._due:
            with self._lock:  # not while a flush takes the dict
                self._due.setdefault(peer, time.monotonic())
        if not self._wake.is_set():  # the backstop sleeps: the first release since wakes it
            self.start()
            self._wake.set()

    def flush(self) -> None:
        """Send every peer's waiting release ids now (a frame a peer), in this thread."""
        if self._due:
            with self._lock:
                peers, self._due = self._due, {}
            for peer in peers:
                peer.flush()  # logs, never raises

    def start(self) -> None:
        """The backstop's thread (asleep until a release is due); once."""
        if self._thread is None and not self._closed:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, daemon=True,
                                                    name=f"{self._name}-releases")
                    self._thread.start()

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait()
            seen = time.monotonic()
            while not self._closed and time.monotonic() - seen < LINGER:
                time.sleep(PERIOD)
                if self._due:
                    seen = now = time.monotonic()
                    with self._lock:
                        stale = [p for p, t in self._due.items() if now - t >= PERIOD]
                        for peer in stale:
                            del self._due[peer]
                    for peer in stale:
                        peer.flush()
            self._wake.clear()
            if self._due:  # came as it went to sleep
                self._wake.set()

    def close(self) -> None:
        """Stop the backstop (the peers' closes sent what waited)."""
        self._closed = True
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(5)


class Pending:
    """One peer's request ids done here that the prefill has not heard of yet. The peer
    (decode.PrefillPeer) has ``send(message)``, ``closed`` and ``name``; its close sends what
    is pending, then "bye": nothing goes after that."""

    def __init__(self, peer, sender: ReleaseSender):
        self.peer = peer
        self._sender = sender
        self._ids: list[str] = []
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        # the backstop's thread started with the first peer, not by a first request (a
        # thread's start cost that request ~0.1 ms and the GIL while it began)
        sender.start()

    def add(self, request_ids: list) -> None:
        with self._lock:
            self._ids.extend(request_ids)
        self._sender.due(self)

    def flush(self) -> None:
        """Send the pending ids; one flush at a time, so that a close's waits for the
        backstop's (nothing is sent after the "bye"). Logs a failed send, never raises."""
        with self._flush_lock:
            with self._lock:
                ids, self._ids = self._ids, []
            if not ids or self.peer.closed:
                return
            for i in range(0, len(ids), FRAME_IDS):
                chunk = ids[i:i + FRAME_IDS]
                try:
                    self.peer.send(messages.RELEASE.build(requests=chunk))
                except KVRuntimeError as exc:
                    log.warning("%s: telling the prefill to free requests %s: %s",
                                self.peer.name, ", ".join(chunk), exc)


class Released:
    """The (decode agent, request id) pairs a prefill's decodes released, until the engine
    collects them (``take_all``, or ``wait`` for one); ``on_release(request)``, when given, is
    called for each as it comes."""

    def __init__(self, on_release=None):
        self.on_release = on_release
        self._released: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._cv = threading.Condition()

    def add(self, agent: str, request: str) -> None:
        with self._cv:
            self._released[(agent, request)] = None
            while len(self._released) > KEPT:  # nobody collects them: keep the newest
                self._released.popitem(last=False)
            self._cv.notify_all()
        if self.on_release is not None:
            try:
                self.on_release(request)
            except Exception:
                log.exception("on_release callback failed for %s", request)

    def wait(self, request: str, timeout: float, agent: str | None = None) -> bool:
        """True once ``request`` (from ``agent``, or any) is released; consumes it."""
        def take():
            for key in self._released:
                if key[1] == request and (agent is None or key[0] == agent):
                    del self._released[key]
                    return True
            return False

        with self._cv:
            return self._cv.wait_for(take, timeout)

    def take_all(self) -> list[tuple[str, str]]:
        with self._cv:
            out = list(self._released)
            self._released.clear()
        return out
