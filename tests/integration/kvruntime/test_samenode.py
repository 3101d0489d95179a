"""The same-node engine on host memory, with real processes: the proof that a peer runs on
this host as a user allowed to read its memory, what happens when it does not hold, and a
peer that dies under it. (CUDA IPC runs in test_gpu.py on a GPU host.)"""

import ctypes
import os
import subprocess
import sys

import pytest

from kvruntime.decode.client import DecodeClient, PrefillPeer
from kvruntime.engines.samenode import NodeToken, SameNodeUnavailable, prove_same_node
from kvruntime.errors import KVRuntimeError, PlanError
from kvruntime.host.procmem import read_remote
from kvruntime.layout import CROSS_LAYER, PER_LAYER, KVLayout
from kvruntime.memory import KVCache
from kvruntime.prefill.server import PrefillServer
from kvruntime.wire import frames, messages

pytestmark = pytest.mark.integration


def small(kind=CROSS_LAYER, blocks=64):
    return KVLayout(kind, 2, blocks, 16, 4, 32, "float16")


def test_the_proof_reads_the_token_back_from_the_peer():
    token = NodeToken()
    offer = token.offer()
    assert prove_same_node(offer) == (os.getpid(), None)
    forged = {**offer, "token": frames.b64(os.urandom(32))}
    assert "differs" in prove_same_node(forged)[1]
    assert "another host" in prove_same_node({**offer, "boot_id": "elsewhere"})[1]
    assert "valid pid" in prove_same_node({**offer, "pid": -1})[1]
    assert "valid pid" in prove_same_node({**offer, "pid": True})[1]
    assert "base64" in prove_same_node({**offer, "token": 5})[1]


def test_the_proof_fails_for_another_process_at_the_same_address():
    """A pid that names another process (another pid namespace would do this): the bytes at
    the token's address there are not the token."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        offer = {**NodeToken().offer(), "pid": child.pid}
        pid, why = prove_same_node(offer)
        assert pid is None and ("differs" in why or "cannot read" in why), why
    finally:
        child.kill()
        child.wait()


def test_the_proof_fails_for_a_user_not_allowed_to_read():
    """A decode running as another, unprivileged user cannot read root's prefill memory, so
    it never gets the same-node path (skipped where this test does not run as root)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another user")
    import json

    offer = NodeToken().offer()
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child drops to nobody, then tries the proof
        try:
            os.setgid(65534)
            os.setuid(65534)
            os.write(wfd, json.dumps(prove_same_node(offer)).encode())
        finally:
            os._exit(0)
    os.close(wfd)
    with os.fdopen(rfd) as f:
        got, why = json.loads(f.read())
    os.waitpid(pid, 0)
    assert got is None and "cannot read the peer's memory" in why, why


def test_read_remote_reports_the_kernels_reason():
    buf = ctypes.create_string_buffer(16)
    with pytest.raises(OSError, match="process_vm_readv"):
        read_remote(os.getpid(), [ctypes.addressof(buf)], [8], [16])  # address 8: unmapped


@pytest.mark.parametrize("streams", [None, 3])
@pytest.mark.parametrize("kind", [CROSS_LAYER, PER_LAYER])
def test_forced_samenode_moves_scattered_blocks_in_one_request(prefill, kind, streams,
                                                               monkeypatch):
    """``streams``: the request split over 3 reader threads (what a many-core host gets), in
    pieces smaller than a block so that ranges are cut too."""
    import kvruntime.engines.samenode as samenode

    layout = small(kind)
    monkeypatch.setattr(samenode, "STREAM_PIECE", layout.chunk_bytes // 2 + 8)
    with prefill([layout], seed=21) as (_proc, ports):
        cache = KVCache.allocate_host(layout)
        cache.fill_value(0)
        with DecodeClient(cache, engine="samenode", host_streams=streams) as client:
            peer = client.connect("127.0.0.1", ports[0])
            assert peer.engine == "samenode:process_vm_readv"
            if streams:
                assert peer.samenode.streams == streams
            assert "proved" in peer.engine_reason
            src = [3, 9, 10, 11, 40, 2, 63]
            dst = [0, 5, 6, 7, 8, 60, 1]
            res = peer.pull(src, dst, timeout=20)
            assert res.engine == "samenode:process_vm_readv"
            assert res.nbytes == len(src) * layout.block_bytes
            assert peer.digests(src) == cache.block_digests(dst)
            with pytest.raises(PlanError, match="outside"):
                peer.start_pull([64])
        cache.close()


def test_the_connect_rehearses_the_request_path_without_touching_the_cache(prefill,
                                                                           monkeypatch):
    """PrefillPeer.rehearse: the connect runs a pull's path (plan, handle, engine start, polls,
    wait) REHEARSALS times on the engine's scratch request. The engine that rehearses is the
    CUDA one, which cannot run here (no GPU: test_gpu.py checks it), and the host engine does
    not (its first request costs what later ones do); so the real host engine is given a
    scratch request of the CUDA engine's shape: its own reads of the peer's blocks, into a
    scratch buffer. Every block of the cache keeps its canary through the connect, each
    rehearsal read, the prefill was asked to release nothing, and the first pull is
    bit-exact and released."""
    import numpy as np

    import kvruntime.engines.samenode as samenode

    started = []

    def scratch_request(engine):
        k, chunk = 12, np.uint64(engine.layout.chunk_bytes)
        scratch = ctypes.create_string_buffer(k * engine.layout.chunk_bytes)
        plan = samenode._scratch_plan(engine.layout, k)
        local = ctypes.addressof(scratch) + plan.run_dst.astype(np.uint64) * chunk
        remote = engine.remote[0] + plan.run_src.astype(np.uint64) * chunk
        lengths = plan.run_count.astype(np.uint64) * chunk

        def start():
            started.append(scratch)
            return engine.read("READ", plan, local, remote, lengths)
        return plan, start

    monkeypatch.setattr(samenode.HostEngine, "scratch_request", scratch_request)
    released = []
    real_release = PrefillPeer.release_later
    monkeypatch.setattr(PrefillPeer, "release_later",
                        lambda self, ids: released.extend(ids) or real_release(self, ids))
    layout = small(CROSS_LAYER)
    with prefill([layout], seed=22) as (_proc, ports):
        cache = KVCache.allocate_host(layout)
        cache.fill_value(0x5A)
        canary = cache.block_digest(0)
        with DecodeClient(cache, engine="samenode") as client:
            peer = client.connect("127.0.0.1", ports[0])
            assert len(started) == samenode.REHEARSALS
            assert all(s.raw != bytes(len(s.raw)) for s in started)  # the peer's bytes read
            assert cache.block_digests(range(layout.num_blocks)) == [canary] * layout.num_blocks
            assert released == [] and client.in_flight == 0
            src, dst = [5, 1, 40], [2, 30, 7]
            peer.pull(src, dst, timeout=20, request_id="first")
            assert peer.digests(src) == cache.block_digests(dst)
            assert released == ["first"]
        cache.close()


def test_a_failed_rehearsal_is_logged_and_the_connect_stands(prefill, monkeypatch, caplog):
    """A rehearsal whose copy fails (here: the engine's scratch request raises at its start,
    standing in for a device error the CUDA engine could meet) is logged, never fatal: the
    connect and the first pull go on, and its scratch is kept until the peer closes (a copy
    that missed its deadline could still write into it)."""
    import logging

    import kvruntime.engines.samenode as samenode

    def scratch_request(engine):
        def start():
            raise KVRuntimeError("the scratch copy could not start")
        return samenode._scratch_plan(engine.layout, 4), start

    monkeypatch.setattr(samenode.HostEngine, "scratch_request", scratch_request)
    layout = small(CROSS_LAYER)
    with prefill([layout], seed=25) as (_proc, ports):
        cache = KVCache.allocate_host(layout)
        with caplog.at_level(logging.INFO, logger="kvruntime.engines.engine"):
            with DecodeClient(cache, engine="samenode") as client:
                peer = client.connect("127.0.0.1", ports[0])
                assert "rehearsing the request path failed" in caplog.text
                assert peer.mover.rehearsal is not None and client.in_flight == 0
                peer.pull([3, 4], [9, 20], timeout=20)
                assert peer.digests([3, 4]) == cache.block_digests([9, 20])
                peer.close()
                assert peer.mover.rehearsal is None
        cache.close()


def test_samenode_pull_releases_the_blocks_on_the_prefill():
    from kvruntime.prefill.server import PrefillServer

    layout = small()
    src_cache, dst_cache = KVCache.allocate_host(layout), KVCache.allocate_host(layout)
    src_cache.fill_random(4)
    with PrefillServer(src_cache) as server, DecodeClient(dst_cache) as client:
        peer = client.connect(*server.address)
        assert peer.engine.startswith("samenode")  # auto: same host, same user
        peer.pull([1, 2], request_id="r1")
        peer.push([5], [6], request_id="r2")
        assert server.wait_released("r1", 5) and server.wait_released("r2", 5)
        assert dst_cache.block_digests([1, 2, 6]) == src_cache.block_digests([1, 2, 5])
        # a batch is one copy: its requests are released together, once, whichever handle
        # sees it done first
        sent = []
        send = peer.send

        def spy(message):
            sent.append(message)
            send(message)

        peer.send = spy
        handles = peer.start_pulls([([7], [8], "b1"), ([9, 10], [11, 12], "b2"), ([3], None, "b3")])
        handles[2].wait(10)
        # ... and finished together: the handle that saw the copy end finished the others,
        # each with its own bytes, before they were polled
        assert [h.state for h in handles] == ["done"] * 3
        assert [h.result().nbytes for h in handles] == [layout.block_bytes * n for n in (1, 2, 1)]
        client.wait_all(handles, timeout=10)
        assert client.in_flight == 0
        for rid in ("b1", "b2", "b3"):
            assert server.wait_released(rid, 5)
        assert [m for m in sent if m["type"] == "release"] == [
            {"type": "release", "requests": ["b1", "b2", "b3"]}]
        assert dst_cache.block_digests([8, 11, 12, 3]) == src_cache.block_digests([7, 9, 10, 3])
    src_cache.close()
    dst_cache.close()


def test_a_dead_peer_fails_the_request_and_nothing_stays_open(prefill):
    layout = small()
    with prefill([layout], seed=2) as (proc, ports):
        cache = KVCache.allocate_host(layout)
        with DecodeClient(cache, engine="samenode") as client:
            peer = client.connect("127.0.0.1", ports[0])
            peer.pull([1], timeout=20)
            proc.kill()
            proc.join(10)
            with pytest.raises(KVRuntimeError):  # refused at start, or failed by its deadline
                peer.start_pull([2, 3], timeout=5).wait()
            assert peer.closed and peer.samenode is None  # the opened peer is let go
            assert all(h.state != "pending" for h in client.inflight_handles())
        cache.close()


def test_engine_choice_is_checked():
    layout = small()
    cache = KVCache.allocate_host(layout)
    try:
        with pytest.raises(Exception, match="engine must be one of"):
            DecodeClient(cache, engine="fast")
    finally:
        cache.close()


def test_unavailable_is_a_kvruntime_error():
    assert issubclass(SameNodeUnavailable, Exception)


@pytest.mark.parametrize("engine", ["samenode", "nixl"])
def test_a_batch_of_requests_is_one_gather_with_a_handle_each(prefill, engine):
    layout = small(blocks=64)
    with prefill([layout], seed=8) as (_proc, ports):
        cache = KVCache.allocate_host(layout)
        cache.fill_value(0)
        with DecodeClient(cache, engine=engine) as client:
            peer = client.connect("127.0.0.1", ports[0])
            requests = [([s, s + 20], [d, d + 1], f"b{s}") for s, d in ((1, 0), (5, 2), (9, 4))]
            handles = peer.start_pulls(requests, timeout=20)
            assert [h.request_id for h in handles] == ["b1", "b5", "b9"]
            results = client.wait_all(handles, timeout=30)
            assert [r.nbytes for r in results] == [2 * layout.block_bytes] * 3
            for src, dst, _ in requests:
                assert peer.digests(src) == cache.block_digests(dst)
            with pytest.raises(PlanError, match="appears twice"):  # two requests, one block
                peer.start_pulls([([1], [7], None), ([2], [7], None)])
        cache.close()


def test_a_prefill_naming_another_process_is_not_trusted(prefill, monkeypatch):
    """A prefill that holds the secret and offers another process's pid, token address and
    token — a victim of the same user, here another prefill whose offer it read as one of its
    decodes — is refused: that pid does not hold our connection's other end. Before, the
    decode accepted the offer and read the victim's memory at the addresses the liar named."""
    import kvruntime.prefill.server as prefill_mod

    layout = small(CROSS_LAYER)
    with prefill([layout], seed=31, secret=b"s") as (victim, ports):
        cache = KVCache.allocate_host(layout)
        with DecodeClient(cache, secret=b"s", engine="nixl") as spy:
            peer = spy.connect("127.0.0.1", ports[0])
            stolen = peer.channel.call(messages.SAMENODE, 10)
        assert stolen["pid"] == victim.pid and stolen["pid"] != os.getpid()
        monkeypatch.setattr(prefill_mod, "serve_offer", lambda *_a: dict(stolen))
        liar_cache = KVCache.allocate_host(layout)
        liar_cache.fill_random(5)
        with PrefillServer(liar_cache, secret=b"s") as liar:
            with DecodeClient(cache, secret=b"s") as client:
                peer = client.connect(*liar.address)
                assert peer.engine == "nixl"
                assert "does not hold the side channel's other end" in peer.engine_reason
                cache.fill_value(0)
                peer.pull([1, 2], [1, 2], timeout=10)  # NIXL, from the liar's own cache
                assert cache.block_digests([1, 2]) == liar_cache.block_digests([1, 2])
            with DecodeClient(cache, secret=b"s", engine="samenode") as client:
                with pytest.raises(SameNodeUnavailable, match="does not hold"):
                    client.connect(*liar.address)
        liar_cache.close()
        cache.close()


def test_engine_reason_says_what_was_proved(prefill):
    layout = small(CROSS_LAYER)
    with prefill([layout], seed=32) as (proc, ports):
        cache = KVCache.allocate_host(layout)
        with DecodeClient(cache) as client:
            peer = client.connect("127.0.0.1", ports[0])
            assert peer.engine == "samenode:process_vm_readv"
            assert (f"pid {proc.pid} holds the side channel's other end" in peer.engine_reason
                    and "same user" in peer.engine_reason), peer.engine_reason
        cache.close()


def test_the_reason_names_another_users_process_read_as_root():
    """Root reads any user's process: the reason says so instead of "same user"."""
    from kvruntime.engines.samenode import what_was_proved

    if os.geteuid() != 0:
        pytest.skip("needs root to start a process of another user")
    other = subprocess.Popen(["sleep", "30"], user="nobody")
    try:
        reason = what_was_proved(other.pid)
        assert f"another user's process (uid {os.stat(f'/proc/{other.pid}').st_uid})" in reason
        assert "readable by us as root" in reason and "same user" not in reason
    finally:
        other.kill()
        other.wait()
    assert "same user" in what_was_proved(os.getpid())
