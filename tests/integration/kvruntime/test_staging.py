"""Host-staged copies with real NIXL agents in two processes: the KV caches stay unregistered
(the TPU case, on this CPU host) and NIXL moves staging-pool blocks; the pools under pressure;
the errors that name the numbers."""

import time

import pytest

from kvruntime.decode.client import DecodeClient
from kvruntime.errors import IncompatiblePeerError, KVRuntimeError
from kvruntime.layout import CROSS_LAYER, PER_LAYER, KVLayout
from kvruntime.memory import KVCache
from kvruntime.pools.staging import StagingExhausted, StagingPool
from kvruntime.prefill.server import PrefillServer
from kvruntime.tools.selftest import request_blocks

pytestmark = pytest.mark.integration


def small(kind, blocks=64):
    return KVLayout(kind, 2, blocks, 16, 4, 32, "float16")


@pytest.mark.parametrize("op,engine,threads", [
    ("pull", "auto", 0), ("push", "auto", 0),   # same host: pool to pool by process_vm_readv
    ("pull", "nixl", 0), ("push", "nixl", 0),   # NIXL moves the run (another host's case)
    ("pull", "nixl", 2), ("push", "nixl", 2),
])
@pytest.mark.parametrize("kind", [CROSS_LAYER, PER_LAYER])
def test_staged_requests_are_bit_exact_and_the_caches_stay_unregistered(prefill, kind, op,
                                                                        engine, threads):
    """``threads``: NIXL's UCX thread pool on both sides (opt-in: a staged 1 GiB took 109 ms
    with 4 against 243 ms without on a 16-core host), the run's region pieces spread over its
    workers."""
    layout = small(kind)
    with prefill([layout], seed=13, kv_buffer="host_staged", staging_blocks=24,
                 ucx_threads=threads) as (_p, ports):
        cache = KVCache.allocate_host(small(kind, blocks=80))
        cache.fill_value(0)
        zero = cache.block_digest(0)
        with DecodeClient(cache, kv_buffer="host_staged", staging_blocks=24, engine=engine,
                          ucx_threads=threads) as client:
            assert client.agent.ucx_threads == threads
            # NIXL holds the staging pool, never the cache
            assert client.registration.cache is client.staging.cache
            assert client.staging.cache.layout.kind == CROSS_LAYER
            peer = client.connect("127.0.0.1", ports[0])
            assert peer.engine == "host_staged" and peer.info.kv_buffer == "host_staged"
            assert peer.staged_copy == ("nixl" if engine == "nixl" else
                                        "samenode:process_vm_readv"), peer.engine_reason
            src, dst = request_blocks(layout.num_blocks, 7)
            res = getattr(peer, op)(src, dst, timeout=20)
            assert res.engine == "host_staged" and res.nbytes == len(src) * layout.block_bytes
            assert peer.digests(src) == cache.block_digests(dst)
            untouched = sorted(set(range(80)) - set(dst))[:5]
            assert cache.block_digests(untouched) == [zero] * len(untouched)
        cache.close()


def test_more_requests_than_pool_blocks_wait_their_turn(prefill):
    """6 requests of 4 blocks in flight through pools of 8 blocks on both sides."""
    layout = small(CROSS_LAYER)
    with prefill([layout], seed=3, kv_buffer="host_staged", staging_blocks=8) as (_p, ports):
        cache = KVCache.allocate_host(layout)
        with DecodeClient(cache, kv_buffer="host_staged", staging_blocks=8) as client:
            peer = client.connect("127.0.0.1", ports[0])
            reqs = [([4 * i + k for k in range(4)], [40 - 4 * i + k for k in range(4)])
                    for i in range(6)]
            handles = [peer.start_pull(s, d, timeout=30) for s, d in reqs]
            client.wait_all(handles, timeout=60)
            for s, d in reqs:
                assert peer.digests(s) == cache.block_digests(d)
        cache.close()


@pytest.mark.parametrize("prefill_blocks,decode_blocks", [(4, 16), (16, 4)])
def test_a_request_larger_than_either_pool_moves_in_pieces(prefill, prefill_blocks,
                                                           decode_blocks):
    """8 blocks (32 units) against a pool of 4 blocks on either side: two pieces, one after
    the other, one request and one result; both pools whole again after it. (Before: refused
    with the numbers, by the prefill or at once by the decode.)"""
    layout = small(CROSS_LAYER)
    with prefill([layout], seed=3, kv_buffer="host_staged",
                 staging_blocks=prefill_blocks) as (_p, ports):
        cache = KVCache.allocate_host(layout)
        with DecodeClient(cache, kv_buffer="host_staged", staging_blocks=decode_blocks) as client:
            peer = client.connect("127.0.0.1", ports[0])
            src = [9, 2, 30, 31, 4, 17, 8, 12]
            res = peer.pull(src, list(range(8)), timeout=10)
            assert res.nbytes == 8 * layout.block_bytes and res.descriptors >= 2
            assert peer.digests(src) == cache.block_digests(range(8))
            assert client.staging.largest_free_run() == client.staging.units
            peer.pull([1, 2], [20, 21], timeout=10)  # the prefill's pool is whole again too
            assert peer.digests([1, 2]) == cache.block_digests([20, 21])
        cache.close()


def test_an_exhausted_pool_never_blocks_past_the_deadline():
    layout = small(CROSS_LAYER)
    cache = KVCache.allocate_host(layout)
    pool = StagingPool(layout, 1, cache)  # one block of 4 heads: 4 units
    try:
        start = pool.acquire(3, time.monotonic() + 1)
        t = time.monotonic()
        with pytest.raises(StagingExhausted, match="2 units wanted, largest free run 1 of 4"):
            pool.acquire(2, time.monotonic() + 0.2)
        assert 0.2 <= time.monotonic() - t < 1.0
        pool.release(start, 3)
        assert pool.acquire(4, time.monotonic() + 1) == 0
    finally:
        pool.close()
        cache.close()


def test_direct_and_staged_peers_do_not_pair():
    layout = small(CROSS_LAYER)
    src, dst = KVCache.allocate_host(layout), KVCache.allocate_host(layout)
    with PrefillServer(src) as server, \
            DecodeClient(dst, kv_buffer="host_staged", staging_blocks=8) as client:
        with pytest.raises(IncompatiblePeerError, match="kv_buffer") as err:
            client.connect(*server.address)
        assert err.value.fields == ["kv_buffer"]
    src.close()
    dst.close()


def test_a_prefill_killed_while_staged_runs_are_read_fails_them_and_frees_our_pool(prefill):
    """Same host: staged runs are read from the prefill's pool by process_vm_readv. Killed in
    the middle of a stream of such requests, a request fails (the read's error or the lost
    connection) well before its deadline, and our pool blocks are all free again."""
    import os
    import signal
    import threading

    from kvruntime.errors import TransferError

    layout = KVLayout(CROSS_LAYER, 4, 256, 16, 8, 128, "float16")  # 256 KiB blocks, 64 MiB
    with prefill([layout], kv_buffer="host_staged", staging_blocks=256) as (proc, ports):
        cache = KVCache.allocate_host(layout)
        client = DecodeClient(cache, kv_buffer="host_staged", staging_blocks=256)
        try:
            peer = client.connect("127.0.0.1", ports[0])
            assert peer.staged_copy == "samenode:process_vm_readv", peer.engine_reason
            blocks = list(range(256))
            peer.pull(blocks, timeout=30)  # warm
            killer = threading.Timer(0.3, os.kill, (proc.pid, signal.SIGKILL))
            killer.start()
            start = time.monotonic()
            with pytest.raises((TransferError, KVRuntimeError)):
                for _ in range(10000):
                    peer.pull(blocks, timeout=5)
            assert time.monotonic() - start < 30
            killer.join()
            assert client.staging.largest_free_run() == client.staging.units
        finally:
            client.close()
            cache.close()


def test_an_exhausted_decode_pool_fails_at_the_deadline_with_its_numbers(prefill):
    """A request that fits the decode's pool, but not beside the units other requests hold
    (taken here straight from the pool), fails at its deadline saying so, with the numbers."""
    layout = small(CROSS_LAYER)
    with prefill([layout], seed=3, kv_buffer="host_staged", staging_blocks=16) as (_p, ports):
        cache = KVCache.allocate_host(layout)
        with DecodeClient(cache, kv_buffer="host_staged", staging_blocks=3) as client:
            peer = client.connect("127.0.0.1", ports[0])
            held = client.staging.try_acquire(8)
            with pytest.raises(KVRuntimeError, match=r"the decode's staging pool is exhausted: "
                               r"8 units asked, 4 free \(largest free run 4\) of 12"):
                peer.pull([3, 4], [3, 4], timeout=0.5)
            client.staging.release(held, 8)
            peer.pull([3, 4], [3, 4], timeout=10)
            assert peer.digests([3, 4]) == cache.block_digests([3, 4])
        cache.close()


def test_an_exhausted_prefill_pool_fails_the_decode_with_the_prefills_numbers():
    """The prefill's pool holds too few units (taken here straight from it): the stage waits
    in its queue, and the request fails at its deadline naming the prefill's pool and its
    numbers. (Before: the decode's deadline came first and said "the prefill had not staged
    it"; the prefill's stage_failed with the numbers came after and was dropped.)"""
    server, client, peer, src, dst = _staged_pair()
    try:
        held = server.pool.try_acquire(28)  # of 8 blocks x 4 heads: 4 units left
        with pytest.raises(KVRuntimeError, match=r"the prefill's staging pool is exhausted: "
                           r"8 units asked, 4 free \(largest free run 4\) of 32"):
            peer.pull([3, 4], [3, 4], timeout=3)
        server.pool.release(held, 28)
        peer.pull([3, 4], [3, 4], timeout=10)  # served again once the units are back
        assert dst.block_digests([3, 4]) == src.block_digests([3, 4])
    finally:
        client.close(), server.close()
        src.close(), dst.close()


def test_an_exhausted_decode_pool_is_named_while_the_prefill_is_stopped(prefill, stall):
    """The decode's pool cannot take the run and the prefill is stopped (SIGSTOP), so it
    never answers: the deadline's error still names the decode's pool with its numbers.
    (Before: "the prefill had not staged it", no numbers: the decode only looked at its
    pool once the prefill's answer came.)"""
    import os
    import signal

    layout = small(CROSS_LAYER)
    with prefill([layout], seed=3, kv_buffer="host_staged", staging_blocks=16) as (proc, ports):
        cache = KVCache.allocate_host(layout)
        with DecodeClient(cache, kv_buffer="host_staged", staging_blocks=3) as client:
            peer = client.connect("127.0.0.1", ports[0])
            held = client.staging.try_acquire(8)
            stall(proc.pid)
            try:
                with pytest.raises(KVRuntimeError, match=r"the decode's staging pool is "
                                   r"exhausted too: 8 units asked, 4 free \(largest free run "
                                   r"4\) of 12"):
                    peer.pull([3, 4], [3, 4], timeout=0.5)
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            client.staging.release(held, 8)
        cache.close()


def test_a_stage_naming_blocks_outside_the_prefills_cache_is_refused(prefill, monkeypatch):
    """The prefill gathers a stage's ids without planning them (stages.py): the range check is
    what keeps its reads inside its cache. A decode whose own plan was sound but whose frame
    names another block (forged here on the way out) is refused, saying which, and nothing
    lands; the connection goes on serving. A block named twice is only read twice."""
    from kvruntime.engines import staged

    layout = small(CROSS_LAYER)
    with prefill([layout], seed=5, kv_buffer="host_staged", staging_blocks=16) as (_p, ports):
        cache = KVCache.allocate_host(layout)
        cache.fill_value(0)
        zero = cache.block_digest(0)
        with DecodeClient(cache, kv_buffer="host_staged", staging_blocks=16) as client:
            peer = client.connect("127.0.0.1", ports[0])
            real = staged.frames.pack_ids
            for forged, why in (([3, 64], "source block id 64 is outside 0..63"),
                                ([-2, 4], "source block id -2 is outside 0..63")):
                monkeypatch.setattr(staged.frames, "pack_ids", lambda ids, f=forged: real(f))
                with pytest.raises(KVRuntimeError, match=why):
                    peer.pull([3, 4], [10, 11], timeout=10)
                monkeypatch.setattr(staged.frames, "pack_ids", real)
                assert cache.block_digests([10, 11]) == [zero, zero]
            monkeypatch.setattr(staged.frames, "pack_ids", lambda ids: real([5, 5]))
            peer.pull([5, 6], [12, 13], timeout=10)
            monkeypatch.setattr(staged.frames, "pack_ids", real)  # digests pack ids too
            assert cache.block_digests([12, 13]) == peer.digests([5]) * 2
            peer.pull([3, 4], [10, 11], timeout=10)
            assert cache.block_digests([10, 11]) == peer.digests([3, 4])
        cache.close()


@pytest.mark.parametrize("engine", ["nixl", "auto"])
@pytest.mark.parametrize("staging_blocks", [0, 8])
def test_start_pulls_of_a_host_staged_peer_go_through_the_pools(prefill, engine,
                                                                staging_blocks):
    """A batch of pulls from a host-staged peer takes start_pull's road per request: the
    pools. (Before: the batch READ was posted with the registration's descriptor lists, which
    describe the staging pools, not the caches: with the default pool both requests came back
    ok and the cache was unchanged; with a pool of 8 blocks NIXL refused the READ.) Every
    block not named keeps its canary."""
    layout = small(CROSS_LAYER)
    with prefill([layout], seed=17, kv_buffer="host_staged",
                 staging_blocks=staging_blocks) as (_p, ports):
        cache = KVCache.allocate_host(layout)
        cache.fill_value(0xA5)
        canary = cache.block_digest(0)
        with DecodeClient(cache, kv_buffer="host_staged", staging_blocks=staging_blocks,
                          engine=engine) as client:
            peer = client.connect("127.0.0.1", ports[0])
            requests = [([3, 9, 40], [20, 21, 50], "a"), ([7, 8], [2, 33], "b")]
            handles = peer.start_pulls(requests, timeout=20)
            for res in client.wait_all(handles, timeout=30):
                assert res.engine == "host_staged"
            for src, dst, _rid in requests:
                assert peer.digests(src) == cache.block_digests(dst)
            written = {b for _s, dst, _r in requests for b in dst}
            others = sorted(set(range(layout.num_blocks)) - written)
            assert cache.block_digests(others) == [canary] * len(others)
        cache.close()


def _staged_pair(**server_options):
    """A host-staged prefill server in this process (its pool and releases looked at) and a
    decode connected to it; the caches' blocks: random (prefill), a canary (decode)."""
    layout = small(CROSS_LAYER)
    src, dst = KVCache.allocate_host(layout), KVCache.allocate_host(layout)
    src.fill_random(21)
    dst.fill_value(0xA5)
    server = PrefillServer(src, kv_buffer="host_staged", staging_blocks=8, **server_options)
    client = DecodeClient(dst, kv_buffer="host_staged", staging_blocks=8, engine="nixl")
    return server, client, client.connect(*server.address), src, dst


def _stage_frame(request, blocks, ahead):
    from kvruntime.wire import frames, messages

    return messages.STAGE.build(request=request, src=frames.pack_ids(blocks),
                                deadline=time.time() + ahead)


def _until(condition, seconds=10.0):
    """Poll ``condition`` until true or ``seconds`` pass (a bound, not a timing): its value."""
    until = time.monotonic() + seconds
    while not condition() and time.monotonic() < until:
        time.sleep(0.01)
    return condition()


def test_a_second_stage_of_one_request_piece_is_refused_and_the_first_run_freed(monkeypatch):
    """A decode that stages one (request, piece) twice (its stage frame sent twice here): the
    prefill keeps one run for it, refuses the second stage, and the unstage frees the pool
    whole. (Before: the second record replaced the first, whose run was never freed, not even
    at expiry.)"""
    from kvruntime.engines import staged

    server, client, peer, src, dst = _staged_pair()
    real = staged.StagedPull.send

    def twice(self):
        real(self)
        real(self)

    try:
        monkeypatch.setattr(staged.StagedPull, "send", twice)
        handle = peer.start_pull([1, 2, 3], [4, 5, 6], request_id="twice", timeout=10)
        try:
            handle.wait(10)
        except KVRuntimeError:
            pass  # refused (its second stage) or done first: either way one unstage goes
        assert server.wait_released("twice", 10)
        assert server.pool.largest_free_run() == server.pool.units
        monkeypatch.setattr(staged.StagedPull, "send", real)
        peer.pull([7, 8], [9, 10], timeout=10)  # the pool serves again
        assert dst.block_digests([9, 10]) == src.block_digests([7, 8])
    finally:
        client.close(), server.close()
        src.close(), dst.close()


def test_a_batch_larger_than_the_pools_lands_waited_on_in_order():
    """start_pulls of three requests of 12 blocks each through pools of 8 (pieces of 8 and
    4), waited on one after the other: each lands. (Before: the first request's second piece
    waited for the prefill's pool, which the second request's first piece held until its
    READ ended, and nothing polled the second while the caller waited on the first: all
    three failed at their deadline.)"""
    server, client, peer, src, dst = _staged_pair()
    try:
        requests = [(list(range(12 * i, 12 * i + 12)), list(range(28 + 12 * i, 40 + 12 * i)),
                     f"batch-{i}") for i in range(3)]
        handles = peer.start_pulls(requests, timeout=5)
        for handle in handles:
            handle.wait()
        for s_blocks, d_blocks, _rid in requests:
            assert dst.block_digests(d_blocks) == src.block_digests(s_blocks)
    finally:
        client.close(), server.close()
        src.close(), dst.close()


def test_a_decode_that_leaves_without_unstaging_has_its_runs_freed_and_released():
    """A stage whose deadline lies 10^7 s ahead, then the decode closes without unstaging:
    its connection's end frees the run and releases the request. (Before: the run stayed
    taken until an expiry 10^7 s away.)"""
    server, client, peer, src, dst = _staged_pair()
    try:
        peer.send(_stage_frame("held", [1, 2], 1e7))
        assert _until(lambda: server.pool.largest_free_run() < server.pool.units)
        client.close()  # "bye", no unstage
        assert server.wait_released("held", 10)
        assert server.pool.largest_free_run() == server.pool.units
    finally:
        client.close(), server.close()
        src.close(), dst.close()


def test_a_stage_deadline_far_ahead_is_capped_by_the_server():
    """``max_stage_seconds``: a stage naming a deadline 10^7 s ahead, never unstaged while its
    decode stays connected, is held only until the cap (then the 5 s expiry): freed and
    released. (Before: no such option; such a run was held for good.)"""
    server, client, peer, src, dst = _staged_pair(max_stage_seconds=0.5)
    try:
        peer.send(_stage_frame("far", [3], 1e7))
        assert _until(lambda: server.pool.largest_free_run() < server.pool.units)
        assert server.wait_released("far", 20)
        assert server.pool.largest_free_run() == server.pool.units
        assert not peer.closed
    finally:
        client.close(), server.close()
        src.close(), dst.close()
    with pytest.raises(KVRuntimeError, match="max_stage_seconds must be a finite positive"):
        PrefillServer(src, max_stage_seconds=0)


@pytest.mark.parametrize("mode,engine,named", [
    ("host_staged", "nixl", "host_staged NIXL READ"),
    ("host_staged", "auto", "host_staged samenode:process_vm_readv READ"),
    ("coalesced", "nixl", "coalesced NIXL READ")])
@pytest.mark.parametrize("op", ["pull", "push"])
def test_a_failed_request_through_the_pools_names_its_engine(monkeypatch, mode, engine, named,
                                                             op):
    """A request through the pools that fails (the prefill refuses its stage: an id forged on
    the way out) names what moves it, as a NIXL READ's failure does ("NIXL READ of ...").
    (Before: "host_staged of 16384 bytes", "nixl of 16384 bytes": a result's engine name, a
    coalesced request passing for a plain NIXL one.)"""
    from kvruntime.engines import staged

    layout = small(CROSS_LAYER)
    src, dst = KVCache.allocate_host(layout), KVCache.allocate_host(layout)
    if mode == "host_staged":
        sides = {"kv_buffer": "host_staged", "staging_blocks": 8}
        server_options, client_options = sides, {**sides, "engine": engine}
    else:
        server_options, client_options = {}, {"engine": engine, "coalesce": "always"}
    real = staged.frames.pack_ids
    try:
        with PrefillServer(src, **server_options) as server, \
                DecodeClient(dst, **client_options) as client:
            peer = client.connect(*server.address)
            monkeypatch.setattr(staged.frames, "pack_ids", lambda ids: real([70]))
            with pytest.raises(KVRuntimeError) as err:
                getattr(peer, op)([1], [2], request_id="named", timeout=10)
            monkeypatch.setattr(staged.frames, "pack_ids", real)
            assert str(err.value).startswith(
                f"{named} of {layout.block_bytes} bytes for request named failed: the "
                f"prefill could not stage it: source block id 70 is outside 0..63"), err.value
            res = getattr(peer, op)([1], [2], timeout=10)  # its result's engine: unchanged
            assert res.engine == ("host_staged" if mode == "host_staged" else "nixl")
    finally:
        src.close(), dst.close()


def test_a_read_whose_end_is_seen_after_the_prefill_hung_up_is_not_scattered(monkeypatch):
    """The prefill drops a decode that is still connected (a bad frame, or a reconnect of the
    same agent name) while the decode's READ of a staged run is in flight: it hangs up, then
    frees the run, which it may gather another request into at once. The moment is forced
    here: the READ has ended, and before the decode sees its end the prefill ends the
    connection (``Channel.end``, as a reconnect does) and drops the peer. The decode fails the
    request, naming the hang-up, and its blocks keep their canaries; the pools are whole.
    (Before: it scattered what the run held and reported the request done.)"""
    from kvruntime.engines import staged

    server, client, peer, src, dst = _staged_pair()
    real = staged.read_rows
    dropped = []

    def read_rows(*args, **kwargs):
        xfer = real(*args, **kwargs)
        real_poll = xfer.poll

        def poll():
            state = real_poll()
            if state == "DONE" and not dropped:
                dropped.append(server.peers)
                server._peers[dropped[0][0]].channel.end()
                assert _until(lambda: not server.peers)  # hung up, then its runs freed
            return state

        xfer.poll = poll
        return xfer

    try:
        monkeypatch.setattr(staged, "read_rows", read_rows)
        canary = dst.block_digests([4, 5, 6])
        with pytest.raises(KVRuntimeError, match="hung up before this READ's end"):
            peer.pull([1, 2, 3], [4, 5, 6], request_id="reused", timeout=10)
        assert dropped, "the READ never ended"
        assert dst.block_digests([4, 5, 6]) == canary
        assert server.pool.largest_free_run() == server.pool.units
        assert _until(lambda: client.staging.largest_free_run() == client.staging.units)
    finally:
        client.close(), server.close()
        src.close(), dst.close()


def test_a_prefill_that_drops_a_live_decode_hangs_up_before_it_frees_its_runs(monkeypatch):
    """A decode still connected, holding a staged run, sends a frame the prefill refuses: the
    prefill drops it. When the run is freed (``Stages.drop``), the decode's end must already
    see the hang-up, so that a READ of the run whose end it sees later is never scattered
    (the test above). (Before: the runs were freed first, the hang-up came after.)"""
    server, client, peer, src, dst = _staged_pair()
    seen = []
    real = server.stages.drop

    def drop(agent):
        seen.append(peer.channel.hung_up())
        return real(agent)

    try:
        monkeypatch.setattr(server.stages, "drop", drop)
        peer.send(_stage_frame("held", [1, 2], 60))
        assert _until(lambda: server.pool.largest_free_run() < server.pool.units)
        peer.send({"type": "not-a-request"})  # refused: the prefill ends the connection
        assert _until(lambda: seen) and seen == [True]
        assert server.wait_released("held", 10)
        assert server.pool.largest_free_run() == server.pool.units
    finally:
        client.close(), server.close()
        src.close(), dst.close()
