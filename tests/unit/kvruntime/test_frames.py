"""Frame decoder: every malformed input is a FrameError, nothing else, and nothing hangs."""

import json
import random
import socket
import struct
import threading

import pytest

from kvruntime.errors import FrameError, PeerError, ProtocolVersionError
from kvruntime.wire import frames


def test_roundtrip():
    msg = {"type": "hello", "x": [1, 2], "blob": frames.b64(b"\x00\xff")}
    out = frames.decode_frame(frames.encode_frame(msg))
    assert out["v"] == frames.PROTOCOL_VERSION and out["x"] == [1, 2]
    assert frames.unb64(out["blob"], "blob") == b"\x00\xff"


def _raw(payload: bytes, length=None, magic=frames.MAGIC) -> bytes:
    return struct.pack(">4sI", magic, len(payload) if length is None else length) + payload


@pytest.mark.parametrize("data,msg", [
    (_raw(b"{}", magic=b"HTTP"), "bad frame magic"),
    (_raw(b"", length=1 << 30), "more than the maximum"),
    (_raw(b'{"v":1,"type":"x"', length=100), "announces 100"),
    (_raw(b"\xff\xfe"), "not valid UTF-8 JSON"),
    (_raw(b"[1,2]"), "not an object"),
    (_raw(b'{"v":%d}' % frames.PROTOCOL_VERSION), "no string 'type'"),
    (b"KVR", "truncated frame header"),
    (_raw(b'{"v":%d,"type":"push","timeout":NaN}' % frames.PROTOCOL_VERSION),
     "NaN is not a JSON number"),
    (_raw(b'{"v":%d,"type":"push","deadline":-Infinity}' % frames.PROTOCOL_VERSION),
     "-Infinity is not a JSON number"),
])
def test_malformed(data, msg):
    with pytest.raises(FrameError, match=msg):
        frames.decode_frame(data)


@pytest.mark.parametrize("value,low,high,why", [
    (None, 1, 8, "must be int, got NoneType"),
    (True, 0, 8, "must be int, got bool"),
    (2.0, 1, 8, "must be int, got float"),
    (0, 1, 8, "must be an integer in 1..7, got 0"),
    (8, 1, 8, "must be an integer in 1..7, got 8"),
    (1 << 63, 1, 1 << 63, r"must be an integer in 1..2\*\*63-1, got 9223372036854775808"),
    (10 ** 400, 0, 1 << 31, r"must be an integer in 0..2\*\*31-1, got 10{23}$"),  # cut
], ids=["missing", "bool", "float", "low", "high", "2**63", "10**400"])
def test_an_integer_field_out_of_its_range_is_a_frame_error(value, low, high, why):
    message = {"type": "push"} if value is None else {"type": "push", "n": value}
    with pytest.raises(FrameError, match="'push' frame field 'n' " + why):
        frames.integer(message, "n", low, high)


def test_an_integer_field_absent_takes_its_default_and_present_is_checked():
    assert frames.integer({"type": "push"}, "split", 1, 9, default=1) == 1
    assert frames.integer({"type": "push", "split": 8}, "split", 1, 9, default=1) == 8
    with pytest.raises(FrameError, match="in 1..8, got 0"):
        frames.integer({"type": "push", "split": 0}, "split", 1, 9, default=1)


@pytest.mark.parametrize("value,positive,why", [
    ("5", False, "must be int or float, got str"),
    (False, False, "must be int or float, got bool"),
    (10 ** 400, False, "must be a finite number of seconds, got 10{23}$"),
    (float("inf"), False, "must be a finite number of seconds, got inf"),
    (0, True, "must be a finite positive number of seconds, got 0"),
    (-2.5, True, "must be a finite positive number of seconds, got -2.5"),
], ids=["text", "bool", "10**400", "inf", "zero", "negative"])
def test_a_seconds_field_is_a_finite_number(value, positive, why):
    with pytest.raises(FrameError, match="'push' frame field 't' " + why):
        frames.seconds({"type": "push", "t": value}, "t", positive=positive)
    assert frames.seconds({"type": "push", "t": 3}, "t", positive=True) == 3.0
    assert frames.seconds({"type": "push", "t": -1e9}, "t") == -1e9


def _packed_frame(name: str, ref, tail: bytes) -> "frames.Message":
    """A frame whose field ``name`` names ``ref`` in a packed tail of ``tail`` bytes."""
    head = json.dumps({"v": frames.PROTOCOL_VERSION, "type": "push", name: ref}).encode()
    return frames.decode_frame(_raw(head + frames.TAIL + tail))


def test_block_ids_travel_packed_and_come_back_exact():
    import numpy as np

    ids = np.array([0, 7, 2**40, -3, 4095], dtype=np.int64)
    data = frames.encode_frame({"type": "push", "src": frames.pack_ids(ids), "n": 1})
    assert ids.tobytes() in data  # raw after the JSON, not base64 inside it
    out = frames.decode_frame(data)
    assert out["src"] == [0, 40] and out["n"] == 1
    got = frames.ids_field(out, "src")
    assert got.dtype == np.int64 and got.tolist() == ids.tolist()
    got[0] = 1  # a writable copy, not a view of the frame's bytes
    empty = frames.decode_frame(frames.encode_frame({"type": "push", "src": frames.pack_ids([])}))
    assert frames.ids_field(empty, "src").size == 0
    # two packed fields share one tail, each naming its own bytes
    two = frames.decode_frame(frames.encode_frame(
        {"type": "push", "src": frames.pack_ids([1, 2]), "dst": frames.pack_ids([3, 4])}))
    assert frames.ids_field(two, "src").tolist() == [1, 2]
    assert frames.ids_field(two, "dst").tolist() == [3, 4]


@pytest.mark.parametrize("ref,tail,msg", [
    ("AQIDBA==", b"", "must name packed bytes"),  # base64 text: protocol 7's form
    ([1, 2, 3], b"\0" * 24, "must name packed bytes"),
    ([0, True], b"\0" * 8, "must name packed bytes"),
    ([-8, 8], b"\0" * 8, "must name packed bytes"),
    (None, b"", "must name packed bytes"),
    ([8, 16], b"\0" * 16, "names bytes 8..24 of a frame that packs 16"),
    ([0, 8], b"", "of a frame that packs 0"),
    ([0, 12], b"\1" * 12, "not whole block ids"),
])
def test_malformed_block_ids_are_frame_errors(ref, tail, msg):
    with pytest.raises(FrameError, match=msg):
        frames.ids_field(_packed_frame("src", ref, tail), "src")


def test_a_field_a_peer_forged_as_a_dict_has_no_tail():
    """Packed bytes are only ever read from a frame's own tail: a plain dict has none."""
    with pytest.raises(FrameError, match="frame that packs 0"):
        frames.ids_field({"type": "push", "src": [0, 8]}, "src")


def test_runs_travel_packed_and_come_back_exact():
    import numpy as np

    src, dst, count = np.array([0, 9, 2**40]), np.array([5, 1, 3]), np.array([4, 1, 2])
    out = frames.decode_frame(
        frames.encode_frame({"type": "push", "runs": frames.pack_runs(src, dst, count)})
    )
    got = frames.runs_field(out, "runs")
    assert [a.tolist() for a in got] == [src.tolist(), dst.tolist(), count.tolist()]
    assert all(a.dtype == np.int64 for a in got)


@pytest.mark.parametrize("ref,tail,msg", [
    ([0, 16], b"\1" * 16, "not whole runs of three 8-byte integers"),
    ([[1, 2, 3]], b"", "must name packed bytes"),
])
def test_malformed_runs_are_frame_errors(ref, tail, msg):
    with pytest.raises(FrameError, match=msg):
        frames.runs_field(_packed_frame("runs", ref, tail), "runs")


def test_spans_travel_packed_and_come_back_exact():
    import numpy as np

    from kvruntime.plan import spans_ids

    starts, counts = np.array([7, 0, 2**40]), np.array([3, 1, 2])
    out = frames.decode_frame(frames.encode_frame({"type": "ready",
                                                   "src_spans": frames.pack_spans(starts, counts)}))
    got = frames.spans_field(out, "src_spans")
    assert [a.tolist() for a in got] == [starts.tolist(), counts.tolist()]
    assert spans_ids(*got).tolist() == [7, 8, 9, 0, 2**40, 2**40 + 1]
    assert spans_ids(*got).dtype == np.int64


@pytest.mark.parametrize("ref,tail,msg", [
    ([0, 24], b"\1" * 24, "not whole spans of two 8-byte integers"),
    ([0, 32], b"\1" * 16, "names bytes 0..32 of a frame that packs 16"),
])
def test_malformed_spans_are_frame_errors(ref, tail, msg):
    with pytest.raises(FrameError, match=msg):
        frames.spans_field(_packed_frame("src_spans", ref, tail), "src_spans")


def test_wrong_version_is_named():
    with pytest.raises(ProtocolVersionError, match="version 99"):
        frames.decode_frame(_raw(json.dumps({"v": 99, "type": "hello"}).encode()))


def test_pickle_is_not_accepted():
    import pickle

    with pytest.raises(FrameError):
        frames.decode_frame(_raw(pickle.dumps({"v": 1, "type": "hello"})))


def test_oversize_refused_before_reading_payload():
    a, b = socket.socketpair()
    try:
        a.sendall(struct.pack(">4sI", frames.MAGIC, 1 << 31))  # and no payload at all
        with pytest.raises(FrameError, match="more than the maximum"):
            frames.read_frame(b, timeout=1.0, max_size=1024)
    finally:
        a.close(), b.close()


def test_truncated_on_socket_is_peer_error():
    a, b = socket.socketpair()
    try:
        a.sendall(frames.encode_frame({"type": "x"})[:-3])
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(PeerError, match="truncated"):
            frames.read_frame(b, timeout=1.0)
    finally:
        a.close(), b.close()


def test_silent_peer_times_out():
    a, b = socket.socketpair()
    try:
        a.sendall(frames.encode_frame({"type": "x"})[:5])
        with pytest.raises(PeerError, match="before the timeout"):
            frames.read_frame(b, timeout=0.2)
    finally:
        a.close(), b.close()


def test_fuzz_decoder_10000_frames():
    """>= 10,000 random and mutated frames: only FrameError, never a crash or a hang."""
    rnd = random.Random(20240601)
    good = frames.encode_frame({"type": "hello", "layout": {"kind": "cross_layer"},
                                "nonce": frames.b64(bytes(32))})
    outcomes = {"ok": 0, "error": 0}
    for i in range(12000):
        mode = i % 4
        if mode == 0:  # random bytes
            data = bytes(rnd.getrandbits(8) for _ in range(rnd.randint(0, 64)))
        elif mode == 1:  # bit flips in a good frame
            data = bytearray(good)
            for _ in range(rnd.randint(1, 4)):
                data[rnd.randrange(len(data))] ^= 1 << rnd.randrange(8)
            data = bytes(data)
        elif mode == 2:  # truncation or extension
            cut = rnd.randint(0, len(good) + 8)
            data = (good + bytes(8))[:cut]
        else:  # valid header, random JSON-ish payload
            payload = rnd.choice([b"{", b"null", b'{"v":1,"type":5}', b'{"v":"1"}',
                                  b"[" * 5000, b'{"v":1,"type":"x","a":' + b"[" * 3000,
                                  bytes(rnd.getrandbits(8) for _ in range(32))])
            data = _raw(payload)
        try:
            frames.decode_frame(data, max_size=4096)
            outcomes["ok"] += 1
        except FrameError:
            outcomes["error"] += 1
    assert sum(outcomes.values()) == 12000
    assert outcomes["error"] > 10000


def test_fuzz_over_a_socket_never_hangs():
    """Random garbage streamed at read_frame ends in a FrameError/PeerError within its timeout."""
    rnd = random.Random(7)
    for _ in range(200):
        a, b = socket.socketpair()
        data = bytes(rnd.getrandbits(8) for _ in range(rnd.randint(0, 40)))
        t = threading.Thread(target=lambda: (a.sendall(data), a.shutdown(socket.SHUT_WR)))
        t.start()
        with pytest.raises((FrameError, PeerError)):
            frames.read_frame(b, timeout=1.0, max_size=1 << 16)
        t.join()
        a.close(), b.close()


def test_a_release_names_request_ids():
    assert frames.names_field({"type": "release", "requests": ["a", "b" * 256]}, "requests") == [
        "a", "b" * 256]
    for bad, line in [([], "got none"), (["a", ""], "got ''"), (["a", 7], "got 7"),
                      (["x" * 257], "got 'xxx"), ("a", "must be list")]:
        with pytest.raises(FrameError, match=line):
            frames.names_field({"type": "release", "requests": bad}, "requests")


def test_notifications_are_frame_payloads_bounded_and_versioned():
    raw = frames.encode_notif({"type": "pushed", "request": "r1", "posted": 1.5})
    assert frames.parse_notif(raw) == {"type": "pushed", "request": "r1", "posted": 1.5,
                                       "v": frames.PROTOCOL_VERSION}
    with pytest.raises(FrameError, match="exceeds"):
        frames.encode_notif({"type": "pushed", "request": "x" * frames.MAX_NOTIF})
    for bad, why in ((b"x" * (frames.MAX_NOTIF + 1), "exceeds"), ("text", "not bytes"),
                     (b"\xff", "not valid UTF-8"), (b"[]", "not an object")):
        with pytest.raises(FrameError, match=why):
            frames.parse_notif(bad)
    with pytest.raises(ProtocolVersionError):
        frames.parse_notif(b'{"v":6,"type":"pushed","request":"r"}')


def _sessions():
    import os

    a, b = os.urandom(32), os.urandom(32)
    return frames.Session(a, b), frames.Session(b, a)


def test_sealed_frames_round_trip_with_packed_ids():
    import numpy as np

    out, back = _sessions()
    for n in (1, 5000):  # a short payload, and one past LONG_PAYLOAD (hashed first)
        message = {"type": "push", "request": "r", "src": frames.pack_ids(np.arange(n))}
        got = frames.parse_payload(back.check(out.seal(frames._payload(message))))
        assert got["type"] == "push" and "mac" not in got
        assert frames.ids_field(got, "src").tolist() == list(range(n))


@pytest.mark.parametrize("attack", ["flip_json", "flip_tail", "replay", "reorder", "drop",
                                    "other_direction", "strip"])
def test_a_frame_changed_replayed_reordered_or_dropped_fails_its_mac(attack):
    import numpy as np

    out, back = _sessions()
    payloads = [frames._payload({"type": "push", "request": f"r{i}",
                                 "src": frames.pack_ids(np.arange(3) + i)}) for i in range(3)]
    sealed = [out.seal(p) for p in payloads]
    wire = {
        "flip_json": [sealed[0].replace(b'"r0"', b'"r9"')],
        "flip_tail": [sealed[0][:-1] + bytes([sealed[0][-1] ^ 1])],
        "replay": [sealed[0], sealed[0]],
        "reorder": [sealed[1]],
        "drop": [sealed[0], sealed[2]],
        "other_direction": [back.seal(payloads[0])],
        "strip": [payloads[0]],
    }[attack]
    with pytest.raises(FrameError, match="MAC"):
        for data in wire:
            back.check(data)
