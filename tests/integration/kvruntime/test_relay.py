"""Frames after the handshake are authenticated: an on-path relay process without the secret
rewrites block ids in a push, forges a "pushed" reply, or replays an earlier genuine answer of
the prefill's in its place, and each time the side that reads the frame refuses it, the
connection ends and its requests fail, with nothing written where the relay pointed. Real NIXL
agents and a relay process between them. (Since protocol 13 a push's success comes as its
WRITE's NIXL notification, which does not cross the relay; a "pushed" frame is forged, the
replayed answer is a "digests".)

Before (protocol 10): the decode reported every such push OK, with the wrong blocks written or
nothing written at all."""

import contextlib
import subprocess
import sys
import textwrap

import pytest

from kvruntime.decode.client import DecodeClient
from kvruntime.errors import KVRuntimeError
from kvruntime.layout import CROSS_LAYER, KVLayout
from kvruntime.memory import KVCache
from kvruntime.prefill.server import PrefillServer

pytestmark = pytest.mark.integration

LAYOUT = KVLayout(CROSS_LAYER, 2, 32, 16, 4, 32, "float16")

# A relay on 127.0.0.1: forwards whole frames both ways, byte for byte, except as MODE says,
# once the handshake is over (3 frames from the decode, 2 from the prefill before "ready").
RELAY = textwrap.dedent(r'''
    import json, select, socket, struct, sys
    target, mode = int(sys.argv[1]), sys.argv[2]
    HEADER = struct.Struct(">4sI")
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    a, _ = listener.accept()
    b = socket.create_connection(("127.0.0.1", target))
    def recv(s, n):
        buf = b""
        while len(buf) < n:
            chunk = s.recv(n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return buf
    def frame(s):
        head = recv(s, HEADER.size)
        return head + recv(s, HEADER.unpack(head)[1])
    def doc(data):
        payload = data[HEADER.size:]
        cut = payload.find(b"\0")
        return json.loads(payload if cut < 0 else payload[:cut]), cut
    def forged(message):
        body = json.dumps({"v": 11, **message, "mac": "00" * 16}, separators=(",", ":")).encode()
        return HEADER.pack(b"KVRT", len(body)) + body
    seen = {a: 0, b: 0}
    replies = []
    try:
        while True:
            for s in select.select([a, b], [], [], 30)[0]:
                data = frame(s)
                seen[s] += 1
                other, late = (b, seen[a] > 3) if s is a else (a, seen[b] > 2)
                if late:
                    message, cut = doc(data)
                    kind = message.get("type")
                    if s is a and kind == "push" and mode == "push_ids":
                        # the push's first packed id + 1: a block the decode never named
                        at = HEADER.size + cut + 1
                        first = struct.unpack_from("<q", data, at)[0]
                        data = data[:at] + struct.pack("<q", first + 1) + data[at + 8:]
                    elif s is a and kind == "push" and mode == "forge_pushed":
                        a.sendall(forged({"type": "pushed", "request": message["request"],
                                          "nbytes": 1, "seconds": 0.001, "descriptors": 1}))
                        continue  # the prefill never hears of it
                    elif s is a and kind == "push" and mode == "replay" and replies:
                        a.sendall(replies[0])  # the first push's genuine, sealed answer
                        continue
                    elif s is b and kind == "digests":
                        replies.append(data)
                other.sendall(data)
    except (EOFError, OSError):
        pass
''')


@pytest.fixture
def relay():
    procs = []

    def start(target_port, mode):
        proc = subprocess.Popen([sys.executable, "-c", RELAY, str(target_port), mode],
                                stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        return int(proc.stdout.readline())

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def through(relay, mode, engine="auto"):
    """A prefill server and a decode connected to it through a relay in ``mode``: yields
    (server, peer, the decode's cache)."""
    src, dst = KVCache.allocate_host(LAYOUT), KVCache.allocate_host(LAYOUT)
    src.fill_random(3)
    dst.fill_value(0)
    try:
        with PrefillServer(src, secret=b"k") as server, \
                DecodeClient(dst, secret=b"k", engine=engine) as client:
            yield server, client.connect("127.0.0.1", relay(server.address[1], mode)), dst
    finally:
        src.close()
        dst.close()


@pytest.mark.parametrize("mode", ["push_ids", "forge_pushed", "replay"])
def test_a_relay_cannot_rewrite_forge_or_replay_frames(relay, mode):
    with through(relay, mode) as (server, peer, dst):
        zero = dst.block_digest(0)
        # the relay holds the decode's connection, not the prefill: no same-node proof
        assert peer.engine == "nixl", peer.engine_reason
        assert "does not hold the side channel's other end" in peer.engine_reason
        if mode == "replay":
            peer.digests([1])  # genuine: its answer is what the relay replays
        with pytest.raises(KVRuntimeError) as err:
            peer.push([3, 4], [10, 11], timeout=10)
        assert "MAC" in str(err.value) or "closed" in str(err.value), err.value
        assert peer.closed
        # nothing landed: not where the decode asked, not where the relay pointed
        assert dst.block_digests([9, 10, 11, 12]) == [zero] * 4
        if mode == "push_ids":  # the prefill read the rewritten push and refused it
            assert any("failed its MAC" in why for _addr, why in server.stats.refused)


def test_frames_through_an_honest_relay_still_work(relay):
    with through(relay, "none", "nixl") as (_server, peer, dst):
        for i in range(3):
            peer.push([i, 7], [20 + i, 27], timeout=10)
            peer.pull([i + 3], [i + 12], timeout=10)
        assert peer.digests([0, 1, 2, 3, 4, 5]) == dst.block_digests([20, 21, 22, 12, 13, 14])


def test_a_tampered_frame_is_named_in_the_error(relay):
    """The decode's own read of a forged reply: the error names the MAC."""
    with through(relay, "forge_pushed", "nixl") as (_server, peer, _dst):
        with pytest.raises(KVRuntimeError, match="failed its MAC"):
            peer.push([3], [10], timeout=10)
