"""The decode side: connects to prefill servers, pulls blocks or asks for them to be pushed.

``DecodeClient.connect`` measures the handshake (connect, compat check, add agent, prepare the
peer's descriptor list). Connecting again to an address, or meeting an agent name already
loaded, removes the stale agent first: that is how a restarted prefill is picked up.
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import time

from . import frames
from .agent import Agent, unique_name
from .binding import NixlBinding
from .errors import KVRuntimeError, PeerError, TransferError, TransferTimeout
from .handshake import PeerInfo, client_handshake, connect
from .memory import KVCache
from .plan import make_plan
from .registration import Registration
from .transfer import TransferResult, free_notification, run_transfer

log = logging.getLogger("kvruntime")
_request_ids = itertools.count()


class PrefillPeer:
    """One handshaked prefill server."""

    def __init__(self, client: "DecodeClient", address, sock, info: PeerInfo, agent: str,
                 handshake_seconds: float):
        self.client = client
        self.address = address
        self.sock = sock
        self.info = info
        self.agent = agent
        self.handshake_seconds = handshake_seconds
        self.closed = False

    def _new_request(self) -> str:
        return f"{os.getpid()}-{next(_request_ids)}"

    def pull(self, src_blocks, dst_blocks=None, request_id: str | None = None,
             timeout: float = 30.0, split: int = 1) -> TransferResult:
        """READ the peer's ``src_blocks`` into our ``dst_blocks``; the NIXL notification then
        tells the prefill side it may free the request's blocks."""
        self._check_open()
        request_id = request_id or self._new_request()
        plan = make_plan(self.info.layout, src_blocks, self.client.cache.layout, dst_blocks)
        reg = self.client.registration
        return run_transfer(self.client.agent, "READ", plan, reg.local_dlist,
                            reg.peer_dlist(self.agent), True, free_notification(request_id),
                            timeout, split)

    def push(self, src_blocks, dst_blocks=None, request_id: str | None = None,
             timeout: float = 30.0, split: int = 1) -> TransferResult:
        """Ask the prefill side to WRITE its ``src_blocks`` into our ``dst_blocks``."""
        self._check_open()
        request_id = request_id or self._new_request()
        plan = make_plan(self.info.layout, src_blocks, self.client.cache.layout, dst_blocks)
        start = time.perf_counter()
        message = {"type": "push", "request": request_id, "src": list(src_blocks),
                   "dst": list(dst_blocks if dst_blocks is not None else src_blocks),
                   "timeout": timeout, "split": split}
        tag = free_notification(request_id)
        agent = self.client.agent
        noted = False

        def progress() -> None:
            # Without a NIXL progress thread our worker only moves when polled: the prefill's
            # WRITE (its endpoint wire-up and the notification) needs us to poll meanwhile.
            nonlocal noted
            noted = noted or agent.call("check_remote_xfer_done",
                                        agent.nixl.check_remote_xfer_done, self.agent, tag)

        reply = self._call(message, "pushed", timeout + 5, progress)
        seconds = time.perf_counter() - start
        deadline = time.monotonic() + timeout
        while not noted:  # the WRITE's notification proves the data landed here
            if time.monotonic() > deadline:
                raise TransferTimeout(f"push of request {request_id} reported done but its "
                                      f"notification never arrived")
            time.sleep(0.0002)
            progress()
        return TransferResult("WRITE", plan.nbytes, seconds, len(plan.runs),
                              int(reply.get("descriptors", plan.descriptor_count)),
                              reply.get("nixl_descriptors"), _seconds(reply.get("seconds")))

    def digests(self, blocks) -> list[str]:
        reply = self._call({"type": "digests", "blocks": list(blocks)}, "digests", 60)
        out = reply.get("digests")
        if not isinstance(out, list) or len(out) != len(blocks):
            raise PeerError("peer answered a digests request with the wrong number of digests")
        return out

    def _call(self, message: dict, reply_type: str, timeout: float, progress=None) -> dict:
        try:
            frames.write_frame(self.sock, message, timeout)
            if progress is not None:
                deadline = time.monotonic() + timeout
                while not select.select([self.sock], [], [], 0.0002)[0]:
                    if time.monotonic() > deadline:
                        raise PeerError(f"no answer to {message['type']!r} within {timeout}s")
                    progress()
            reply = frames.read_frame(self.sock, timeout)
            return frames.expect(reply, reply_type)
        except PeerError as exc:
            self.close()
            raise TransferError(f"prefill {self.address[0]}:{self.address[1]}: {exc}") from exc

    def _check_open(self) -> None:
        if self.closed:
            raise PeerError(f"connection to prefill {self.address[0]}:{self.address[1]} is "
                            f"closed; connect again")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            frames.write_frame(self.sock, {"type": "bye"}, 0.5)
        except KVRuntimeError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass
        self.client._forget(self)


def _seconds(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


class DecodeClient:
    def __init__(
        self,
        cache: KVCache,
        *,
        binding: NixlBinding | None = None,
        secret: bytes | None = None,
        timeout: float = 5.0,
        ucx_threads: int = 0,
        device_kind: str = "cpu",
        name: str | None = None,
    ):
        self.cache = cache
        self.secret = secret
        self.timeout = timeout
        self._peers: dict[tuple[str, int], PrefillPeer] = {}
        self._closed = False
        self.agent = Agent(name or unique_name("decode"), binding, device_kind, ucx_threads)
        try:
            self.registration = Registration(self.agent, cache)
            self.info = PeerInfo(cache.layout, self.agent.name, self.agent.metadata(),
                                 self.registration.region_triples(), cache.mem_type)
        except Exception:
            self.agent.close()
            raise

    def connect(self, host: str, port: int, timeout: float | None = None) -> PrefillPeer:
        timeout = self.timeout if timeout is None else timeout
        address = (host, port)
        stale = self._peers.get(address)
        if stale is not None:
            stale.close()
        start = time.perf_counter()
        sock = connect(host, port, timeout)
        try:
            info = client_handshake(sock, self.info, self.secret, timeout)
            for peer in list(self._peers.values()):
                if peer.info.agent == info.agent:  # same name from another address
                    peer.close()
            if info.agent in self.registration.peers:
                self._remove_agent(info.agent)
            name = self.agent.add_remote(info.metadata)
            try:
                self.registration.prepare_peer(name, info.layout, info.regions, info.mem_type)
            except Exception:
                self._remove_agent(name)
                raise
        except BaseException:
            sock.close()
            raise
        peer = PrefillPeer(self, address, sock, info, name, time.perf_counter() - start)
        self._peers[address] = peer
        return peer

    def _remove_agent(self, name: str) -> None:
        self.registration.release_peer(name)
        try:
            self.agent.remove_remote(name)
        except KVRuntimeError as exc:
            log.warning("removing agent %s: %s", name, exc)

    def _forget(self, peer: PrefillPeer) -> None:
        if self._peers.get(peer.address) is peer:
            del self._peers[peer.address]
        if peer.agent in self.registration.peers:
            self._remove_agent(peer.agent)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for peer in list(self._peers.values()):
            peer.close()
        self.registration.close()
        self.agent.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


