"""Issue 12's hostile cases with real sockets and processes: a connection flood under a low fd
limit, a relay that edits handshake frames, malformed proofs, state left behind by failed
connections, and the no-secret warning."""

import logging
import os
import select
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from kvruntime.decode.client import DecodeClient
from kvruntime.errors import AuthError, KVRuntimeError
from kvruntime.layout import CROSS_LAYER, KVLayout
from kvruntime.memory import KVCache
from kvruntime.prefill.server import PrefillServer
from kvruntime.wire import frames

pytestmark = pytest.mark.integration

LAYOUT = KVLayout(CROSS_LAYER, 2, 32, 16, 4, 32, "float16")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))))


def test_listener_survives_a_connection_flood_past_its_fd_limit():
    """Before: one EMFILE from accept() ended the accept thread silently; the port stayed
    open and every later decode timed out. Now: logged, backed off, still accepting once the
    flood is gone. The prefill runs in its own process with RLIMIT_NOFILE=128, and holds all
    but a few of them until the test has seen its accept fail: the limit is reached however
    slowly a loaded host accepts (once, in CI, a flood against 128 free descriptors never got
    there: the 1 s handshake deadline freed them as fast as they were taken)."""
    script = textwrap.dedent("""
        import os, resource, sys
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
        from kvruntime.layout import KVLayout
        from kvruntime.memory import KVCache
        from kvruntime.prefill.server import PrefillServer
        cache = KVCache.allocate_host(KVLayout("cross_layer", 2, 32, 16, 4, 32, "float16"))
        cache.fill_random(5)
        server = PrefillServer(cache, secret=b"k", timeout=1.0, max_connections=1000,
                               max_handshaking_per_address=1000)
        # UCX's first progress passes open files of this process (its first keepalive round:
        # an active message to NIXL's endpoint to itself attaches our own shared memory,
        # /proc/<pid>/fd/N, and reads /proc/<pid>/stat), from the server's progress thread as
        # it starts: made now, while descriptors are free. At the limit they failed, and the
        # decode's pull later timed out (CI, 1 run in ~20 under load; strace showed the opens).
        for _ in range(3):
            server.agent.call("get_new_notifs", server.agent.nixl.get_new_notifs)
        def fds():  # a listing takes a descriptor: at the limit, none is free for it
            try:
                return len(os.listdir("/proc/self/fd"))
            except OSError:
                return 1 << 20
        base = fds()  # the server's own descriptors
        held = []  # the descriptors but a few: a flood of a handful reaches the limit
        try:
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        for fd in held[-4:]:
            os.close(fd)
        del held[-4:]
        print("PORT", server.address[1], flush=True)
        for line in sys.stdin:  # the test's questions, until it closes our stdin
            if line.strip() == "release":
                for fd in held:
                    os.close(fd)
                held.clear()
            print("accept_errors", server.stats.accept_errors, server.stats.connections,
                  len(server.listener.conns), fds() - base, flush=True)
        print("accept_errors", server.stats.accept_errors, flush=True)
        server.close()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)

    def ask(what: str) -> tuple:
        """(accept errors, connections accepted, connections open, descriptors open beyond
        the server's own) of the prefill."""
        proc.stdin.write(what + "\n")
        proc.stdin.flush()
        line = ""
        while not line.startswith("accept_errors"):  # NIXL logs to stdout too
            line = proc.stdout.readline()
            assert line, "the prefill process ended"
        return tuple(int(n) for n in line.split()[1:])

    flood = []
    try:
        line = ""
        while not line.startswith("PORT "):
            line = proc.stdout.readline()
            assert line, "the prefill process ended before it listened"
        port = int(line.split()[1])
        for _ in range(64):  # far past the prefill's few free descriptors
            try:
                flood.append(socket.create_connection(("127.0.0.1", port), timeout=2))
            except OSError:
                break
        until = time.monotonic() + 60
        while ask("stats")[0] == 0:  # held open until its accept has failed
            assert time.monotonic() < until, "the prefill never reached its fd limit"
            time.sleep(0.05)
        flooded = len(flood)  # each one established: accepted, or queued to be
        for s in flood:
            s.close()
        flood.clear()
        assert ask("release")[0] > 0  # it did hit the limit; the descriptors it held go back
        # Every flood connection accepted and hung up, and the prefill's descriptors back to
        # its server's own, before the decode comes: those still queued took descriptors again
        # as they were accepted, and a decode's connect among them met the limit (CI of
        # 516b818, and once in 56 runs here after the connections' count was right: the
        # prefill's UCX could not open a shared-memory segment, EMFILE, and the pull timed
        # out). Its free descriptors are what the decode needs, so they are what is waited for.
        while True:
            _errors, accepted, open_now, extra_fds = ask("stats")
            if accepted >= flooded and open_now == 0 and extra_fds <= 8:
                break
            assert time.monotonic() < until + 60, (
                f"the flood was never drained: {accepted} of {flooded} accepted, {open_now} "
                f"open, {extra_fds} descriptors beyond the server's own")
            time.sleep(0.05)
        cache = KVCache.allocate_host(LAYOUT)
        with DecodeClient(cache, secret=b"k", engine="nixl", timeout=10) as client:
            peer = client.connect("127.0.0.1", port, timeout=20)
            peer.pull([1, 2], timeout=20)
            assert peer.digests([1, 2]) == cache.block_digests([1, 2])
        cache.close()
        out, _ = proc.communicate("", timeout=30)
        assert int(out.split("accept_errors")[-1].split()[0]) > 0, out  # and survived it
    finally:
        for s in flood:
            s.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class _Relay:
    """A man in the middle on 127.0.0.1 without the secret: forwards frames both ways and
    lets ``edit(direction, message)`` change them (recomputing nothing)."""

    def __init__(self, target_port, edit):
        self.edit = edit
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target = target_port
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        a, _ = self.listener.accept()
        b = socket.create_connection(("127.0.0.1", self.target))
        ends = {a: (b, "to_prefill"), b: (a, "to_decode")}
        try:
            while True:
                ready, _, _ = select.select([a, b], [], [], 10)
                if not ready:
                    return
                for s in ready:
                    try:
                        message = frames.read_frame(s, 5)
                    except KVRuntimeError:
                        return
                    other, direction = ends[s]
                    frames.write_frame(other, self.edit(direction, message), 5)
        finally:
            a.close()
            b.close()
            self.listener.close()


def _edit_welcome_blocks(direction, message):
    if direction == "to_decode" and message.get("type") == "welcome":
        message["info"]["layout"]["num_blocks"] -= 1
    return message


def _edit_welcome_region(direction, message):
    if direction == "to_decode" and message.get("type") == "welcome":
        message["info"]["regions"][0][0] += 4096
    return message


def _edit_decode_info(direction, message):
    if direction == "to_prefill" and message.get("type") == "info":
        message["info"]["regions"][0][0] += 4096
    return message


@pytest.mark.parametrize("edit", [_edit_welcome_blocks, _edit_welcome_region, _edit_decode_info])
def test_a_relay_that_edits_the_handshake_is_caught(edit):
    """Before: the HMAC covered the nonces only, so an edited welcome (a region address,
    num_blocks) verified and the decode pulled the wrong block. Now every proof covers the
    whole transcript."""
    src, dst = KVCache.allocate_host(LAYOUT), KVCache.allocate_host(LAYOUT)
    with PrefillServer(src, secret=b"k") as server, \
            DecodeClient(dst, secret=b"k", engine="nixl") as client:
        relay = _Relay(server.address[1], edit)
        with pytest.raises((AuthError, KVRuntimeError)) as err:
            client.connect("127.0.0.1", relay.port)
        assert "changed" in str(err.value) or "authentication" in str(err.value)
        assert server.peers == []
        # an unedited relay passes (the relay itself is not what is refused)
        relay = _Relay(server.address[1], lambda d, m: m)
        peer = client.connect("127.0.0.1", relay.port)
        assert peer.info.agent == server.agent.name
    src.close()
    dst.close()


def test_malformed_proofs_end_in_an_auth_error_frame():
    """Before: a non-ASCII proof raised TypeError inside hmac.compare_digest."""
    cache = KVCache.allocate_host(LAYOUT)
    with PrefillServer(cache, secret=b"k") as server:
        for proof in ("é" * 64, 5, None, ["x"]):
            with socket.create_connection(server.address, timeout=5) as s:
                frames.write_frame(s, {"type": "hello", "layout": LAYOUT.to_dict(),
                                       "nonce": frames.b64(bytes(32))}, 5)
                assert frames.read_frame(s, 5)["type"] == "challenge"
                frames.write_frame(s, {"type": "auth", "proof": proof}, 5)
                reply = frames.read_frame(s, 5)
                assert reply["type"] == "error" and reply["code"] == "auth", reply
        deadline = time.monotonic() + 5
        while len(server.listener.threads) > 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [r for r in server.stats.refused if "TypeError" in r[1]]
    cache.close()


def test_failed_connections_leave_no_state_behind():
    """Before: a thread object and a refused entry per failed connection, forever."""
    cache = KVCache.allocate_host(LAYOUT)
    with PrefillServer(cache, secret=b"k", timeout=0.5) as server:
        base = len(server.listener.threads)
        for _ in range(300):
            with socket.create_connection(server.address, timeout=5) as s:
                s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        deadline = time.monotonic() + 10
        while ((server.stats.connections < 300 or len(server.listener.threads) > base)
               and time.monotonic() < deadline):
            time.sleep(0.05)
        assert len(server.listener.threads) == base
        assert server.stats.refused_total >= 300
        assert len(server.stats.refused) <= 256
        assert server.listener.handshaking == {}
    cache.close()


def test_handshaking_connections_per_address_are_bounded():
    cache = KVCache.allocate_host(LAYOUT)
    with PrefillServer(cache, timeout=5, max_handshaking_per_address=4) as server:
        silent = [socket.create_connection(server.address, timeout=5) for _ in range(8)]
        time.sleep(0.5)
        assert server.stats.over_limit >= 4
        for s in silent:
            s.close()
    cache.close()


def test_no_secret_beyond_loopback_is_said_loudly(caplog):
    cache = KVCache.allocate_host(LAYOUT)
    with caplog.at_level(logging.WARNING, logger="kvruntime"):
        with PrefillServer(cache, host="0.0.0.0"):
            pass
        with PrefillServer(cache, host="127.0.0.1"):
            pass
    loud = [r for r in caplog.records if "NO shared secret" in r.getMessage()]
    assert len(loud) == 1 and "0.0.0.0" in loud[0].getMessage()
    cache.close()
