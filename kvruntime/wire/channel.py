"""The side channel between a decode and a prefill: MAC'd frames (frames.py) over one socket.

``Channel`` is what both ends share: the socket, its session (the frames' MACs and counts) and
a send lock, since more than one thread answers on one connection (the prefill's connection
thread and its progress loop; the decode's callers and whichever thread polls).

``PeerChannel`` is the decode's end. Nothing reads it in the background: whichever thread polls
(``pump``) reads what the prefill sent and hands each frame to the handle awaiting it by
request id, to a control call's waiter, or to the peer (a same-node push's ids, "ready"). A
prefill that also writes its readies into a ring in its memory (mailbox.py) is read there
first; the frame that follows each is then dropped. Once the channel fails (a send, a read, a
bad frame) it is lost: every request waiting on it fails, and the peer closes.
"""

from __future__ import annotations

import itertools
import logging
import select
import socket
import threading
import time
from collections import OrderedDict

from ..errors import KVRuntimeError, PeerError, TransferError, WaitTimeout
from ..host.naps import await_readable
from . import frames, messages
from .mailbox import MailboxReader

log = logging.getLogger(__name__)
_call_ids = itertools.count()
MAX_FROM_RING = 65536  # readies taken from a prefill's ring whose frames have not come yet
# How long a prefill may leave a cancel unanswered before its peer is treated as unusable.
SETTLE_SECONDS = 5.0


class Channel:
    """One connection's socket and session; frames go out whole, one at a time."""

    def __init__(self, sock, session: frames.Session):
        self.sock = sock
        self.session = session
        self._send_lock = threading.Lock()

    def send(self, message: dict, timeout: float) -> None:
        with self._send_lock:
            frames.write_frame(self.sock, message, timeout, self.session)

    def read(self, timeout: float | None) -> dict:
        return frames.read_frame(self.sock, timeout, session=self.session)

    def end(self) -> None:
        """Hang up now, both ways (the peer sees it before anything we do after), without
        closing the socket: the thread serving it reads the end and closes it."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def hung_up(self) -> bool:
        """Has the peer hung up (or reset) its end? Seen at once, even with its last frames
        still unread (POLLRDHUP); the socket is not read."""
        if self.sock.fileno() < 0:
            return True
        poller = select.poll()
        poller.register(self.sock, select.POLLRDHUP)
        return any(ev & (select.POLLRDHUP | select.POLLHUP | select.POLLERR)
                   for _fd, ev in poller.poll(0))


class PeerChannel(Channel):
    """The decode's end of one prefill's side channel: requests awaiting frames, control calls,
    the ring of readies, and what happens when it breaks.

    ``name`` names the prefill in errors; ``timeout`` bounds one frame's send or read;
    ``progress`` is called first by every pump (the client's UCX worker progress);
    ``on_ready(handle, message)`` takes a "ready" for a push the decode copies itself;
    ``on_lost()`` closes the peer once the channel is lost."""

    def __init__(self, sock, session: frames.Session, name: str, *, timeout: float, progress,
                 on_ready, on_lost):
        super().__init__(sock, session)
        self.name = name
        self.timeout = timeout
        self._progress = progress
        self._on_ready = on_ready
        self._on_lost = on_lost
        self.closed = False
        self.broken: str | None = None  # why the peer may not be used any more
        self.losing = False  # lose() is failing our requests (their cleanup may send, fail, lose)
        self._recv_lock = threading.Lock()
        # the reader's look at the socket (1 µs; naps.readable's ppoll costs ~5 through ctypes):
        # a poll object serves one thread at a time, the one holding the receive lock
        self._poller = None
        self.pending: dict = {}  # request id -> TransferHandle awaiting frames
        self._unsettled: dict[str, float] = {}  # cancelled push -> when the cancel went out
        self._replies: dict[str, dict | None] = {}  # control call id -> reply (None: waiting)
        # the prefill's ring of readies, read from its memory as we poll (mailbox.py), and the
        # requests whose ready came that way (their frame, which follows, is dropped)
        self.ring: MailboxReader | None = None
        self.from_ring: OrderedDict[str, None] = OrderedDict()

    # -- requests awaiting frames --------------------------------------------------------------
    def check_new(self, request_id: str) -> None:
        if request_id in self.pending:
            raise KVRuntimeError(f"request id {request_id!r} is already in flight on {self.name}")

    def expect(self, handle) -> None:
        """``handle`` waits for frames of its request (checked new with ``check_new``)."""
        self.pending[handle.request_id] = handle

    def settled(self, handle) -> None:
        """``handle`` expects nothing more from the prefill (finished, or failed and settled)."""
        if self.pending.get(handle.request_id) is handle:
            del self.pending[handle.request_id]
        self._unsettled.pop(handle.request_id, None)

    def cancel(self, request_id: str) -> None:
        self._unsettled[request_id] = time.monotonic()
        try:
            self.send(messages.CANCEL.build(request=request_id))
        except KVRuntimeError:
            pass  # the connection is gone: nothing of ours is left on the prefill

    def check_usable(self) -> None:
        if self.closed:
            raise PeerError(f"connection to {self.name} is closed; connect again")
        if self.broken:
            raise PeerError(f"{self.name} is not usable: {self.broken}; connect again")
        now = time.monotonic()
        stale = [r for r, t in self._unsettled.items() if now - t > SETTLE_SECONDS]
        if stale:
            self.broken = (f"it has not answered the cancel of request {stale[0]} for "
                           f"{SETTLE_SECONDS:.0f}s (stalled?)")
            raise PeerError(f"{self.name} is not usable: {self.broken}; connect again")

    # -- out -------------------------------------------------------------------------------------
    def send(self, message: dict, timeout: float | None = None) -> None:
        with self._send_lock:
            if self.closed:
                raise PeerError(f"connection to {self.name} is closed; connect again")
            try:
                frames.write_frame(self.sock, message, timeout or self.timeout, self.session)
                return
            except KVRuntimeError as exc:
                error = exc
        # lost outside the send lock: the close sends "bye" under it, and fails handles,
        # whose locks a thread holding one may be waiting on ours under (a cancel)
        self.lose(f"side channel failed: {error}")
        raise TransferError(f"{self.name}: {error}") from error

    def call(self, kind: messages.Message, timeout: float, **fields) -> dict:
        """Send a control request of ``kind`` (a samenode offer, digests) and wait, polling,
        for its reply, which has the same type."""
        self.check_usable()
        call_id = f"c{next(_call_ids)}"
        self._replies[call_id] = None
        try:
            self.send(kind.build(request=call_id, **fields))
            deadline = time.monotonic() + timeout
            while True:
                self.pump()
                # the answer looked for as soon as it is read, before any nap: a nap after the
                # pump that read it cost every call its 0.2 ms and the nap's late end (0.39
                # ms on the 2-core host, 0.23 on an H200 host: a third of a connect's "pool"
                # exchange, the round trip auto's model charges a coalesced request)
                if self._replies.get(call_id) is not None:
                    break
                if self.broken:
                    raise TransferError(f"{self.name}: {self.broken}")
                if time.monotonic() > deadline:
                    raise WaitTimeout(f"{self.name}: no answer to {kind.type!r} within "
                                      f"{timeout}s")
                # woken by the answer's frame, not a timer: a 0.2 ms sleep ended ~0.26 ms late
                # on the 2-core host
                self.await_frame(0.0002)
            reply = self._replies[call_id]
        finally:
            self._replies.pop(call_id, None)
        try:
            return frames.expect(reply, kind.type)
        except PeerError as exc:
            raise TransferError(f"{self.name}: {exc}") from exc

    # -- in --------------------------------------------------------------------------------------
    def await_frame(self, seconds: float) -> None:
        """Until the prefill sends something, at most ``seconds`` (naps.await_readable: any
        fd number, a nanosecond timeout, any number of threads at once; polled, not slept, on
        a host of many cores)."""
        try:
            await_readable(self.sock.fileno(), seconds)
        except (OSError, ValueError):  # closed under us: the next pump says so
            pass

    def pump(self) -> None:
        """Read whatever frames the prefill has sent and hand them out, after ``progress``.
        Non-blocking; a thread already reading makes this a no-op."""
        self._progress()
        if self.closed or not self._recv_lock.acquire(blocking=False):
            return
        try:
            if self.ring is not None and self.pending:  # pushes the prefill may have readied
                self._read_ring()
            if self._poller is None:  # poll, not select: any fd number (naps.py)
                self._poller = select.poll()
                self._poller.register(self.sock, select.POLLIN | select.POLLPRI)
            while not self.closed and self._poller.poll(0):
                try:
                    message = self.read(self.timeout)
                except KVRuntimeError as exc:
                    self.lose(f"side channel failed: {exc}")
                    return
                self.dispatch(message)
        except (OSError, ValueError) as exc:  # the socket was closed under us
            self.lose(f"side channel failed: {exc}")
        finally:
            self._recv_lock.release()

    def read_ring(self, ring: MailboxReader) -> None:
        """From now on, also take the prefill's readies from ``ring`` (in its memory, one
        host: the same-node engine's connect, engines/choice.py)."""
        self.ring = ring

    def _read_ring(self) -> None:
        """Take the readies the prefill wrote into its ring since the last read (under the
        receive lock). A ring that cannot be read or trusted is given up: the frames carry
        every ready too."""
        try:
            records = self.ring.read()
        except (KVRuntimeError, OSError) as exc:
            log.warning("%s: its ring of readies is given up (%s); they come by frame", self.name,
                        exc)
            self.ring = None
            return
        for message in records:
            request = message.get("request")
            if not messages.READY_IDS.is_(message) or not isinstance(request, str):
                log.warning("%s: its ring holds a %r record; given up, readies come by frame",
                            self.name, message.get("type"))
                self.ring = None
                return
            self.from_ring[request] = None
            while len(self.from_ring) > MAX_FROM_RING:
                self.from_ring.popitem(last=False)
            self.dispatch(message)

    def dispatch(self, message: dict) -> None:
        """Hand one frame to whoever waits for it (under the receive lock)."""
        kind, request = message.get("type"), message.get("request")
        if kind == messages.READY_IDS.type and message.get("ring") is True:
            # its record was written first: taken from the ring already, or now
            if self.ring is not None and request not in self.from_ring:
                self._read_ring()
            if request in self.from_ring:
                del self.from_ring[request]
                return
        if kind == messages.ERROR.type and not isinstance(request, str):
            self.lose(f"prefill closed the connection: {message.get('message')}")
            return
        if request in self._replies:
            self._replies[request] = message
            return
        if kind in messages.HANDLE_REPLIES and isinstance(request, str):
            handle = self.pending.get(request)
            if handle is not None and kind != messages.READY_IDS.type:
                handle.on_reply(message)
                return
            if handle is not None and handle.by_prefill:  # a ready: the ids for us to copy
                self._on_ready(handle, message)
                return
        if kind == messages.CANCELLED.type:  # its WRITE ended, was answered before our cancel
            log.info("%s answered a cancel of request %r after its end", self.name, request)
            return
        log.warning("%s sent an unexpected %r frame (request %r); ignored", self.name, kind,
                    request)

    # -- the end ----------------------------------------------------------------------------------
    def lose(self, why: str) -> None:
        """The side channel is unusable: fail what waits on it and close the peer. Once: a
        request's cleanup may send (a staged run's "unstage"), fail, and land here again while
        its handle's lock is held."""
        if self.losing:
            return
        self.losing = True
        self.broken = self.broken or why
        for handle in list(self.pending.values()):
            handle.on_peer_lost(why)
        self.pending.clear()
        self._unsettled.clear()
        self._on_lost()

    def hang_up(self) -> None:
        """Say "bye" (best effort) and close the socket; ``closed`` is already set, so nothing
        else goes out after it."""
        try:
            with self._send_lock:
                frames.write_frame(self.sock, messages.BYE.build(), 0.5, self.session)
        except KVRuntimeError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass
