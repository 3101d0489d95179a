"""Handshake over a socket pair: auth, compat matrix, metadata only after auth."""

import socket
import threading
from dataclasses import replace

import pytest

from kvruntime.errors import AuthError, FrameError, IncompatiblePeerError, PeerError
from kvruntime.layout import CROSS_LAYER, PER_LAYER, KVLayout
from kvruntime.wire.handshake import PeerInfo, client_handshake, serve_handshake

BASE = dict(kind=CROSS_LAYER, num_layers=2, num_blocks=8, tokens_per_block=16, num_kv_heads=2,
            head_dim=8, dtype="float16", tp_size=1)


def info(name, **over):
    layout = KVLayout(**{**BASE, **over})
    regions = tuple((4096 * (i + 1), layout.region_bytes, 0) for i in range(layout.num_regions))
    return PeerInfo(layout, name, b"META-" + name.encode(), regions, "DRAM")


def run(server_info, client_info, server_secret=None, client_secret=None):
    a, b = socket.socketpair()
    out = {}

    def serve():
        try:
            out["server"] = serve_handshake(a, server_info, server_secret, 2.0)
        except Exception as exc:
            out["server_error"] = exc
        finally:
            a.close()

    t = threading.Thread(target=serve)
    t.start()
    try:
        out["client"] = client_handshake(b, client_info, client_secret, 2.0)
    except Exception as exc:
        out["client_error"] = exc
    finally:
        t.join(5)
        b.close()
    assert not t.is_alive()
    return out


def test_success_exchanges_both_infos():
    out = run(info("p"), info("d", num_blocks=99), b"s3cret", b"s3cret")
    assert out["client"].agent == "p" and out["client"].metadata == b"META-p"
    assert out["server"].agent == "d" and out["server"].layout.num_blocks == 99


def test_the_decode_times_the_first_exchange_alone_and_never_sends_it(monkeypatch):
    """The decode's info comes back with ``round_trip``: hello out to challenge in, what the
    coalescing model takes for one side-channel round trip. Forced: the prefill takes 50 ms
    to make its challenge's nonce (counted) and its admit sleeps 300 ms (after the exchange:
    not counted); the prefill's info has none; to_dict never carries it."""
    import time as clock

    import kvruntime.wire.handshake as hs

    real = hs.os.urandom

    def urandom(n):  # the prefill's nonce (its connection thread), made slowly
        if threading.current_thread().name == "prefill":
            clock.sleep(0.05)
        return real(n)

    monkeypatch.setattr(hs.os, "urandom", urandom)
    a, b = socket.socketpair()
    out = {}
    t = threading.Thread(name="prefill", target=lambda: out.update(server=serve_handshake(
        a, info("p"), None, 5.0, lambda peer: clock.sleep(0.3))))
    t.start()
    start = clock.perf_counter()
    got = client_handshake(b, info("d"), None, 5.0)
    whole = clock.perf_counter() - start
    t.join(5)
    a.close(), b.close()
    assert 0.05 <= got.round_trip <= whole - 0.3
    assert out["server"].round_trip is None
    assert "round_trip" not in got.to_dict()


def test_both_sides_admit_at_once():
    """The decode adds the prefill's agent while the prefill adds its own, not after the
    prefill's ready: forced here by the prefill's admit, which returns (and so lets its ready
    go) only once the decode's admit has run, with the prefill's info, proved. Before, the
    decode admitted only after the ready: this handshake could not finish."""
    a, b = socket.socketpair()
    decode_admitted = threading.Event()
    out = {}

    def prefill_admit(peer):
        out["prefill_saw_decode_first"] = decode_admitted.wait(5)

    def serve():
        try:
            out["server"] = serve_handshake(a, info("p"), b"s3cret", 10.0, prefill_admit)
        except Exception as exc:
            out["server_error"] = exc

    def decode_admit(peer):
        out["decode_admitted"] = peer.agent, peer.metadata
        decode_admitted.set()

    t = threading.Thread(target=serve)
    t.start()
    try:
        out["client"] = client_handshake(b, info("d"), b"s3cret", 10.0, decode_admit)
    finally:
        t.join(10)
        a.close()
        b.close()
    assert out["prefill_saw_decode_first"] and out["decode_admitted"] == ("p", b"META-p")
    assert out["client"].agent == "p" and out["server"].agent == "d"


def test_a_refusal_after_the_decode_admitted_still_raises():
    """The decode's admit runs before the prefill's last word: a prefill that refuses then
    (its admit fails, as an agent NIXL refuses would) still fails the decode's handshake,
    and the decode saw the info it must undo (DecodeClient.connect removes the agent)."""
    a, b = socket.socketpair()
    admitted = []

    def serve():
        def refuse(peer):
            raise IncompatiblePeerError("refused at admit", ["agent"])
        try:
            serve_handshake(a, info("p"), None, 5.0, refuse)
        except Exception:
            pass
        finally:
            a.close()

    t = threading.Thread(target=serve)
    t.start()
    try:
        with pytest.raises(PeerError):
            client_handshake(b, info("d"), None, 5.0, lambda peer: admitted.append(peer.agent))
    finally:
        t.join(10)
        b.close()
    assert admitted == ["p"]


@pytest.mark.parametrize("field,value", [
    ("kind", PER_LAYER), ("dtype", "bfloat16"), ("tokens_per_block", 32), ("num_kv_heads", 4),
    ("head_dim", 16), ("num_layers", 3), ("tp_size", 2)])
def test_compat_matrix_single_field(field, value):
    out = run(info("p"), info("d", **{field: value}))
    err = out["client_error"]
    assert isinstance(err, IncompatiblePeerError) and err.fields == [field]
    assert field in str(err)
    assert isinstance(out["server_error"], IncompatiblePeerError)


def test_compat_lists_every_differing_field():
    out = run(info("p"), info("d", kind=PER_LAYER, dtype="float32", head_dim=16, tp_size=4))
    assert out["client_error"].fields == ["kind", "dtype", "head_dim", "tp_size"]


@pytest.mark.parametrize("server_secret,client_secret,client_exc", [
    (b"right", b"wrong", AuthError),
    (b"right", None, AuthError),
    (None, b"mine", AuthError),
])
def test_auth_failures(server_secret, client_secret, client_exc):
    out = run(info("p"), info("d"), server_secret, client_secret)
    assert isinstance(out["client_error"], client_exc)
    assert "client" not in out


def test_no_secret_no_metadata():
    """A client with a wrong secret never sees the server's NIXL metadata."""
    a, b = socket.socketpair()
    received = []
    from kvruntime.wire import frames

    t = threading.Thread(target=lambda: _swallow(serve_handshake, a, info("p"), b"right"))
    t.start()
    frames.write_frame(b, {"type": "hello", "layout": info("d").layout.to_dict(),
                           "nonce": frames.b64(bytes(32))})
    received.append(frames.read_frame(b, 2))
    frames.write_frame(b, {"type": "auth", "proof": "00" * 32})
    received.append(frames.read_frame(b, 2))
    t.join(5)
    a.close(), b.close()
    assert received[1]["type"] == "error" and received[1]["code"] == "auth"
    assert all("META" not in str(m) and "info" not in m for m in received)


def _swallow(fn, *args):
    try:
        fn(*args, 2.0)
    except Exception:
        pass


def test_garbage_instead_of_hello():
    a, b = socket.socketpair()
    b.sendall(b"GET / HTTP/1.1\r\n\r\n")
    with pytest.raises(FrameError):
        serve_handshake(a, info("p"), None, 1.0)
    a.close(), b.close()


def test_silent_client_times_out():
    a, b = socket.socketpair()
    with pytest.raises(PeerError):
        serve_handshake(a, info("p"), None, 0.2)
    a.close(), b.close()


def _listener():
    srv = socket.create_server(("127.0.0.1", 0))
    return srv, srv.getsockname()[1]


def test_connect_to_an_ip_literal_skips_the_resolver(monkeypatch):
    from kvruntime.wire import handshake

    srv, port = _listener()
    calls = []
    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: calls.append(a) or real(*a, **k))
    try:
        sock = handshake.connect("127.0.0.1", port, 2.0)
        assert sock.getpeername()[1] == port
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        sock.close()
        assert calls == []
        # a name still goes through the resolver
        sock = handshake.connect("localhost", port, 2.0)
        sock.close()
        assert calls and calls[0][0] == "localhost"
    finally:
        srv.close()


def test_connect_refused_literal_times_out_with_reason():
    from kvruntime.errors import HandshakeTimeout
    from kvruntime.wire import handshake

    srv, port = _listener()
    srv.close()  # nothing listens there now
    with pytest.raises(HandshakeTimeout, match=f"127.0.0.1:{port}"):
        handshake.connect("127.0.0.1", port, 0.3, attempts=2)


MODEL = {"model": "llama", "hidden_size": 128, "num_key_value_heads": 4, "weights": "ab12"}


def app_info(name, app):
    return replace(info(name), app=app)


@pytest.mark.parametrize("decode_app,fields", [
    ({**MODEL, "hidden_size": 64, "weights": "cd34"}, ["app.hidden_size", "app.weights"]),
    ({k: v for k, v in MODEL.items() if k != "weights"}, ["app.weights"]),
    (None, ["app"])])
def test_a_differing_app_descriptor_is_refused_with_both_values(decode_app, fields):
    """The prefill refuses at the hello, before its metadata goes out, naming every key and
    both sides' values; the decode gets that line."""
    out = run(app_info("p", MODEL), app_info("d", decode_app))
    for side in ("client_error", "server_error"):
        err = out[side]
        assert isinstance(err, IncompatiblePeerError) and err.fields == fields, err
    text = str(out["client_error"])
    if decode_app and "hidden_size" in fields[0]:
        assert "app.hidden_size: prefill=128 decode=64" in text
        assert "app.weights: prefill='ab12' decode='cd34'" in text
    # the prefill's refusal (at the hello, before its welcome carries any metadata), relayed
    assert text.startswith("the prefill refused the connection: the application descriptors")


def test_the_same_app_descriptor_pairs_and_crosses():
    out = run(app_info("p", MODEL), app_info("d", dict(MODEL)), b"s", b"s")
    assert out["client"].app == MODEL and out["server"].app == MODEL


def test_a_prefill_without_a_descriptor_refuses_a_decode_with_one():
    out = run(info("p"), app_info("d", MODEL))
    assert out["server_error"].fields == ["app"] and "prefill=<none>" in str(out["client_error"])


@pytest.mark.parametrize("app,why", [
    ([1, 2], "must be a JSON object"),
    ({f"k{i}": i for i in range(33)}, "at most 32"),
    ({"a b": 1}, "is not 1-64 of"),
    ({"k": [1]}, "must be a string"),
    ({"k": float("nan")}, "must be a string"),
    ({"k": "x" * 257}, "must be a string"),
    ({"k": 2**70}, "must be a string")])
def test_a_bad_descriptor_is_refused_where_it_is_made_and_where_it_arrives(app, why):
    from kvruntime import Options
    from kvruntime.errors import LayoutError

    with pytest.raises(LayoutError, match=why):
        Options.of(None, {"app": app})
    wire = app_info("d", None).to_dict()
    wire["app"] = app
    with pytest.raises(FrameError, match=why):
        PeerInfo.from_dict(wire)


@pytest.mark.parametrize("scratch", [[1, 2], [1, 0, 0], [1, 4097, 0], [1, -1, 0], [1, True, 0],
                                     "1,256,0", [1, 256.0, 0]])
def test_a_bad_scratch_is_refused_where_it_arrives(scratch):
    """A decode's scratch (protocol 13) is written by the prefill at its connect: [address,
    length 1 to MAX_SCRATCH, device], all non-negative integers, or null."""
    wire = info("d").to_dict()
    assert wire["scratch"] is None and PeerInfo.from_dict(wire).scratch is None
    wire["scratch"] = [4096, 256, 1]
    assert PeerInfo.from_dict(wire).scratch == (4096, 256, 1)
    wire["scratch"] = scratch
    with pytest.raises(FrameError, match="peer scratch"):
        PeerInfo.from_dict(wire)
