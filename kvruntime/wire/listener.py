"""The prefill's listening socket: connections accepted within limits, each served by a thread.

A flood of connections, or of handshakes from one address, is refused at accept (counted in
the server's stats), never queued; accept errors (EMFILE, ENOBUFS...) are waited out with
backoff, so the listener never dies while its socket stays open (health checks would pass while
every decode timed out). Every thread the server runs (the accept loop, the progress loop, one a
connection) is spawned here and joined at close.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

log = logging.getLogger(__name__)


class Listener:
    """``serve(sock, addr)`` serves one accepted connection (in a thread of its own) and calls
    ``admitted(host)`` once its handshake is over and ``hang_up(sock)`` at its end; ``stop`` is
    the server's: set, everything winds down."""

    def __init__(self, host: str, port: int, stats, *, serve, stop: threading.Event,
                 max_connections: int, max_handshaking_per_address: int):
        self._sock = socket.create_server((host, port), backlog=64)
        self._sock.settimeout(0.2)
        self.stats = stats
        self._serve = serve
        self._stop = stop
        self.max_connections = max_connections
        self.max_handshaking_per_address = max_handshaking_per_address
        self.handshaking: dict[str, int] = {}  # peer address -> connections not yet admitted
        self._handshaking_lock = threading.Lock()
        self.conns: set[socket.socket] = set()
        self.threads: set[threading.Thread] = set()  # running ones only
        self._threads_lock = threading.Lock()

    @property
    def address(self) -> tuple[str, int]:
        return self._sock.getsockname()[:2]

    def spawn(self, target, name, *args) -> None:
        def run():
            try:
                target(*args)
            finally:  # a finished connection leaves nothing behind
                with self._threads_lock:
                    self.threads.discard(threading.current_thread())

        t = threading.Thread(target=run, name=name, daemon=True)
        with self._threads_lock:
            self.threads.add(t)
        t.start()

    def accept_loop(self) -> None:
        """Accept until stopped; resource errors are logged and waited out with backoff."""
        backoff = 0.01
        while not self._stop.is_set():
            try:
                sock, addr = self._sock.accept()
            except socket.timeout:
                continue
            except OSError as exc:
                if self._stop.is_set() or self._sock.fileno() < 0:
                    return
                self.stats.accept_errors += 1
                log.warning("accept failed (%s); retrying in %.2fs", exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 1.0)
                continue
            backoff = 0.01
            self.stats.connections += 1
            host = addr[0]
            if (len(self.conns) >= self.max_connections
                    or self.handshaking.get(host, 0) >= self.max_handshaking_per_address):
                self.stats.over_limit += 1
                self.stats.refuse(addr, "connection limit reached")
                close_gracefully(sock, linger=0.0)
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.conns.add(sock)
            with self._handshaking_lock:
                self.handshaking[host] = self.handshaking.get(host, 0) + 1
            self.spawn(self._serve, f"kvr-conn-{addr[1]}", sock, addr)

    def admitted(self, host: str) -> None:
        """A connection from ``host`` is past its handshake (admitted or not)."""
        with self._handshaking_lock:
            left = self.handshaking.get(host, 0) - 1
            if left > 0:
                self.handshaking[host] = left
            else:
                self.handshaking.pop(host, None)

    def hang_up(self, sock: socket.socket) -> None:
        """Close ``sock`` (gracefully: up to its linger), and only then stop counting it: a
        connection is counted while it holds its descriptor, so that ``conns`` says how many
        of them the server holds. (Before, it was uncounted first: a connection flood's tail,
        still lingering, looked gone, and a decode that connected then met the fd limit in
        the prefill's UCX.)"""
        try:
            close_gracefully(sock)
        finally:
            self.conns.discard(sock)

    def close(self) -> None:
        """Stop accepting, end every connection's reads, and join the threads (5 s at most)."""
        try:
            self._sock.close()
        except OSError:
            pass
        for sock in list(self.conns):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + 5
        with self._threads_lock:
            threads = list(self.threads)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))


def close_gracefully(sock: socket.socket, linger: float = 0.1) -> None:
    """Close so that our last (error) frame reaches the peer: closing with unread input
    makes the kernel send a reset, which can discard what we sent just before."""
    try:
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(linger)
        drained = 0
        while drained < (1 << 20):
            chunk = sock.recv(65536)
            if not chunk:
                break
            drained += len(chunk)
    except OSError:
        pass
    finally:
        try:
            sock.close()
        except OSError:
            pass
