"""Side-channel frames: a fixed header, then a JSON object.

Header: 4 magic bytes ``KVRT`` and a big-endian u32 payload length. The length is checked
against the maximum *before* any payload is read or allocated. The payload is a UTF-8 JSON
object (typed, never pickle) with the protocol version ``v`` and a message ``type``; small
bytes (tokens, handles) travel as base64 text. Block id lists and runs travel *packed*: raw
little-endian int64 after the JSON, past a NUL byte (JSON text never holds one), each named
in the JSON by its ``[offset, length]`` there. 4096 ids as JSON numbers took ~2 ms to encode
and ~1.7 ms to parse on a 2-core host; as base64 text in the JSON ~250 µs each way; packed,
a few µs. Every malformed input raises ``FrameError``; nothing else escapes the decoder.

After the handshake every frame is authenticated (``Session``): its JSON ends with a ``mac``
field, a keyed BLAKE2b tag (16 bytes, hex) over the frame's payload without that field and the
sender's frame count, under a key of the sending direction derived from the handshake (the
secret and the whole transcript, handshake.py). The count is never sent: a frame changed,
forged, replayed, reordered or dropped on the way fails its tag, and the connection ends.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import socket
import struct
import time

import numpy as np

from ..errors import FrameError, PeerError, ProtocolVersionError
from ..numbers import finite
from . import messages

MAGIC = b"KVRT"
HEADER = struct.Struct(">4sI")
# 2: handshake proofs cover the whole transcript; asynchronous push/cancel/release.
# 3: block ids travel packed (pack_ids), not as JSON lists.
# 4: a push may name its blocks by runs (pack_runs) where that is shorter than its ids.
# 5: a release names a list of requests (a same-node batch's, in one frame).
# 6: no NIXL notifications: a pull's READ is released by a frame, and a push is proved by the
#    prefill's reply, sent once NIXL has flushed its WRITE (remote completion).
# 7: a push the prefill starts: the decode names where a request's blocks go ("expect"), the
#    prefill WRITEs them once it has them, and the WRITE's NIXL notification (a "pushed"
#    message) tells the decode they landed. Nothing else carries notifications.
# 8: a same-node decode that opened the prefill's memory names its blocks with "copy": the
#    prefill sends the request's source ids when ready (a "ready" frame), the decode copies
#    them itself and releases them as a pull's. Block ids and runs travel packed, after the
#    JSON (Packed), not as base64 text inside it.
# 9: a ready names its source blocks as spans (first id, count) where those are fewer than
#    its ids (src_spans).
# 10: a same-node prefill also writes each ready into a ring in its memory that the decode reads
#     as it polls (mailbox.py: the offer's "mailbox"); the ready's frame says so ("ring").
# 11: every frame after the handshake carries a MAC over it and its sequence number, and every
#     NIXL notification a MAC of its own (Session).
# 12: the hello and each side's info carry the application's descriptor ("app": a flat object
#     of scalars, or null, app.py), which must match as the layout must.
# 13: a push the decode asks for is answered as one the prefill starts: by its WRITE's NIXL
#     notification (a "pushed"), never a frame; a frame answers only a push that failed. A
#     direct decode's info names a registered scratch ("scratch") that the prefill WRITEs at
#     its connect (prefill/warm.py).
# 14: each "push" and "expect" frame numbers its push ("number", one count a connection), and
#     its WRITE's notification names that number: a notification replayed from an earlier push
#     of the same request id (ids are the caller's and may come again) finishes nothing. A
#     prefill that WRITEs into a decode's scratch at its connect also sends it a "warm"
#     notification, which the decode drops.
PROTOCOL_VERSION = 14
MAX_NOTIF = 1024  # bytes of a NIXL notification we read at most (a "pushed" message)
ID = np.dtype("<i8")
DEFAULT_MAX_FRAME = 16 * 1024 * 1024


TAIL = b"\0"  # between a frame's JSON and its packed bytes


class Packed(bytes):
    """Bytes a frame carries after its JSON, not inside it (``pack_ids``, ``pack_runs``)."""


class Message(dict):
    """A frame's JSON object; ``tail``: the bytes after it, which its packed fields name."""

    tail = b""


# made once: json.dumps with options builds an encoder a call (3 of a small frame's 6 µs)
_ENCODE = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


def _json(message: dict) -> bytes:
    return _ENCODE({"v": PROTOCOL_VERSION, **message}).encode()


def _payload(message: dict) -> bytes:
    """A message as a frame's (or a notification's) payload: compact JSON with ``v``, then,
    where it has Packed fields, a NUL and their bytes, each field naming its [offset, length]."""
    packed = [name for name, value in message.items() if type(value) is Packed]
    if not packed:
        return _json(message)
    doc, tail, at = dict(message), [], 0
    for name in packed:
        doc[name] = [at, len(message[name])]
        tail.append(message[name])
        at += len(message[name])
    return b"".join((_json(doc), TAIL, *tail))


def encode_payload(message: dict) -> bytes:
    """A message as a frame's payload, without the header (a same-node ring's record:
    mailbox.py); ``parse_payload`` reads it back."""
    return _payload(message)


MAC_BYTES = 16
LONG_PAYLOAD = 4096  # bytes from which a payload is hashed with SHA-256 before its MAC
_SEQ = struct.Struct(">Q")
_MAC_OPEN, _MAC_CLOSE = b',"mac":"', b'"}'
_MAC_SUFFIX = len(_MAC_OPEN) + 2 * MAC_BYTES + len(_MAC_CLOSE)


class Session:
    """The keys and frame counts of one authenticated connection, one key a direction
    (handshake.py derives them). ``seal`` and ``check`` run under the sender's lock and in the
    one reading thread, as frames are written and read."""

    def __init__(self, send_key: bytes, recv_key: bytes):
        # keyed once: a copy of a keyed hasher costs ~0.2 µs, keying one ~1 µs (2-core host)
        self._send_key, self._recv_key = (hashlib.blake2b(key=k, digest_size=MAC_BYTES)
                                          for k in (send_key, recv_key))
        # NIXL notifications (a push's WRITE landed) travel beside the frames, unordered
        # with them: keys of their own, no count (the request id and the push's number they
        # name, protocol 14, are what they match)
        self._notif_send, self._notif_recv = (
            hashlib.blake2b(key=k, digest_size=MAC_BYTES, person=b"kvr-notif")
            for k in (send_key, recv_key))
        self._sent = self._received = 0

    def seal_notif(self, payload: bytes) -> bytes:
        return _with_tag(payload, self._tag(self._notif_send, 0, payload))

    def check_notif(self, payload: bytes) -> bytes:
        """A notification's payload without its tag; FrameError when it fails."""
        bare, got = _without_tag(payload, "notification")
        if not hmac.compare_digest(got, self._tag(self._notif_recv, 0, bare)):
            raise FrameError("notification failed its MAC (forged or changed on the way)")
        return bare

    @staticmethod
    def _tag(keyed, seq: int, payload: bytes) -> bytes:
        """Keyed BLAKE2b over the count and the payload; a long payload through SHA-256 first
        (the CPU's SHA instructions hash 64 KiB in ~46 µs where BLAKE2b takes ~86 on the 2-core
        host; BLAKE2b is the cheaper for the short frames most requests send)."""
        h = keyed.copy()
        if len(payload) > LONG_PAYLOAD:
            h.update(b"L" + _SEQ.pack(seq) + hashlib.sha256(payload).digest())
        else:
            h.update(b"S" + _SEQ.pack(seq) + payload)  # S/L: a short payload is never a digest
        return h.hexdigest().encode()

    def seal(self, payload: bytes) -> bytes:
        """``payload`` with its tag as the JSON's last field (before any packed bytes)."""
        tag = self._tag(self._send_key, self._sent, payload)
        self._sent += 1
        return _with_tag(payload, tag)

    def check(self, payload: bytes) -> bytes:
        """The payload without its tag, once the tag is the next one expected; FrameError."""
        seq = self._received
        bare, got = _without_tag(payload, "a frame after the handshake")
        if not hmac.compare_digest(got, self._tag(self._recv_key, seq, bare)):
            raise FrameError(f"frame {seq} after the handshake failed its MAC: changed, forged, "
                             f"replayed, reordered or dropped on the way")
        self._received = seq + 1
        return bare


def _with_tag(payload: bytes, tag: bytes) -> bytes:
    """``payload`` with ``tag`` as its JSON's last field, "mac" (before any packed bytes)."""
    cut = payload.find(TAIL)
    cut = len(payload) if cut < 0 else cut
    return b"".join((payload[:cut - 1], _MAC_OPEN, tag, _MAC_CLOSE, payload[cut:]))


def _without_tag(payload: bytes, what: str) -> tuple[bytes, bytes]:
    """(the payload as it was sealed, its tag); FrameError naming ``what`` when it has none."""
    cut = payload.find(TAIL)
    if cut < 0:
        cut = len(payload)
    start = cut - _MAC_SUFFIX  # where the tag's field begins
    if start <= 0 or not payload.startswith(_MAC_OPEN, start) \
            or not payload.startswith(_MAC_CLOSE, cut - 2):
        raise FrameError(f"{what} carries no MAC")
    return (payload[:start] + b"}" + payload[cut:],
            payload[start + len(_MAC_OPEN):cut - len(_MAC_CLOSE)])


def encode_frame(message: dict, max_size: int = DEFAULT_MAX_FRAME,
                 session: Session | None = None) -> bytes:
    payload = _payload(message)
    if session is not None:
        payload = session.seal(payload)
    if len(payload) > max_size:
        raise FrameError(f"frame of {len(payload)} bytes exceeds the maximum of {max_size}")
    return HEADER.pack(MAGIC, len(payload)) + payload


def parse_header(header: bytes, max_size: int = DEFAULT_MAX_FRAME) -> int:
    """Payload length announced by ``header``; refuses bad magic and oversize frames."""
    if len(header) != HEADER.size:
        raise FrameError(f"truncated frame header: {len(header)} of {HEADER.size} bytes")
    magic, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise FrameError(f"bad frame magic {magic!r} (expected {MAGIC!r}): not a kvruntime peer")
    if length > max_size:
        raise FrameError(f"frame announces {length} bytes, more than the maximum of {max_size}")
    return length


def _no_constant(name: str):
    """Python's JSON reads NaN and Infinity, which JSON has not and our encoder never writes:
    a peer's number is finite."""
    raise ValueError(f"{name} is not a JSON number")


def parse_payload(payload: bytes) -> Message:
    cut = payload.find(TAIL)
    text, tail = (payload, b"") if cut < 0 else (payload[:cut], payload[cut + 1:])
    try:
        message = json.loads(text.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FrameError(f"frame payload is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(message, dict):
        raise FrameError(f"frame payload is a JSON {type(message).__name__}, not an object")
    version = message.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolVersionError(
            f"peer speaks side-channel protocol version {version!r}; "
            f"this kvruntime speaks {PROTOCOL_VERSION}: upgrade the older side"
        )
    if not isinstance(message.get("type"), str):
        raise FrameError("frame has no string 'type' field")
    out = Message(message)
    out.tail = tail
    return out


def decode_frame(data: bytes, max_size: int = DEFAULT_MAX_FRAME) -> dict:
    """Decode one whole frame held in memory (used by tests and fuzzing)."""
    length = parse_header(data[: HEADER.size], max_size)
    payload = data[HEADER.size:]
    if len(payload) != length:
        raise FrameError(f"frame announces {length} payload bytes but carries {len(payload)}")
    return parse_payload(payload)


def encode_notif(message: dict, session: Session | None = None) -> bytes:
    """A message for a NIXL notification: the payload of a frame, with no header (NIXL
    delivers it whole), sealed with ``session``'s notification key, at most ``MAX_NOTIF``
    bytes."""
    payload = _payload(message)
    if session is not None:
        payload = session.seal_notif(payload)
    if len(payload) > MAX_NOTIF:
        raise FrameError(f"notification of {len(payload)} bytes exceeds {MAX_NOTIF}")
    return payload


def parse_notif(raw, session: Session | None = None) -> dict:
    """A NIXL notification's message, checked against ``session``'s MAC and as a frame's
    payload; FrameError otherwise."""
    if not isinstance(raw, (bytes, bytearray)):
        raise FrameError(f"notification is {type(raw).__name__}, not bytes")
    if len(raw) > MAX_NOTIF:
        raise FrameError(f"notification of {len(raw)} bytes exceeds {MAX_NOTIF}")
    raw = bytes(raw)
    return parse_payload(raw if session is None else session.check_notif(raw))


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerError(f"peer sent {len(buf)} of {n} expected bytes before the timeout")
            sock.settimeout(left)
        try:
            chunk = sock.recv(min(n - len(buf), 1 << 20))
        except socket.timeout:
            if deadline is None:
                # No deadline: the socket's timeout is a sender's (another thread's
                # write_frame sets it), not ours; an idle peer is not a failed one.
                continue
            raise PeerError(
                f"peer sent {len(buf)} of {n} expected bytes before the timeout"
            ) from None
        except OSError as exc:
            raise PeerError(f"side channel failed: {exc}") from None
        if not chunk:
            raise PeerError(
                "peer closed the side channel"
                + (f" after {len(buf)} of {n} bytes (truncated frame)" if buf else "")
            )
        buf += chunk
    return bytes(buf)


def read_frame(
    sock: socket.socket, timeout: float | None, max_size: int = DEFAULT_MAX_FRAME,
    session: Session | None = None, unsealed_error: bool = False,
) -> dict:
    """The next frame; with ``session``, checked against its MAC before it is parsed.
    ``unsealed_error``: an "error" frame without a MAC is returned too (the handshake's last
    answer: a peer that refused before it had keys; it can only end the connection)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    length = parse_header(_recv_exact(sock, HEADER.size, deadline), max_size)
    payload = _recv_exact(sock, length, deadline)
    if session is None:
        return parse_payload(payload)
    try:
        return parse_payload(session.check(payload))
    except FrameError:
        if not unsealed_error:
            raise
        message = parse_payload(payload)
        if not messages.ERROR.is_(message) or "mac" in message:
            raise
        return message


def write_frame(sock: socket.socket, message: dict, timeout: float | None = None,
                session: Session | None = None) -> None:
    """Send ``message``; with ``session``, sealed with its MAC (under the caller's send lock:
    the frame count must follow the order frames go out)."""
    data = encode_frame(message, session=session)
    try:
        sock.settimeout(timeout)  # EBADF once another thread closed the socket
        sock.sendall(data)
    except OSError as exc:
        raise PeerError(f"side channel failed while sending {message.get('type')!r}: "
                        f"{exc}") from None


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: object, what: str) -> bytes:
    if not isinstance(text, str):
        raise FrameError(f"{what} must be base64 text")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise FrameError(f"{what} is not valid base64") from None


def pack_ids(ids) -> Packed:
    """Block ids (an integer numpy array) for a frame: little-endian int64, packed."""
    return Packed(np.ascontiguousarray(ids, dtype=ID).tobytes())


def ids_field(message: dict, name: str) -> np.ndarray:
    """A frame's packed block ids as int64 (values unchecked: the planner checks them against
    the layout), or FrameError naming what is wrong."""
    return np.frombuffer(_packed(message, name, ID.itemsize, "block ids"),
                         dtype=ID).astype(np.int64)


def pack_runs(src, dst, count) -> Packed:
    """A request's runs (source starts, destination starts, block counts: equal-length integer
    arrays) for a frame: the three little-endian int64 arrays one after another, packed."""
    return Packed(np.ascontiguousarray(np.stack((src, dst, count)), dtype=ID).tobytes())


def runs_field(message: dict, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A frame's packed runs as three int64 arrays (values unchecked: the planner checks them),
    or FrameError naming what is wrong."""
    raw = _packed(message, name, 3 * ID.itemsize, f"runs of three {ID.itemsize}-byte integers")
    src, dst, count = np.frombuffer(raw, dtype=ID).astype(np.int64).reshape(3, -1)
    return src, dst, count


def pack_spans(starts, counts) -> Packed:
    """Block ids as spans (first id, count: equal-length integer arrays) for a frame: the two
    little-endian int64 arrays one after the other, packed."""
    return Packed(np.ascontiguousarray(np.stack((starts, counts)), dtype=ID).tobytes())


def spans_field(message: dict, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A frame's packed spans as two int64 arrays (values unchecked: the reader bounds them),
    or FrameError naming what is wrong."""
    raw = _packed(message, name, 2 * ID.itemsize, f"spans of two {ID.itemsize}-byte integers")
    starts, counts = np.frombuffer(raw, dtype=ID).astype(np.int64).reshape(2, -1)
    return starts, counts


def _packed(message: dict, name: str, unit: int, what: str) -> bytes:
    """The bytes a packed field names in its frame's tail: [offset, length] within it, whole
    ``unit``-byte items."""
    ref, tail = message.get(name), getattr(message, "tail", b"")
    where = f"{message.get('type')!r} frame field {name!r}"
    if not (isinstance(ref, list) and len(ref) == 2 and all(type(v) is int and v >= 0
                                                            for v in ref)):
        raise FrameError(f"{where} must name packed bytes as [offset, length], got "
                         f"{repr(ref)[:80]}")
    at, n = ref
    if at + n > len(tail):
        raise FrameError(f"{where} names bytes {at}..{at + n} of a frame that packs "
                         f"{len(tail)}")
    if n % unit:
        raise FrameError(f"{where} holds {n} bytes, not whole {what}")
    return tail[at:at + n]


def expect(message: dict, type_: str) -> dict:
    """``message`` if it has ``type_``; a peer error frame becomes PeerError."""
    got = message.get("type")
    if got == messages.ERROR.type:
        raise PeerError(f"peer refused: {message.get('message', 'no reason given')}")
    if got != type_:
        raise FrameError(f"expected a {type_!r} frame, got {got!r}")
    return message


def names_field(message: dict, name: str) -> list[str]:
    """A frame's list of request ids: at least one, each a non-empty string of at most 256
    characters (what a decode accepts as a request id), or FrameError naming what is wrong."""
    names = field(message, name, list)
    bad = next((n for n in names if not isinstance(n, str) or not 0 < len(n) <= 256), None)
    if not names or bad is not None:
        raise FrameError(f"{message.get('type')!r} frame field {name!r} must list request ids "
                         f"(strings of 1-256 characters), got "
                         f"{'none' if not names else repr(bad)[:80]}")
    return names


def field(message: dict, name: str, kind: type | tuple[type, ...]) -> object:
    """A typed field of ``message``, or FrameError naming what is wrong."""
    value = message.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        kinds = kind if isinstance(kind, tuple) else (kind,)
        raise FrameError(
            f"{message.get('type')!r} frame field {name!r} must be "
            f"{' or '.join(k.__name__ for k in kinds)}, got {type(value).__name__}"
        )
    return value


_REQUIRED = object()


def integer(message: dict, name: str, low: int, high: int, default=_REQUIRED) -> int:
    """An integer field of ``message`` with ``low <= value < high`` (``default`` where the
    field is absent and one is given), or FrameError naming what is wrong."""
    if default is not _REQUIRED and name not in message:
        return default
    value = field(message, name, int)
    if not low <= value < high:
        raise FrameError(f"{message.get('type')!r} frame field {name!r} must be an integer in "
                         f"{low}..{_bound(high - 1)}, got {str(value)[:24]}")
    return value


def seconds(message: dict, name: str, positive: bool = False) -> float:
    """A finite number field of ``message`` (a time or a duration, in seconds; above 0 if
    ``positive``) as a float, or FrameError naming what is wrong."""
    value = field(message, name, (int, float))
    out = finite(value)  # numbers.py
    if out is None or positive and not out > 0:
        raise FrameError(f"{message.get('type')!r} frame field {name!r} must be a finite "
                         f"{'positive ' if positive else ''}number of seconds, got "
                         f"{str(value)[:24]}")
    return out


def _bound(n: int) -> str:
    """A range's last value as a reader checks it: 2**63-1, not 9223372036854775807."""
    k = n.bit_length()
    return f"2**{k}-1" if k > 16 and n == (1 << k) - 1 else str(n)
