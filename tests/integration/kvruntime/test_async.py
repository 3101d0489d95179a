"""The asynchronous request API with real NIXL agents in two processes over 127.0.0.1: many
requests in flight per peer and across peers, collected by get_finished; deadlines the prefill
enforces (a stalled prefill never writes after the decode was told the push failed); several
threads on one peer; release ids per peer."""

import os
import signal
import socket
import threading
import time

import pytest

from kvruntime.decode.client import DecodeClient
from kvruntime.errors import KVRuntimeError, PeerError, TransferTimeout, WaitTimeout
from kvruntime.layout import CROSS_LAYER, PER_LAYER, KVLayout
from kvruntime.memory import KVCache
from kvruntime.prefill.server import PrefillServer

pytestmark = pytest.mark.integration


def small(kind=CROSS_LAYER, blocks=128):
    return KVLayout(kind, 2, blocks, 16, 4, 32, "float16")


def _zero_digest(layout):
    zero = KVCache.allocate_host(layout)
    try:
        zero.fill_value(0)
        return zero.block_digest(0)
    finally:
        zero.close()


@pytest.mark.parametrize("engine", ["nixl", "samenode"])
@pytest.mark.parametrize("kind", [CROSS_LAYER, PER_LAYER])
def test_many_requests_in_flight_across_two_peers(prefill, kind, engine):
    layout = small(kind)
    with prefill([layout, layout], seed=3, secret=b"s") as (_proc, ports):
        cache = KVCache.allocate_host(small(kind, blocks=256))
        cache.fill_value(0)
        with DecodeClient(cache, secret=b"s", engine=engine) as client:
            peers = [client.connect("127.0.0.1", p) for p in ports]
            handles, expect = [], {}
            for i in range(32):  # 16 per peer, pulls and pushes interleaved, 4 blocks each
                peer = peers[i % 2]
                src = [(7 * i + k * 3) % layout.num_blocks for k in range(4)]
                dst = [4 * i + k for k in range(4)]
                start = peer.start_pull if i % 4 < 2 else peer.start_push
                h = start(src, dst, request_id=f"r{i}", timeout=30)
                handles.append(h)
                expect[id(h)] = (peer, src, dst)
            assert client.in_flight == 32
            finished, deadline = [], time.monotonic() + 60
            while len(finished) < 32 and time.monotonic() < deadline:
                finished += client.get_finished()
            assert sorted(map(id, finished)) == sorted(map(id, handles))
            assert client.get_finished() == [] and client.in_flight == 0
            for h in finished:
                assert h.ok, h.error
                peer, src, dst = expect[id(h)]
                assert h.result().nbytes == 4 * layout.block_bytes
                assert peer.digests(src) == [cache.block_digest(b) for b in dst]
        cache.close()


def test_push_to_a_stalled_prefill_fails_at_its_deadline_and_never_lands(prefill, stall):
    """Before: push(timeout=2) raised after 7 s and the resumed prefill then WROTE the blocks
    the decode had been told were not written. Now the caller's timeout is the deadline, and
    the prefill refuses a push it reads after that deadline."""
    layout = small()
    zero = _zero_digest(layout)
    with prefill([layout], seed=9) as (proc, ports):
        cache = KVCache.allocate_host(layout)
        cache.fill_value(0)
        with DecodeClient(cache, engine="nixl") as client:
            peer = client.connect("127.0.0.1", ports[0])
            peer.pull([0], [0], timeout=20)  # endpoints wired up while the prefill runs
            cache.fill_value(0)
            stall(proc.pid)
            try:
                t = time.monotonic()
                handle = peer.start_push([1, 2, 3], [10, 11, 12], timeout=1.0)
                with pytest.raises(TransferTimeout, match="deadline"):
                    handle.wait()
                elapsed = time.monotonic() - t
                assert 1.0 <= elapsed < 1.5, elapsed
                assert handle.settled is False  # the stalled prefill has not answered the cancel
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            # The prefill wakes up, reads the push and the cancel, refuses both.
            deadline = time.monotonic() + 10
            while not handle.settled and time.monotonic() < deadline:
                handle.peer.pump()
                time.sleep(0.01)
            assert handle.settled
            time.sleep(0.5)
            assert [cache.block_digest(b) for b in (10, 11, 12)] == [zero] * 3
            # and the peer stays usable
            res = peer.push([4], [20], timeout=20)
            assert res.nbytes == layout.block_bytes
            assert peer.digests([4]) == [cache.block_digest(20)]
        cache.close()


def test_a_push_sent_as_runs_is_checked_by_the_prefill(prefill, monkeypatch):
    """A push of few runs travels as runs (three integers each), not as two id lists, and the
    prefill plans from them. Runs naming one block twice — a hostile or broken decode — are
    refused there with the planner's line, and nothing is written."""
    from kvruntime.decode import client as decode_mod
    from kvruntime.errors import TransferError

    layout = small()
    zero = _zero_digest(layout)
    real, sent = decode_mod.frames.pack_runs, []
    with prefill([layout], seed=9) as (proc, ports):
        cache = KVCache.allocate_host(layout)
        cache.fill_value(0)
        with DecodeClient(cache, engine="nixl") as client:
            peer = client.connect("127.0.0.1", ports[0])
            monkeypatch.setattr(
                decode_mod.frames,
                "pack_runs",
                lambda s, d, c: sent.append((s.tolist(), d.tolist(), c.tolist())) or real(s, d, c),
            )
            res = peer.push([4, 5, 6, 9], [20, 21, 22, 30], timeout=20)
            assert sent == [([4, 9], [20, 30], [3, 1])]
            assert res.nbytes == 4 * layout.block_bytes
            assert peer.digests([4, 5, 6, 9]) == [cache.block_digest(b) for b in (20, 21, 22, 30)]
            peer.push([1, 7, 3], [60, 90, 70], timeout=20)  # three runs: the ids are shorter
            assert len(sent) == 1
            monkeypatch.setattr(
                decode_mod.frames, "pack_runs", lambda s, d, c: real([4, 5], [40, 50], [2, 2])
            )
            with pytest.raises(
                TransferError, match="source block id 5 appears twice in one request"
            ):
                peer.push([4, 5, 6, 9], [40, 41, 42, 50], timeout=20)
            assert [cache.block_digest(b) for b in range(40, 52)] == [zero] * 12
            assert peer.push([8], [99], timeout=20).nbytes == layout.block_bytes  # still usable
        cache.close()


def test_wait_shorter_than_the_request_leaves_it_running(prefill, stall):
    layout = small(blocks=512)
    with prefill([layout], seed=4) as (proc, ports):
        cache = KVCache.allocate_host(layout)
        with DecodeClient(cache, engine="nixl") as client:
            peer = client.connect("127.0.0.1", ports[0])
            stall(proc.pid)
            try:
                handle = peer.start_push(list(range(64)), timeout=30)
                with pytest.raises(WaitTimeout, match="still in flight"):
                    handle.wait(0.2)
                assert not handle.done()
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            assert handle.wait(30).nbytes == 64 * layout.block_bytes
            assert peer.digests(list(range(64))) == cache.block_digests(list(range(64)))
        cache.close()


def test_a_peer_whose_cancel_goes_unanswered_is_not_trusted(prefill, monkeypatch, stall):
    import kvruntime.wire.channel as channel

    monkeypatch.setattr(channel, "SETTLE_SECONDS", 0.5)
    layout = small()
    with prefill([layout], seed=2) as (proc, ports):
        cache = KVCache.allocate_host(layout)
        with DecodeClient(cache, engine="nixl") as client:
            peer = client.connect("127.0.0.1", ports[0])
            peer.pull([0], timeout=20)
            stall(proc.pid)
            try:
                with pytest.raises(TransferTimeout):
                    peer.push([1], timeout=0.3)
                time.sleep(0.6)
                with pytest.raises(PeerError, match="has not answered the cancel"):
                    peer.start_pull([2])
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            peer = client.connect("127.0.0.1", ports[0])  # a reconnect starts afresh
            peer.pull([2], timeout=20)
        cache.close()


@pytest.mark.parametrize("engine", ["nixl", "samenode"])
def test_threads_share_one_peer(prefill, engine):
    """Before: concurrent pushes on one peer interleaved frames ("bad frame magic") and the
    peer stayed broken. Now frames go out whole and replies find their request."""
    layout = small(blocks=256)
    with prefill([layout], seed=6) as (_proc, ports):
        cache = KVCache.allocate_host(layout)
        with DecodeClient(cache, engine=engine) as client:
            peer = client.connect("127.0.0.1", ports[0])
            errors = []

            def work(t):
                try:
                    for i in range(10):
                        src = [t * 40 + i * 4 + k for k in range(4)]
                        op = peer.push if (t + i) % 2 else peer.pull
                        op(src, timeout=30)
                        assert peer.digests(src) == cache.block_digests(src)
                except Exception as exc:  # reported below
                    errors.append(exc)

            threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
            for th in threads:
                th.start()
            for th in threads:
                th.join(120)
            assert not errors, errors
            assert not peer.closed
        cache.close()


def test_release_ids_are_per_peer_consumed_and_collected():
    """Before: every released id was kept forever and shared by all peers, so a reused id
    counted as released at once. The decode calls nothing after each pull: its release goes
    out all the same (releases.py's backstop). Prefill and decode in one process (real
    agents)."""
    layout = small()
    src_cache, dst_a, dst_b = (KVCache.allocate_host(layout) for _ in range(3))
    src_cache.fill_random(1)
    with PrefillServer(src_cache) as server, DecodeClient(dst_a, engine="nixl") as a, \
            DecodeClient(dst_b, engine="samenode") as b:
        pa, pb = a.connect(*server.address), b.connect(*server.address)
        pa.pull([1, 2], request_id="req")
        assert server.wait_released("req", 5, peer=a.agent.name)
        assert not server.wait_released("req", 0)  # consumed: the id may be used again
        pb.pull([3], request_id="req")
        assert not server.wait_released("req", 1, peer=a.agent.name)
        assert server.wait_released("req", 5, peer=b.agent.name)
        pa.pull([4], request_id="x")
        pb.push([5], request_id="y")
        deadline = time.monotonic() + 5
        got = []
        while len(got) < 2 and time.monotonic() < deadline:
            got += server.get_released()
            time.sleep(0.01)
        assert sorted(got) == sorted([(a.agent.name, "x"), (b.agent.name, "y")])
    for c in (src_cache, dst_a, dst_b):
        c.close()


@pytest.mark.parametrize("engine", ["nixl", "samenode"])
def test_requests_collected_together_release_in_one_frame(engine, monkeypatch):
    """get_finished hands back the requests that finished since the last call, and the
    prefill hears of all of one peer's in one release frame (a frame a request before), then
    frees every one of them. A NIXL READ carries no notification: the frame is its release.
    Prefill and decode in one process (real agents); the server's frames counted by type."""
    layout = small()
    src_cache, dst = KVCache.allocate_host(layout), KVCache.allocate_host(layout)
    src_cache.fill_random(4)
    seen = []
    handle = PrefillServer._handle

    def counted(self, peer, message):
        seen.append(message.get("type"))
        return handle(self, peer, message)

    monkeypatch.setattr(PrefillServer, "_handle", counted)
    with PrefillServer(src_cache) as server, DecodeClient(dst, engine=engine) as client:
        peer = client.connect(*server.address)
        ids = [f"r{i}" for i in range(8)]
        for i, r in enumerate(ids):
            peer.start_pull([i], [i], request_id=r)
        time.sleep(0.5)  # the copies end meanwhile; nothing has polled them
        finished, batches, deadline = [], 0, time.monotonic() + 30
        while len(finished) < 8 and time.monotonic() < deadline:
            got = client.get_finished()
            finished += got
            batches += bool(got)
        assert sorted(h.request_id for h in finished) == ids and all(h.ok for h in finished)
        released = []
        while len(released) < 8 and time.monotonic() < deadline:
            released += server.get_released()
            time.sleep(0.01)
        assert sorted(released) == sorted((client.agent.name, r) for r in ids)
        assert batches < 8  # requests were collected together (else this proves nothing)
        assert seen.count("release") == batches, seen
        assert [src_cache.block_digest(i) for i in range(8)] == \
            [dst.block_digest(i) for i in range(8)]
    for c in (src_cache, dst):
        c.close()


def test_a_push_lands_while_the_decode_does_not_poll(pair):
    """A push the decode asks for: its WRITE carries no NIXL notification, and the prefill's
    reply alone finishes the push. That is proof enough because NIXL flushes a WRITE before
    calling it done: the blocks have landed when the prefill says its WRITE ended, checked
    here before the decode polls at all. Prefill and decode in one process (real agents)."""
    server, client, peer, src_cache, dst = pair
    handle = peer.start_push([2, 3], [6, 7], request_id="p", timeout=20)
    assert server.wait_released("p", 10, peer=client.agent.name)  # its WRITE ended
    assert [dst.block_digest(b) for b in (6, 7)] == [src_cache.block_digest(b) for b in (2, 3)]
    result = handle.wait(10)
    assert result.nbytes == 2 * dst.layout.block_bytes and handle.settled


def test_an_idle_connection_stays_open_past_the_servers_timeout():
    """Before: the prefill's reads 'without timeout' inherited the 5 s its own replies set on
    the socket, so a decode idle for 5 s (while it served another peer) found its connection
    closed ("peer sent 0 of 8 expected bytes before the timeout")."""
    layout = small()
    src, dst = KVCache.allocate_host(layout), KVCache.allocate_host(layout)
    src.fill_random(3)
    with PrefillServer(src, timeout=0.5) as server, DecodeClient(dst, engine="nixl") as client:
        peer = client.connect(*server.address)
        peer.push([1], timeout=5)  # the server answers: its send sets the socket's timeout
        time.sleep(1.5)
        peer.push([2], timeout=5)
        assert dst.block_digests([1, 2]) == src.block_digests([1, 2])
    src.close()
    dst.close()


def test_a_send_that_fails_closes_the_peer_without_hanging(pair):
    """Before: a frame that could not be written lost the peer while the send lock was still
    held, and the close that follows sends its "bye" under that lock: the sending thread hung
    for good. Now the call fails and the peer is closed, refusing new requests. The write
    side of the real socket is shut, so the kernel refuses the next frame (EPIPE)."""
    server, client, peer, src_cache, dst = pair
    handle = peer.start_push([1], [2], request_id="waits", timeout=30)
    handle.wait(10)
    peer.channel.sock.shutdown(socket.SHUT_WR)
    outcome = []

    def digests():
        try:
            peer.digests([0], timeout=5)
        except Exception as exc:  # noqa: BLE001 - what it raised is the outcome
            outcome.append(exc)

    th = threading.Thread(target=digests, daemon=True)
    th.start()
    th.join(20)
    assert not th.is_alive(), "the failed send hung"
    assert len(outcome) == 1 and isinstance(outcome[0], KVRuntimeError), outcome
    assert peer.closed
    with pytest.raises(PeerError, match="closed"):
        peer.start_pull([3], [4])


def test_a_copy_the_kernel_refuses_fails_and_gives_the_blocks_back():
    """Before: a pull that failed while the prefill lived never released its blocks; the
    prefill's engine held them until its own timeout. Now a failed copy that reads nothing any
    more releases them. The failure is the kernel's: a page of the prefill's cache (this
    process's memory; prefill and decode in one process, real agents) is made unreadable, so
    the same-node engine's process_vm_readv gets EFAULT. (Under NIXL, UCX takes that fault for
    the peer's endpoint failing: the READ is refused as it is posted, and the agent must be
    connected again.)"""
    engine = "samenode"
    import ctypes
    import mmap

    layout = small()
    src, dst = KVCache.allocate_host(layout), KVCache.allocate_host(layout)
    src.fill_random(5)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    start = (src.regions[0].address + 5 * layout.chunk_bytes) // page * page
    with PrefillServer(src) as server, DecodeClient(dst, engine=engine) as client:
        peer = client.connect(*server.address)
        peer.pull([0], [0], timeout=20)
        assert libc.mprotect(start, page, 0) == 0, ctypes.get_errno()  # PROT_NONE
        try:
            handle = peer.start_pull([5], [9], request_id="denied", timeout=10)
            with pytest.raises(KVRuntimeError):
                handle.wait(15)
        finally:
            assert libc.mprotect(start, page, mmap.PROT_READ | mmap.PROT_WRITE) == 0
        assert handle.settled
        assert server.wait_released("denied", 5, peer=client.agent.name)
        if not peer.closed:  # the same blocks again, now readable
            peer.pull([5], [9], timeout=20)
            assert dst.block_digest(9) == src.block_digest(5)
    src.close(), dst.close()


@pytest.mark.parametrize("how", ["asked", "named"])
def test_a_decode_closing_its_peer_settles_its_pending_pushes(pair, how):
    """The decode closes its own peer (the prefill lives) with a push in flight that the
    prefill WRITEs: one it asked for (start_push), or one it named and the prefill has not
    pushed yet (expect_push). The close cancels it and waits for the prefill's answer, so
    the failed push is settled, saying why, and get_settled reports it. (Before: failed with
    settled False for good: nothing read the prefill's answer after the hang-up.)"""
    server, client, peer, src, dst = pair
    if how == "asked":
        handle = peer.start_push([2, 3], [6, 7], request_id="c", timeout=20)
    else:
        handle = peer.expect_push([6, 7], request_id="c", timeout=20)
        until = time.monotonic() + 10
        while not server.expects("c") and time.monotonic() < until:
            time.sleep(0.001)
        assert server.expects("c")
    peer.close()  # no poll before it: the prefill's answer is still unread
    assert handle.state == "failed" and handle.settled, handle.error
    assert "closed" in str(handle.error), handle.error
    assert handle in client.get_settled()
    assert not server.expects("c")  # the prefill dropped it too


def test_a_close_that_gets_no_answer_leaves_the_push_unsettled_and_says_so(prefill, stall):
    """The same close with the prefill stopped (SIGSTOP): no answer to the cancel can come,
    the close reads for the client's timeout and then hangs up, and the push stays unsettled
    (its WRITE may still run once the prefill resumes), its error saying so."""
    layout = small()
    with prefill([layout], seed=9) as (proc, ports):
        cache = KVCache.allocate_host(layout)
        with DecodeClient(cache, engine="nixl", timeout=0.5) as client:
            peer = client.connect("127.0.0.1", ports[0], timeout=20)
            peer.pull([0], [0], timeout=20)  # endpoints wired up while the prefill runs
            stall(proc.pid)
            try:
                handle = peer.start_push([1, 2], [10, 11], request_id="s", timeout=20)
                peer.close()
                assert handle.state == "failed" and not handle.settled
                assert "did not answer its cancel within" in str(handle.error), handle.error
            finally:
                os.kill(proc.pid, signal.SIGCONT)
        cache.close()


def test_a_push_whose_cancel_cannot_be_sent_fails_without_a_deadlock(prefill, stall):
    """A push misses its deadline and its cancel's send fails (the prefill is stopped, so
    nothing is read; our socket's write side is shut down, so the send fails at once): the
    failed send loses the channel, which fails its pending handles under their locks. The
    wait raises. (Before: the cancel was sent under the handle's own lock, the loss took it
    again, and the waiting thread hung for good.)"""
    layout = KVLayout(CROSS_LAYER, 2, 32, 16, 4, 32, "float16")
    with prefill([layout]) as (proc, ports):
        cache = KVCache.allocate_host(layout)
        with DecodeClient(cache, engine="nixl") as client:
            peer = client.connect("127.0.0.1", ports[0])
            stall(proc.pid)  # no pull first: its release would be the first frame to fail
            try:
                handle = peer.start_push([1, 2], [3, 4], timeout=0.2)
                peer.channel.sock.shutdown(socket.SHUT_WR)
                raised = []

                def wait():
                    try:
                        handle.wait()
                    except Exception as exc:
                        raised.append(exc)

                waiter = threading.Thread(target=wait, daemon=True)
                waiter.start()
                waiter.join(60)  # a deadlock never ends; an answer comes in milliseconds
                assert not waiter.is_alive(), "the waiting thread hung: deadlock"
                assert len(raised) == 1 and isinstance(raised[0], TransferTimeout), raised
                assert peer.closed or peer.channel.broken
            finally:
                os.kill(proc.pid, signal.SIGCONT)
        cache.close()
