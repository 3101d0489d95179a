"""The prefill side: owns the KV cache, listens on the side channel, serves decode peers.

Per connection: handshake (auth, compat, metadata both ways), then control requests (push,
digests) until the peer leaves. Any bad frame or failed request closes *that* connection and
releases the peer's agent and prepared list; the server keeps serving the others. A poller
thread turns NIXL notifications (``kvr:free:<request>``) from decode READs into released
request ids.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, field

from . import frames
from .agent import Agent, unique_name
from .binding import NixlBinding
from .errors import KVRuntimeError, PeerError
from .handshake import PeerInfo, serve_handshake
from .memory import KVCache
from .plan import make_plan
from .registration import Registration
from .transfer import free_notification, parse_notification, run_transfer

log = logging.getLogger("kvruntime")


@dataclass
class _Peer:
    info: PeerInfo
    agent: str
    sock: socket.socket


@dataclass
class ServerStats:
    connections: int = 0
    handshakes: int = 0
    refused: list = field(default_factory=list)  # (peer address, error text)


class PrefillServer:
    def __init__(
        self,
        cache: KVCache,
        *,
        binding: NixlBinding | None = None,
        secret: bytes | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout: float = 5.0,
        on_release=None,
        ucx_threads: int = 0,
        device_kind: str = "cpu",
        name: str | None = None,
    ):
        self.cache = cache
        self.secret = secret
        self.timeout = timeout
        self.on_release = on_release
        self.stats = ServerStats()
        self._released: set[str] = set()
        self._released_cv = threading.Condition()
        self._peers: dict[str, _Peer] = {}
        # Adding and dropping a peer are atomic: a reconnecting decode reuses its agent name,
        # and the old connection's teardown must not remove the new connection's agent.
        self._peers_lock = threading.RLock()
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._closed = False
        self.agent = Agent(name or unique_name("prefill"), binding, device_kind, ucx_threads)
        try:
            self.registration = Registration(self.agent, cache)
            self._listener = socket.create_server((host, port), backlog=64)
        except Exception:
            self.agent.close()
            raise
        self._listener.settimeout(0.2)
        self.info = PeerInfo(cache.layout, self.agent.name, self.agent.metadata(),
                             self.registration.region_triples(), cache.mem_type)
        self._spawn(self._accept_loop, "kvr-accept")
        self._spawn(self._notif_loop, "kvr-notifs")

    @property
    def address(self) -> tuple[str, int]:
        return self._listener.getsockname()[:2]

    def _spawn(self, target, name, *args) -> None:
        t = threading.Thread(target=target, name=name, args=args, daemon=True)
        t.start()
        self._threads.append(t)

    # -- serving -----------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                sock, addr = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.stats.connections += 1
            self._conns.add(sock)
            self._spawn(self._serve_connection, f"kvr-conn-{addr[1]}", sock, addr)

    def _serve_connection(self, sock: socket.socket, addr) -> None:
        peer = None
        try:
            info = serve_handshake(sock, self.info, self.secret, self.timeout)
            peer = self._add_peer(info, sock)
            self.stats.handshakes += 1
            while not self._stop.is_set():
                try:
                    message = frames.read_frame(sock, None)
                except PeerError:
                    return  # the decode side left
                if message.get("type") == "bye":
                    return
                self._handle(peer, message)
        except KVRuntimeError as exc:
            if not self._stop.is_set():
                log.warning("closing connection from %s:%s: %s", addr[0], addr[1], exc)
                self.stats.refused.append((f"{addr[0]}:{addr[1]}", str(exc)))
        except Exception as exc:  # never let one connection take the server down
            log.exception("unexpected error serving %s:%s", addr[0], addr[1])
            self.stats.refused.append((f"{addr[0]}:{addr[1]}", repr(exc)))
        finally:
            if peer is not None:
                self._drop_peer(peer)
            self._conns.discard(sock)
            _close_gracefully(sock)

    def _add_peer(self, info: PeerInfo, sock: socket.socket) -> _Peer:
        with self._peers_lock:
            old = self._peers.get(info.agent)
            if old is not None:  # the same agent name again: a restarted or reconnected peer
                self._drop_peer(old)
            name = self.agent.add_remote(info.metadata)
            try:
                self.registration.prepare_peer(name, info.layout, info.regions, info.mem_type)
            except Exception:
                self.agent.remove_remote(name)
                raise
            peer = _Peer(info, name, sock)
            self._peers[name] = peer
            return peer

    def _drop_peer(self, peer: _Peer) -> None:
        """Release ``peer``'s list and agent, once; a no-op when a newer connection of the same
        agent name has replaced it (its teardown then belongs to that connection)."""
        with self._peers_lock:
            if self._peers.get(peer.agent) is not peer:
                return
            del self._peers[peer.agent]
            self.registration.release_peer(peer.agent)
            try:
                self.agent.remove_remote(peer.agent)
            except KVRuntimeError as exc:
                log.warning("removing agent %s: %s", peer.agent, exc)

    def _handle(self, peer: _Peer, message: dict) -> None:
        kind = message["type"]
        layout = self.cache.layout
        if kind == "push":
            request = frames.field(message, "request", str)
            src = frames.field(message, "src", list)
            dst = frames.field(message, "dst", list)
            timeout = float(frames.field(message, "timeout", (int, float)))
            split = int(message.get("split", 1)) if isinstance(message.get("split"), int) else 1
            plan = make_plan(layout, src, peer.info.layout, dst)
            result = run_transfer(self.agent, "WRITE", plan, self.registration.local_dlist,
                                  self.registration.peer_dlist(peer.agent), False,
                                  free_notification(request), timeout, split)
            self._release(request)  # our WRITE finished: the blocks may be freed
            frames.write_frame(peer.sock, {
                "type": "pushed", "request": request, "nbytes": result.nbytes,
                "seconds": result.seconds, "descriptors": result.descriptors,
                "nixl_descriptors": result.nixl_descriptors}, self.timeout)
        elif kind == "digests":
            blocks = frames.field(message, "blocks", list)
            plan = make_plan(layout, blocks)  # validates the ids
            del plan
            frames.write_frame(peer.sock, {"type": "digests",
                                           "digests": self.cache.block_digests(blocks)},
                               self.timeout)
        else:
            raise KVRuntimeError(f"unknown request type {kind!r}")

    # -- completion --------------------------------------------------------------------------
    def _notif_loop(self) -> None:
        while not self._stop.wait(0.001):
            try:
                notifs = self.agent.call("get_new_notifs", self.agent.nixl.get_new_notifs)
            except Exception as exc:
                if not self._stop.is_set():
                    log.warning("polling notifications: %s", exc)
                continue
            for messages in notifs.values():
                for msg in messages:
                    request = parse_notification(msg)
                    if request is not None:
                        self._release(request)

    def _release(self, request: str) -> None:
        with self._released_cv:
            self._released.add(request)
            self._released_cv.notify_all()
        if self.on_release is not None:
            try:
                self.on_release(request)
            except Exception:
                log.exception("on_release callback failed for %s", request)

    def wait_released(self, request: str, timeout: float) -> bool:
        """True once the decode side said ``request``'s blocks may be freed."""
        with self._released_cv:
            return self._released_cv.wait_for(lambda: request in self._released, timeout)

    @property
    def peers(self) -> list[str]:
        return list(self._peers)

    # -- shutdown ----------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        try:
            self._listener.close()
        except OSError:
            pass
        for sock in list(self._conns):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + 5
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        for peer in list(self._peers.values()):
            self._drop_peer(peer)
        self.registration.close()
        self.agent.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _close_gracefully(sock: socket.socket) -> None:
    """Close so that our last (error) frame reaches the peer: closing with unread input
    makes the kernel send a reset, which can discard what we sent just before."""
    try:
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(0.1)
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
