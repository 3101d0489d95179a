"""The side-channel handshake: version, authentication, compatibility, metadata exchange.

Socket-level and NIXL-free: each side hands in its ``PeerInfo`` (layout, agent name, NIXL
metadata, region addresses) and gets the peer's back. The order is chosen so that nothing that
grants memory access (NIXL metadata) is sent before the peer proved it knows the secret::

    decode -> prefill  hello     {layout, nonce, kv_buffer, app}
    prefill -> decode  challenge {nonce, auth}
    decode -> prefill  auth      {proof}         HMAC(secret, "c" | H(hello, challenge))
    prefill -> decode  welcome   {proof, info}   HMAC(secret, "s" | H(hello, challenge, auth, info))
    decode -> prefill  info      {proof, info}   HMAC(secret, "i" | H(... welcome, info))
    prefill -> decode  ready                      (only once the decode's agent is added)

Each proof covers the whole transcript so far (H: SHA-256 over the canonical JSON of every
message, proofs left out), not just the nonces: a relay without the secret cannot change a
layout, an address, a region or an agent's metadata without both sides refusing. From ``ready``
on, every frame carries a MAC (frames.Session) under a key of its direction derived from the
secret and the transcript through ``info``: HMAC(secret, "k" | H), then HMAC of that with the
direction's name. Without a secret the keys come from the transcript alone, which a relay saw:
the MACs then catch corruption, not a relay (configure a secret for that). A layout
mismatch is refused by the prefill side with an ``incompatible`` error listing every differing
field; the decode side runs the same check on the welcome. So is an application descriptor
(``PeerInfo.app``, app.py: a model's config, say) that differs, key by key, both values named.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import time
from dataclasses import dataclass, field, replace

from ..app import check_app, check_same_app
from ..errors import (
    AuthError,
    FrameError,
    HandshakeTimeout,
    IncompatiblePeerError,
    KVRuntimeError,
    LayoutError,
    PeerError,
)
from ..layout import KVLayout, layout_differences
from . import frames, messages

NONCE_BYTES = 32
MEM_TYPES = ("DRAM", "VRAM")


@dataclass(frozen=True)
class PeerInfo:
    layout: KVLayout
    agent: str
    metadata: bytes
    regions: tuple[tuple[int, int, int], ...]  # (address, length, device id) per layout region
    mem_type: str
    # "host_staged": ``layout``/``regions`` describe the staging pool NIXL moves; the KV cache
    # itself (``device_layout``) stays unregistered (staging.py).
    kv_buffer: str = "device"
    device_layout: KVLayout | None = None
    tp_rank: int = 0  # this side's rank among cache_layout.tp_size
    app: dict | None = field(default=None, hash=False)  # the application's descriptor (app.py)
    # a decode's registered scratch (address, length, device id) of its cache's memory kind:
    # the prefill may WRITE into it at connect (prefill/warm.py); None: none (a prefill's info)
    scratch: tuple[int, int, int] | None = None
    # the connection's frame keys, set on the info a handshake returns (never sent)
    session: frames.Session | None = field(default=None, compare=False, repr=False)
    # seconds of the handshake's first exchange (hello out, challenge in: the prefill only
    # reads and answers), measured by the decode on the info it returns (never sent): one
    # side-channel round trip, which the coalescing model needs (engines/coalesce.py)
    round_trip: float | None = field(default=None, compare=False, repr=False)

    @property
    def cache_layout(self) -> KVLayout:
        """The layout block ids of requests refer to."""
        return self.device_layout or self.layout

    def to_dict(self) -> dict:
        return {
            "layout": self.layout.to_dict(),
            "agent": self.agent,
            "metadata": frames.b64(self.metadata),
            "regions": [list(r) for r in self.regions],
            "mem_type": self.mem_type,
            "kv_buffer": self.kv_buffer,
            "device_layout": self.device_layout.to_dict() if self.device_layout else None,
            "tp_rank": self.tp_rank,
            "app": self.app,
            "scratch": list(self.scratch) if self.scratch is not None else None,
        }

    @classmethod
    def from_dict(cls, data: object) -> "PeerInfo":
        if not isinstance(data, dict):
            raise FrameError("peer info must be an object")
        try:
            layout = KVLayout.from_dict(data.get("layout"))
        except LayoutError as exc:
            raise FrameError(f"peer sent an invalid layout: {exc}") from None
        agent = data.get("agent")
        if not isinstance(agent, str) or not agent:
            raise FrameError("peer info has no agent name")
        mem_type = data.get("mem_type")
        if mem_type not in MEM_TYPES:
            raise FrameError(f"peer memory type {mem_type!r} is not one of {MEM_TYPES}")
        regions = data.get("regions")
        if not isinstance(regions, list) or len(regions) != layout.num_regions:
            raise FrameError(f"peer must describe exactly {layout.num_regions} region(s)")
        out = []
        for r in regions:
            if (not isinstance(r, list) or len(r) != 3
                    or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                               for x in r)):
                raise FrameError(f"peer region {r!r} is not [address, length, device]")
            if r[1] < layout.region_bytes:
                raise FrameError(
                    f"peer region of {r[1]} bytes is smaller than its layout needs "
                    f"({layout.region_bytes})"
                )
            out.append(tuple(r))
        kv_buffer = data.get("kv_buffer", "device")
        if kv_buffer not in ("device", "host_staged"):
            raise FrameError(f"peer kv_buffer {kv_buffer!r} is not 'device' or 'host_staged'")
        device_layout = None
        if kv_buffer == "host_staged":
            try:
                device_layout = KVLayout.from_dict(data.get("device_layout"))
            except LayoutError as exc:
                raise FrameError(f"peer sent an invalid device layout: {exc}") from None
        tp_rank = data.get("tp_rank", 0)
        tp_size = (device_layout or layout).tp_size
        if not isinstance(tp_rank, int) or isinstance(tp_rank, bool) or not 0 <= tp_rank < tp_size:
            raise FrameError(f"peer tp_rank {tp_rank!r} is not within 0..{tp_size - 1}")
        app = _app(data.get("app"))
        return cls(layout, agent, frames.unb64(data.get("metadata"), "metadata"),
                   tuple(out), mem_type, kv_buffer, device_layout, tp_rank, app,
                   _scratch(data.get("scratch")))


MAX_SCRATCH = 4096  # bytes of a peer's scratch we would write at most


def _scratch(data: object) -> tuple[int, int, int] | None:
    """A peer's scratch: None, or [address, length, device] with 1 <= length <= MAX_SCRATCH."""
    if data is None:
        return None
    if (not isinstance(data, list) or len(data) != 3
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in data)
            or not 1 <= data[1] <= MAX_SCRATCH):
        raise FrameError(f"peer scratch {str(data)[:80]} is not [address, length (1 to "
                         f"{MAX_SCRATCH}), device]")
    return tuple(data)


def _app(data: object) -> dict | None:
    try:
        return check_app(data, "peer's app descriptor")
    except LayoutError as exc:
        raise FrameError(str(exc)) from None


class _Transcript:
    """SHA-256 over the canonical JSON of every handshake message (proofs and the protocol
    version left out), in order."""

    def __init__(self):
        self._hash = hashlib.sha256()

    def add(self, message: dict) -> None:
        body = {k: v for k, v in message.items() if k not in ("proof", "v")}
        self._hash.update(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
        self._hash.update(b"\n")

    def proof(self, secret: bytes, tag: bytes) -> str:
        return hmac.new(secret, tag + self._hash.digest(), hashlib.sha256).hexdigest()

    def session(self, secret: bytes | None, decode_side: bool) -> frames.Session:
        """The frame keys of the connection this transcript opened (module doc)."""
        key = hmac.new(secret or b"", b"k" + self._hash.digest(), hashlib.sha256).digest()
        to_prefill, to_decode = (hmac.new(key, d, hashlib.sha256).digest()[:32]
                                 for d in (b"decode->prefill", b"prefill->decode"))
        if decode_side:
            return frames.Session(to_prefill, to_decode)
        return frames.Session(to_decode, to_prefill)


def _proof_ok(got: object, expected: str) -> bool:
    """Constant-time compare; a proof that is not ASCII text is simply wrong."""
    return isinstance(got, str) and got.isascii() and hmac.compare_digest(got, expected)


def check_buffers(ours: "PeerInfo", theirs: "PeerInfo") -> None:
    """Both sides move KV the same way: directly, or through their staging pools."""
    if ours.kv_buffer != theirs.kv_buffer:
        raise IncompatiblePeerError(
            f"peer KV buffer differs: kv_buffer: ours={ours.kv_buffer!r} "
            f"peer={theirs.kv_buffer!r} (both sides must be direct or both host-staged)",
            ["kv_buffer"])
    if ours.device_layout and theirs.device_layout:
        # staged peers may differ in TP size (and layout kind): the model's heads must agree
        # and this decode rank must get some of its heads from that prefill rank
        from ..tp import check_tp_pair

        check_tp_pair(ours.device_layout, theirs.device_layout)


def check_compat(ours: KVLayout, theirs: KVLayout) -> None:
    """Every compatibility field alike, except heads per rank and TP size: those may differ
    when the model's heads agree (mixed TP; which heads a rank takes is checked at connect)."""
    from ..tp import TP_ONLY, tp_differences

    diffs = [d for d in layout_differences(ours, theirs) if d.split(":", 1)[0] not in TP_ONLY]
    fields = [d.split(":", 1)[0] for d in diffs]
    heads = [d for d in tp_differences(ours, theirs) if d.startswith("num_kv_heads x tp_size")]
    if heads:
        diffs += heads
        fields += [f for f in TP_ONLY if getattr(ours, f) != getattr(theirs, f)]
    hint = (" (direct transfers need one block kind on both sides; kv_buffer='host_staged' "
            "pairs any)" if ours.kind != theirs.kind else "")
    if diffs:
        raise IncompatiblePeerError("peer KV layout is incompatible: " + "; ".join(diffs) + hint,
                                    fields)


def _nonce(message: dict) -> bytes:
    nonce = frames.unb64(message.get("nonce"), "nonce")
    if len(nonce) != NONCE_BYTES:
        raise FrameError(f"nonce must be {NONCE_BYTES} bytes")
    return nonce


def serve_handshake(
    sock: socket.socket, local: PeerInfo, secret: bytes | None, timeout: float, admit=None,
    refusal=None,
) -> PeerInfo:
    """Prefill side. Returns the decode peer's info; on any failure sends an error frame
    (when the socket still works) and raises. ``admit(info)`` runs before ``ready`` is sent
    (the server adds the decode's agent there), so a decode that got ``ready`` can be served at
    once. ``refusal()``: why this decode cannot be served whatever it sends (its process, as
    the kernel names it), or None; asked once it proved the secret (a flood of connections
    that cannot costs no look at the kernel's tables) and before our metadata goes. The
    caller closes the socket."""
    transcript = _Transcript()
    session = None  # from the decode's info on, every frame of ours is sealed (errors too)
    try:
        hello = frames.expect(frames.read_frame(sock, timeout), messages.HELLO.type)
        _nonce(hello)  # checked; the transcript carries it into every proof
        try:
            their_layout = KVLayout.from_dict(hello.get("layout"))
        except LayoutError as exc:
            raise FrameError(f"peer sent an invalid layout: {exc}") from None
        transcript.add(hello)
        server_nonce = os.urandom(NONCE_BYTES)
        challenge = messages.CHALLENGE.build(nonce=frames.b64(server_nonce),
                                             auth=secret is not None)
        frames.write_frame(sock, challenge, timeout)
        transcript.add(challenge)
        auth = frames.expect(frames.read_frame(sock, timeout), messages.AUTH.type)
        if secret is not None and not _proof_ok(auth.get("proof"),
                                                transcript.proof(secret, b"c")):
            raise AuthError("peer failed the shared-secret challenge (wrong or no secret)")
        transcript.add(auth)
        try:
            why = refusal() if refusal is not None else None
            if why is not None:
                raise IncompatiblePeerError(why, ["uid"])
            if hello.get("kv_buffer", "device") != local.kv_buffer:
                raise IncompatiblePeerError(
                    f"peer KV buffer differs: kv_buffer: ours={local.kv_buffer!r} peer="
                    f"{hello.get('kv_buffer', 'device')!r} (both sides must be direct or both "
                    f"host-staged)", ["kv_buffer"])
            check_compat(local.layout, their_layout)
            check_same_app(local.app, _app(hello.get("app")))
        except IncompatiblePeerError as exc:
            _send_error(sock, str(exc), "incompatible", exc.fields, timeout)
            raise
        welcome = messages.WELCOME.build(info=local.to_dict())
        transcript.add(welcome)
        welcome["proof"] = transcript.proof(secret, b"s") if secret is not None else ""
        frames.write_frame(sock, welcome, timeout)
        info = frames.expect(frames.read_frame(sock, timeout), messages.INFO.type)
        transcript.add(info)
        if secret is not None and not _proof_ok(info.get("proof"),
                                                transcript.proof(secret, b"i")):
            raise AuthError("the decode's info failed its proof (changed on the way?)")
        session = transcript.session(secret, decode_side=False)
        peer = PeerInfo.from_dict(info.get("info"))
        try:
            check_compat(local.layout, peer.layout)
            check_buffers(local, peer)
            check_same_app(local.app, peer.app)  # ours: the prefill's
        except IncompatiblePeerError as exc:
            _send_error(sock, str(exc), "incompatible", exc.fields, timeout, session)
            raise
        peer = replace(peer, session=session)
        if admit is not None:
            admit(peer)
        frames.write_frame(sock, messages.READY.build(), timeout, session)
        return peer
    except IncompatiblePeerError:
        raise
    except AuthError as exc:
        _send_error(sock, "authentication failed", "auth", [], timeout, session)
        raise exc
    except FrameError as exc:
        _send_error(sock, str(exc), "frame", [], timeout, session)
        raise


def client_handshake(
    sock: socket.socket, local: PeerInfo, secret: bytes | None, timeout: float, admit=None
) -> PeerInfo:
    """Decode side. Returns the prefill peer's info or raises. ``admit(info)`` runs once our
    info is sent, while the prefill admits us, before its ``ready`` is read (the client adds
    the prefill's agent there: the two sides' NIXL work overlaps, not one after the other);
    its info is proved by then (the welcome's proof). A handshake that fails after it raises
    as any other: the caller undoes what ``admit`` did."""
    transcript = _Transcript()
    client_nonce = os.urandom(NONCE_BYTES)
    hello = messages.HELLO.build(layout=local.layout.to_dict(), nonce=frames.b64(client_nonce),
                                 kv_buffer=local.kv_buffer, app=local.app)
    sent = time.perf_counter()
    frames.write_frame(sock, hello, timeout)
    transcript.add(hello)
    challenge = _expect_or_raise(frames.read_frame(sock, timeout), messages.CHALLENGE.type)
    round_trip = time.perf_counter() - sent
    _nonce(challenge)
    transcript.add(challenge)
    if challenge.get("auth") and secret is None:
        raise AuthError("peer requires a shared secret and none was configured")
    if secret is not None and not challenge.get("auth"):
        raise AuthError("a shared secret is configured but the peer does not authenticate")
    auth = messages.AUTH.build(proof=transcript.proof(secret, b"c") if secret is not None else "")
    frames.write_frame(sock, auth, timeout)
    transcript.add(auth)
    welcome = _expect_or_raise(frames.read_frame(sock, timeout), messages.WELCOME.type)
    transcript.add(welcome)
    if secret is not None and not _proof_ok(welcome.get("proof"),
                                            transcript.proof(secret, b"s")):
        raise AuthError("peer did not prove it knows the shared secret, or what it sent was "
                        "changed on the way")
    peer = PeerInfo.from_dict(welcome.get("info"))
    check_buffers(local, peer)
    check_compat(local.layout, peer.layout)
    check_same_app(peer.app, local.app)  # the prefill's, ours
    info = messages.INFO.build(info=local.to_dict())
    transcript.add(info)
    info["proof"] = transcript.proof(secret, b"i") if secret is not None else ""
    frames.write_frame(sock, info, timeout)
    session = transcript.session(secret, decode_side=True)
    if admit is not None:
        admit(peer)
    _expect_or_raise(frames.read_frame(sock, timeout, session=session, unsealed_error=True),
                     messages.READY.type)
    return replace(peer, session=session, round_trip=round_trip)


def _expect_or_raise(message: dict, type_: str) -> dict:
    if messages.ERROR.is_(message):
        code, text = message.get("code"), str(message.get("message", "no reason given"))
        if code == "incompatible":
            fields = message.get("fields")
            # the prefill's words: its "ours" is the prefill, its "peer" this decode
            sides = " (ours: the prefill's, peer: this decode's)" if "ours=" in text else ""
            raise IncompatiblePeerError(
                f"the prefill refused the connection: {text}{sides}",
                [f for f in fields if isinstance(f, str)] if isinstance(fields, list) else [])
        if code == "auth":
            raise AuthError(f"peer refused: {text}")
        raise PeerError(f"peer refused: {text}")
    return frames.expect(message, type_)


def _send_error(sock, text: str, code: str, fields: list, timeout: float,
                session: frames.Session | None = None) -> None:
    try:
        frames.write_frame(sock, messages.ERROR.build(code=code, message=text, fields=fields),
                           min(timeout, 1.0), session)
    except KVRuntimeError:
        pass  # the peer is gone; the caller closes the socket anyway


def connect(host: str, port: int, timeout: float, attempts: int = 8) -> socket.socket:
    """TCP connect with exponential backoff (a prefill that is still starting refuses)."""
    deadline = time.monotonic() + timeout
    delay = 0.02
    last: Exception | None = None
    for _ in range(max(1, attempts)):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            sock = _open(host, port, left)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as exc:
            last = exc
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay *= 2
    raise HandshakeTimeout(
        f"could not connect to prefill at {host}:{port} within {timeout:.1f}s: {last}"
    )


def _open(host: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection; an IP literal skips the resolver (``create_connection`` calls
    getaddrinfo, whose first call in a process loads the NSS modules: ~1 ms measured, a
    twentieth of the handshake budget)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        socket.inet_pton(family, host)
    except OSError:
        return socket.create_connection((host, port), timeout=timeout)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return sock
