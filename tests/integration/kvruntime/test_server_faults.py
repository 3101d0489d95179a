"""A prefill server in this process, attacked by bad clients, keeps serving good ones."""

import json
import multiprocessing as mp
import socket
import struct
import subprocess
import sys

import pytest

from kvruntime.layout import CROSS_LAYER, PER_LAYER, KVLayout
from kvruntime.memory import KVCache
from kvruntime.prefill.server import PrefillServer
from kvruntime.tools.roles import reap
from kvruntime.tools.selftest import SELFTEST_SHAPE, decode_main
from kvruntime.wire import frames

pytestmark = pytest.mark.integration

LAYOUT = KVLayout(kind=CROSS_LAYER, **SELFTEST_SHAPE)


def _hello(layout=LAYOUT):
    return {"type": "hello", "layout": layout.to_dict(), "nonce": frames.b64(bytes(32))}


def _exchange(port, chunks, read=True):
    """Send raw bytes; return the decoded frames the server answered before closing."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        for c in chunks:
            s.sendall(c)
        s.shutdown(socket.SHUT_WR)
        got = b""
        while read:
            try:
                part = s.recv(65536)
            except ConnectionResetError:
                break
            if not part:
                break
            got += part
    out = []
    while len(got) >= 8:
        n = struct.unpack(">I", got[4:8])[0]
        out.append(json.loads(got[8:8 + n]))
        got = got[8 + n:]
    return out


def _good_decode(port, secret):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=decode_main, daemon=True,
                    args=(q, [port], [LAYOUT.to_dict()], 5, {"secret": secret}))
    p.start()
    try:
        return q.get(timeout=60)
    finally:
        reap(p, grace=20)


def test_bad_clients_are_refused_and_server_keeps_serving():
    cache = KVCache.allocate_host(LAYOUT)
    cache.fill_random(3)
    server = PrefillServer(cache, secret=b"good", timeout=1.0)
    port = server.address[1]
    try:
        raw = struct.pack(">4sI", frames.MAGIC, 1 << 30)
        # oversize announcement, garbage, truncated frame, wrong version
        assert _exchange(port, [raw])[0]["code"] == "frame"
        assert _exchange(port, [b"GET / HTTP/1.0\r\n\r\n"])[0]["code"] == "frame"
        assert _exchange(port, [frames.encode_frame(_hello())[:-4]]) == []
        wrong_v = json.dumps({"v": 0, "type": "hello"}).encode()
        assert "version 0" in _exchange(port, [struct.pack(">4sI", frames.MAGIC,
                                                           len(wrong_v)) + wrong_v])[0]["message"]
        # wrong secret: refused before any metadata is sent
        answers = _exchange(port, [frames.encode_frame(_hello()),
                                   frames.encode_frame({"type": "auth", "proof": "x"})])
        assert [a["type"] for a in answers] == ["challenge", "error"]
        assert answers[1]["code"] == "auth" and "info" not in answers[1]
        # a client that connects and says nothing is dropped after the timeout
        silent = socket.create_connection(("127.0.0.1", port))
        # a peer with the wrong secret through the real client
        bad = _good_decode(port, b"bad")
        assert not bad["ok"] and "AuthError" in bad["error"]
        # and a good peer still gets bit-exact blocks, both ops
        good = _good_decode(port, b"good")
        assert good["ok"], good
        assert [m["status"] for m in good["modes"]] == ["passed"] * 4  # 2 ops x 2 engines
        silent.close()
        assert server.stats.handshakes == 2  # the good decode's nixl and samenode clients
        assert len(server.stats.refused) >= 6
        assert server.peers == []  # nothing left behind by any of them
        assert server.registration.peers == []
    finally:
        server.close()
        server.close()  # idempotent
        cache.close()


def test_incompatible_peer_is_told_every_field():
    cache = KVCache.allocate_host(LAYOUT)
    server = PrefillServer(cache)
    try:
        other = KVLayout(PER_LAYER, 4, 256, 32, 8, 128, "bfloat16")
        answers = _exchange(server.address[1], [frames.encode_frame(_hello(other)),
                                                frames.encode_frame({"type": "auth",
                                                                     "proof": ""})])
        assert answers[-1]["code"] == "incompatible"
        assert answers[-1]["fields"] == ["kind", "dtype", "tokens_per_block"]
    finally:
        server.close()
        cache.close()


def _cli(*args, env=None):
    import os

    return subprocess.run([sys.executable, "-m", "kvruntime", *args], capture_output=True,
                          text=True, timeout=240, env={**os.environ, **(env or {})})


def test_selftest_cli_json():
    proc = _cli("selftest", "--json", "--tp-pairs", "none")  # TP pairs: test_selftest_cli.py
    report = json.loads(proc.stdout)  # stdout holds the report and nothing else
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert report["ok"] is True
    ran = [m for m in report["modes"] if m["status"] != "skipped"]
    assert {(m["layout"], m["op"]) for m in ran} == {
        (k, o) for k in (CROSS_LAYER, PER_LAYER) for o in ("pull", "push", "prefill_push")}
    assert all(m["digest_ok"] and m["gbps"] > 0 for m in ran)
    skipped = [m for m in report["modes"] if m["status"] == "skipped"]
    assert all(m["reason"] for m in skipped)


def test_selftest_without_nixl_fails_clearly():
    proc = _cli("selftest", "--json", env={"KVRUNTIME_NIXL_MODULE": "nixl_missing_here"})
    report = json.loads(proc.stdout)
    assert proc.returncode == 3  # the stack is unusable
    assert report["ok"] is False and "nixl_missing_here" in report["error"]
