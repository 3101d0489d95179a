"""A decode's memory mapped by the prefill's UCX at its connect (prefill/warm.py): real NIXL
agents, host memory over 127.0.0.1. On a GPU the mapping is a CUDA IPC open that the first
push's WRITE paid (2.2 ms of a 64 MiB push on 2 x H200), and only device memory is mapped
(``warm.wanted``). No device here: these tests make ``wanted`` say yes for host memory, so
that the same READs of the decode's regions are posted and polled by the prefill's progress
loop (a few bytes of host memory go by active messages, so the decode's progress is driven
while they wait, as a GPU's IPC copy would not need). They check that every region is read
once, in READs of at most ``BATCH`` regions, then the decode's scratch written once; that
host memory and a decode the prefill never writes into are not read; and that a READ still in
flight when the server closes goes with the agent, as a WRITE does; and that the "warm"
notification sent beside the WRITE reaches the decode, which drops it quietly.
tests/integration/kvruntime/test_gpu.py checks a CUDA pair."""

import logging
import math
import threading
import time

import pytest

from kvruntime.decode.client import DecodeClient
from kvruntime.layout import CROSS_LAYER, PER_LAYER, KVLayout
from kvruntime.memory import KVCache
from kvruntime.prefill import warm
from kvruntime.prefill.server import PrefillServer

pytestmark = pytest.mark.integration


def _until(condition, seconds=20.0, what="") -> None:
    until = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < until, what
        time.sleep(0.002)


@pytest.fixture
def mapped(monkeypatch):
    """Host memory mapped at connect, as device memory is."""
    monkeypatch.setattr(warm, "wanted", lambda ours, theirs: True)


@pytest.mark.parametrize("kind,layers", [(CROSS_LAYER, 2), (PER_LAYER, 10)])
def test_a_decode_we_may_write_into_is_mapped_at_its_connect(mapped, kind, layers, caplog):
    """Each region read once, then one WRITE into the scratch the decode named (its cache's
    blocks untouched), with no notification, and one "warm" notification on its own, which
    the decode drops."""
    layout = KVLayout(kind, layers, 64, 16, 4, 32, "float16")
    src, dst = KVCache.allocate_host(layout), KVCache.allocate_host(layout)
    src.fill_random(5)
    dst.fill_value(0)
    with caplog.at_level(logging.WARNING, logger="kvruntime"), \
            PrefillServer(src, coalesce="never") as server, \
            DecodeClient(dst, engine="nixl", coalesce="never") as client:
        peer = client.connect(*server.address)
        assert peer.info.scratch is None and client.info.scratch is not None
        # before any request: the prefill reads each of the decode's regions once
        _until(lambda: client.get_finished() is not None and server.stats.warmed == 1,
               what="the decode was never mapped")
        reads = math.ceil(layout.num_regions / warm.BATCH)
        assert server.writes.warms.reads == reads and reads == (1 if layers == 2 else 3)
        assert server.writes.warms.writes == 1
        assert server.stats.warm_failed == 0 and not server.writes.warms.pending
        # beside the WRITE, one "warm" notification, which the decode drops without a word
        assert server.writes.warms.notes == 1
        _until(lambda: client.get_finished() is not None and peer.warm_notes == 1,
               what="the warm notification never came")
        assert dst.block_digests(range(64)) == [dst.block_digests([0])[0]] * 64  # read only
        peer.push([1, 2, 3], [7, 8, 9], timeout=20)
        assert dst.block_digests([7, 8, 9]) == src.block_digests([1, 2, 3])
    assert server.writes.warms.reads == reads  # one connect, one mapping
    assert "notification" not in caplog.text, caplog.text
    src.close(), dst.close()


def test_host_memory_is_not_mapped_ahead():
    """cma and tcp map nothing ahead of a WRITE: no READ at the connect."""
    layout = KVLayout(CROSS_LAYER, 2, 64, 16, 4, 32, "float16")
    src, dst = KVCache.allocate_host(layout), KVCache.allocate_host(layout)
    src.fill_random(7)
    with PrefillServer(src, coalesce="never") as server, \
            DecodeClient(dst, engine="nixl", coalesce="never") as client:
        peer = client.connect(*server.address)
        peer.push([1], [2], timeout=20)  # served after the connection was queued, or not
        assert dst.block_digests([2]) == src.block_digests([1])
        assert not server.writes.warms.pending and server.writes.warms.reads == 0
    src.close(), dst.close()


def test_a_same_node_decode_is_not_mapped(mapped, monkeypatch):
    """A decode that opened our memory (same-node) copies our pushes itself: nothing is read
    of it. The READ waits ``AFTER`` the handshake for its offer; here the wait is endless, so
    that only the offer can end the decode's turn in the queue."""
    monkeypatch.setattr(warm, "AFTER", 3600.0)
    layout = KVLayout(CROSS_LAYER, 2, 64, 16, 4, 32, "float16")
    src, dst = KVCache.allocate_host(layout), KVCache.allocate_host(layout)
    src.fill_random(4)
    with PrefillServer(src, coalesce="never") as server, \
            DecodeClient(dst, engine="samenode") as client:
        peer = client.connect(*server.address)
        warms = server.writes.warms
        _until(lambda: not warms.pending, what="the same-node decode stayed queued")
        assert warms.reads == 0 and server.stats.warmed == 0
        peer.pull([3], [3], timeout=20)
        assert dst.block_digests([3]) == src.block_digests([3])
    src.close(), dst.close()


def test_a_host_staged_decode_is_not_mapped(mapped):
    """A host-staged pair moves everything through the pools: the prefill never WRITEs into
    the decode, and reads nothing of it."""
    layout = KVLayout(CROSS_LAYER, 2, 64, 16, 4, 32, "float16")
    src, dst = KVCache.allocate_host(layout), KVCache.allocate_host(layout)
    src.fill_random(6)
    with PrefillServer(src, kv_buffer="host_staged", staging_blocks=16) as server, \
            DecodeClient(dst, kv_buffer="host_staged", staging_blocks=16) as client:
        peer = client.connect(*server.address)
        peer.pull([4, 5], [4, 5], timeout=20)  # served after the connection's first frames
        assert dst.block_digests([4, 5]) == src.block_digests([4, 5])
        assert not server.writes.warms.pending
        assert server.stats.warmed == 0 and server.writes.warms.reads == 0
    src.close(), dst.close()


def _decode_that_connects_then_waits(port: int, layout, queue) -> None:
    """A decode process: connects (NIXL), says its agent's name on ``queue``, then waits to
    be stopped and killed by the test."""
    cache = KVCache.allocate_host(layout)
    client = DecodeClient(cache, engine="nixl", coalesce="never", ucx_threads=0)
    client.connect("127.0.0.1", port)
    queue.put(client.agent.name)
    time.sleep(120)


def test_a_mapping_read_in_flight_at_the_close_goes_with_the_agent(mapped, monkeypatch,
                                                                   caplog):
    """The decode is stopped (SIGSTOP) before the prefill may post its READ (the test holds
    back the progress loop's passes over the mappings until then), so over tcp the READ cannot
    end: tcp needs the target's progress. The server's close then finds it in flight: it is
    kept past the decode's drop, then dropped with the agent at the close's deadline, as a
    WRITE is; the close returns."""
    import multiprocessing
    import os
    import signal

    from .conftest import stop_process

    monkeypatch.setenv("UCX_TLS", "tcp")  # both processes: the decode is spawned with it
    layout = KVLayout(CROSS_LAYER, 2, 64, 16, 4, 32, "float16")
    src = KVCache.allocate_host(layout)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    server = PrefillServer(src, coalesce="never", ucx_threads=0, timeout=1.0)
    warms = server.writes.warms
    go, progress = threading.Event(), warms.progress
    monkeypatch.setattr(warms, "progress", lambda: go.is_set() and progress())
    child = ctx.Process(target=_decode_that_connects_then_waits, daemon=True,
                        args=(server.address[1], layout, queue))
    try:
        child.start()
        agent = queue.get(timeout=60)
        _until(lambda: agent in warms._queued, what="the decode was never queued")
        stop_process(child.pid)
        go.set()  # the progress loop posts it now
        _until(lambda: agent in warms._posted, what="the READ was never posted")
        time.sleep(0.05)  # the stopped decode cannot answer: it stays in flight
        assert agent in warms._posted and server.stats.warmed == 0
        with caplog.at_level(logging.WARNING, logger="kvruntime"):
            server.close()
        assert "1 transfer(s) with departed" in caplog.text
        assert "closing with 1 transfer(s) still in flight" in caplog.text
        assert warms._keep_scratch  # its bytes may land in our scratch until the agent goes
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
        server.close()
        queue.close()
        src.close()
