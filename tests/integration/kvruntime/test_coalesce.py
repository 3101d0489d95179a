"""Coalesced NIXL transfers with real NIXL agents in two processes on this CPU host: both caches
registered (kv_buffer="device"), requests of many runs gathered by the prefill into its staging
pool chunk by chunk, READ with one descriptor a chunk into the decode's pool and scattered as
each lands. Bit-exact over random layouts and block lists with canaries around every
destination block; the pools' bounds (exhausted: waits to its deadline, fails with numbers;
larger than the pools: in pieces; not even a block fits: refused at once); a prefill killed
mid-request (fails by its deadline, the pool's
units come back, nothing lands in the cache after the failure is reported)."""

import random
import time
from dataclasses import replace

import pytest

from kvruntime.decode.client import DecodeClient
from kvruntime.errors import KVRuntimeError, TransferError, TransferTimeout
from kvruntime.layout import CROSS_LAYER, PER_LAYER, KVLayout
from kvruntime.memory import KVCache
from kvruntime.plan import make_plan
from kvruntime.pools.staging import StagingExhausted

pytestmark = pytest.mark.integration

CANARY = 0xA5


def random_layout(rnd, kind, blocks):
    return KVLayout(kind, rnd.choice([1, 2, 3]), blocks, rnd.choice([4, 16]),
                    rnd.choice([1, 2, 4]), rnd.choice([8, 32, 64]),
                    rnd.choice(["float16", "bfloat16", "float32"]))


def start_push(peer, push, client, src, dst, timeout):
    """A push the prefill process starts into ``dst`` (named first): its handle."""
    request = f"r{random.random()}"
    handle = peer.expect_push(dst, request_id=request, timeout=timeout)
    assert push(0, request, src, client.agent.name) is None
    return handle


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("op", ["pull", "push", "prefill_push"])
def test_coalesced_requests_are_bit_exact_and_touch_nothing_else(pushing_prefill, seed, op):
    """Random layout (kind, layers, tokens, heads, head size, dtype), random block lists,
    several requests; every block not named keeps its canary. Small chunks (the prefill's
    pool answers a run in many pieces) exercise the pipeline on small caches. prefill_push:
    the prefill starts each push (expect_push first); the decode has it staged and READs it."""
    rnd = random.Random(seed)
    kind = rnd.choice([CROSS_LAYER, PER_LAYER])
    layout = random_layout(rnd, kind, 96)
    with pushing_prefill([layout], seed=seed, staging_blocks=48) as (_p, ports, push):
        cache = KVCache.allocate_host(layout)
        cache.fill_value(CANARY)
        canary = cache.block_digest(0)
        with DecodeClient(cache, engine="nixl", coalesce="always", staging_blocks=48) as client:
            peer = client.connect("127.0.0.1", ports[0])
            assert peer.route is not None and peer.route.engine == "nixl"
            written = set()
            for _ in range(4):
                count = rnd.randint(1, 22)
                src = rnd.sample(range(96), count)
                dst = rnd.sample(sorted(set(range(96)) - written), count)
                if op == "prefill_push":
                    res = start_push(peer, push, client, src, dst, 30).wait(30)
                else:
                    res = getattr(peer, op)(src, dst, timeout=30)
                assert res.coalesced and res.coalesce_reason == "coalesce='always'"
                assert res.engine == "nixl" and res.nbytes == count * layout.block_bytes
                assert peer.digests(src) == cache.block_digests(dst)
                written.update(dst)
            others = sorted(set(range(96)) - written)
            assert cache.block_digests(others) == [canary] * len(others)
            assert client.pool.largest_free_run() == client.pool.units  # all given back
        cache.close()


def test_chunks_pipeline_a_run_in_pieces(prefill):
    """A run larger than a chunk is answered in several pieces, each its own descriptor."""
    layout = KVLayout(CROSS_LAYER, 2, 160, 16, 8, 128, "float16")  # 128 KiB blocks
    with prefill([layout], seed=5, staging_blocks=160) as (_p, ports):
        cache = KVCache.allocate_host(layout)
        with DecodeClient(cache, engine="nixl", coalesce="always", staging_blocks=160) as client:
            peer = client.connect("127.0.0.1", ports[0])
            src = random.Random(3).sample(range(160), 150)  # ~19 MiB: chunks of 4 MiB
            res = peer.pull(src, list(range(150)), timeout=30)
            assert res.coalesced and res.descriptors == len(client.pool.chunks(150, 8)) == 5
            assert peer.digests(src) == cache.block_digests(range(150))
        cache.close()


def test_auto_chooses_by_the_probe_and_says_why(prefill):
    layout = KVLayout(PER_LAYER, 2, 128, 16, 4, 64, "float16")
    with prefill([layout], seed=2) as (_p, ports):
        cache = KVCache.allocate_host(layout)
        with DecodeClient(cache, engine="nixl") as client:  # coalesce="auto"
            peer = client.connect("127.0.0.1", ports[0])
            model = peer.coalesce_model
            assert model is not None and model.descriptor_us >= 0 and model.gather_gbps > 0
            # our gather: the client's, measured at its start; the round trip no longer than
            # the handshake's first exchange (the least of it and the "pool" one)
            assert client.gather_cost is not None
            assert model.gather_fixed_us == client.gather_cost.fixed_us
            assert model.gather_gbps <= client.gather_cost.gbps  # host: at most the wire's
            assert 0 < model.round_trip_us <= peer.info.round_trip * 1e6
            one = peer.pull(list(range(8)), list(range(8)), timeout=30)  # one run: direct
            assert not one.coalesced and one.coalesce_reason.startswith("auto: 4 descriptors")
            src = random.Random(1).sample(range(128), 100)
            many = peer.pull(src, list(range(100)), timeout=30)
            descriptors = make_plan(layout, src, layout, list(range(100))).descriptor_count
            assert (many.coalesced, many.coalesce_reason) == model.choose(descriptors, many.nbytes)
            assert peer.digests(src) == cache.block_digests(range(100))
        cache.close()


def test_a_cache_too_small_to_measure_our_gather_leaves_auto_direct_and_says_why(prefill):
    """Our gather is measured at the client's start (measure_gather): a cache of three blocks
    cannot gather two scattered ones, so there is none, the connect's probe cannot make a
    model, and auto's requests go direct saying so."""
    layout = KVLayout(PER_LAYER, 2, 3, 16, 4, 64, "float16")
    with prefill([layout], seed=4) as (_p, ports):
        cache = KVCache.allocate_host(layout)
        with DecodeClient(cache, engine="nixl") as client:  # coalesce="auto"
            assert client.gather_cost is None
            peer = client.connect("127.0.0.1", ports[0])
            assert peer.coalesce_model is None
            result = peer.pull([0, 2], [2, 0], timeout=30)
            assert not result.coalesced
            assert "our gather unmeasured at our start" in result.coalesce_reason
            assert peer.digests([0, 2]) == cache.block_digests([2, 0])
        cache.close()


def test_the_probe_reads_part_of_each_large_chunk_and_the_wire_from_whole_ones(prefill,
                                                                              monkeypatch):
    """Host memory, cross-layer chunks of 64 KiB: the probe's descriptor READs take 32 KiB of
    every other chunk (PROBE_PIECE_BYTES) and the same bytes in one range, and the wire's rate
    is read from the whole chunks in one range (three READs each, after the warm one); the
    model comes of them."""
    from kvruntime.engines import coalesce

    layout = KVLayout(CROSS_LAYER, 2, 96, 16, 4, 128, "float16")
    assert layout.chunk_bytes == 64 << 10
    reads = []
    real = coalesce._read

    def read(peer, local_rows, remote_rows, remote_mem):
        reads.append([int(n) for n in remote_rows[:, 1]])
        return real(peer, local_rows, remote_rows, remote_mem)

    monkeypatch.setattr(coalesce, "_read", read)
    with prefill([layout], seed=3) as (_p, ports):
        cache = KVCache.allocate_host(layout)
        with DecodeClient(cache, engine="nixl") as client:  # coalesce="auto"
            peer = client.connect("127.0.0.1", ports[0])
            model = peer.coalesce_model
            k = 48  # PROBE_BLOCKS["host"], at most half the peer's blocks
            probe = reads[1:]  # after the warm READ of one unit
            assert len(probe) == 9
            assert all(r == [32 << 10] * k for r in probe[:3])  # scattered, part of each
            assert all(sum(r) == k * (32 << 10) for r in probe[3:6])  # the same bytes, in one
            assert all(sum(r) == k * (64 << 10) for r in probe[6:])  # the whole chunks
            assert model is not None and model.wire_gbps > 0 and model.descriptor_us >= 0
        cache.close()


@pytest.mark.parametrize("op", ["pull", "push", "prefill_push"])
def test_a_request_larger_than_the_pools_moves_in_pieces(pushing_prefill, op):
    """40 units against a prefill pool of 32 and a decode pool of 64: two pieces of 8 and 2
    blocks, one after the other, one request and one result, bit-exact, canaries kept; both
    pools whole again after it."""
    layout = KVLayout(CROSS_LAYER, 2, 64, 16, 4, 32, "float16")
    with pushing_prefill([layout], seed=3, staging_blocks=8) as (_p, ports, push):  # 32 units
        cache = KVCache.allocate_host(layout)
        cache.fill_value(CANARY)
        canary = cache.block_digest(0)
        with DecodeClient(cache, engine="nixl", coalesce="always", staging_blocks=16) as client:
            peer = client.connect("127.0.0.1", ports[0])
            src, dst = [2 * i for i in range(10)], list(range(20, 30))
            if op == "prefill_push":
                res = start_push(peer, push, client, src, dst, 30).wait(30)
            else:
                res = getattr(peer, op)(src, dst, timeout=30)
            assert res.coalesced and res.coalesce_reason == (
                "coalesce='always'; in 2 pieces (40 units, the pools hold 32)")
            assert res.nbytes == 10 * layout.block_bytes and res.descriptors == 2
            assert peer.digests(src) == cache.block_digests(dst)
            others = [b for b in range(64) if b not in dst]
            assert cache.block_digests(others) == [canary] * len(others)
            assert client.pool.largest_free_run() == client.pool.units
            again = peer.pull([1, 3], [40, 41], timeout=10)  # the prefill's pool is whole too:
            assert again.coalesced  # nothing of the pieces is left held
        cache.close()


def test_a_pool_that_cannot_hold_a_block_is_refused_at_once(prefill):
    """A block of 4 heads (4 units) against a prefill pool that offers 2 units: never
    possible, so refused when started, with the numbers. No real pool is that small (it
    holds at least one block of its own side's heads): the prefill's offer, input from the
    peer, is edited here to say so."""
    layout = KVLayout(CROSS_LAYER, 2, 64, 16, 4, 32, "float16")
    with prefill([layout], seed=3, staging_blocks=8) as (_p, ports):
        cache = KVCache.allocate_host(layout)
        with DecodeClient(cache, engine="nixl", coalesce="always", staging_blocks=16) as client:
            peer = client.connect("127.0.0.1", ports[0])
            route = peer.route
            peer.mover.route = replace(route, remote_units=2)  # its engine's way (engine.py)
            t = time.monotonic()
            with pytest.raises(StagingExhausted, match=r"a block is 4 units, the decode's pool "
                                                       r"64, the prefill's 2"):
                peer.pull([2 * i for i in range(10)], timeout=30)
            assert time.monotonic() - t < 5  # not at its deadline
            peer.mover.route = route
            peer.pull([1, 3], timeout=10)  # and the peer goes on serving
            assert peer.digests([1, 3]) == cache.block_digests([1, 3])
        cache.close()


def test_an_exhausted_pool_waits_until_the_deadline_and_fails_with_its_numbers(prefill):
    """The decode's pool held (by other requests: here taken by hand) fails a request at its
    deadline with the pool's numbers; the prefill's pool units it took come back (unstage),
    and once ours are free again the same request goes through."""
    layout = KVLayout(CROSS_LAYER, 2, 64, 16, 4, 32, "float16")
    with prefill([layout], seed=4, staging_blocks=16) as (_p, ports):
        cache = KVCache.allocate_host(layout)
        with DecodeClient(cache, engine="nixl", coalesce="always", staging_blocks=16) as client:
            peer = client.connect("127.0.0.1", ports[0])
            held = client.pool.try_acquire(40)  # 24 of 64 units left
            t = time.monotonic()
            with pytest.raises(TransferTimeout, match=r"decode's staging pool is exhausted: 32 "
                                                      r"units asked, 24 free \(largest free run "
                                                      r"24\) of 64"):
                peer.pull([5, 9, 11, 20, 21, 22, 40, 50], timeout=0.5)
            assert 0.5 <= time.monotonic() - t < 5
            client.pool.release(held, 40)
            for _ in range(3):  # the prefill freed its run: three more need it whole each time
                peer.pull([5, 9, 11, 20, 21, 22, 40, 50], list(range(8)), timeout=10)
            assert peer.digests([5, 9, 11, 20, 21, 22, 40, 50]) == cache.block_digests(range(8))
        cache.close()


def _answered(handle, pieced: bool) -> bool:
    """The prefill has answered a chunk (``pieced``: every READ of the first piece has ended,
    and the next piece is asked for)."""
    job = handle._xfer
    if job is None:
        return False
    return job._asked_next or job._piece > 0 if pieced else bool(job._ready)


def _all_answered(handle) -> bool:
    """Every chunk of an unpieced request's run is answered: it needs the prefill no more."""
    job = handle._xfer
    return bool(job._ready) and job._ready[-1][1] == job._rows


@pytest.mark.parametrize("op", ["pull", "prefill_push"])
@pytest.mark.parametrize("decode_pool", [200, 64])
def test_a_prefill_killed_mid_request_fails_it_and_nothing_lands_after(pushing_prefill, op,
                                                                       decode_pool):
    """Killed after its first chunk's answer (a pull, or a push it started): the request fails
    (the READ's error, the lost side channel or its deadline), our pool's units come back once
    nothing can write into them, and the destination blocks hold, after the failure is
    reported, exactly what they held when it was reported. A decode pool of 64 blocks: in 3
    pieces, killed once the second is asked for while the first still scatters."""
    layout = KVLayout(CROSS_LAYER, 2, 200, 16, 8, 256, "float16")  # 256 KiB blocks
    with pushing_prefill([layout], seed=6, staging_blocks=200) as (proc, ports, push):
        cache = KVCache.allocate_host(layout)
        cache.fill_value(CANARY)
        with DecodeClient(cache, engine="nixl", coalesce="always", staging_blocks=decode_pool,
                          timeout=2) as client:
            peer = client.connect("127.0.0.1", ports[0])
            src = random.Random(9).sample(range(200), 190)  # 47.5 MiB: 12 chunks
            dst = list(range(190))
            pieced = decode_pool < 190
            for _attempt in range(10):
                if op == "pull":
                    handle = peer.start_pull(src, dst, timeout=5)
                else:
                    handle = start_push(peer, push, client, src, dst, 5)
                until = time.monotonic() + 10
                while not _answered(handle, pieced) and time.monotonic() < until:
                    handle.poll()
                assert _answered(handle, pieced), "no chunk was answered"
                # the kill must find a chunk the prefill has not answered yet (a pieced request:
                # the next piece, always); one whose every chunk was answered before our first
                # look needs the prefill no more, proves nothing, and is let finish
                if pieced or not _all_answered(handle):
                    break
                handle.wait(15)
            else:
                pytest.fail("the prefill answered every chunk before the decode's first look, "
                            "ten times")
            proc.kill()
            with pytest.raises(TransferError):
                handle.wait(15)
            reported = cache.block_digests(dst)
            until = time.monotonic() + 10
            while not handle.settled and time.monotonic() < until:
                client.get_settled()
                time.sleep(0.01)
            assert handle.settled
            time.sleep(0.3)
            client.get_settled()
            assert cache.block_digests(dst) == reported  # nothing landed after the report
            assert client.pool.largest_free_run() == client.pool.units
        cache.close()


def _decode_that_dies_mid_request(port: int, layout, request: str, pool: int) -> None:
    """A decode process: a coalesced pull through the pools, killed (SIGKILL, by itself) once
    its first chunk is answered (of a pieced request, once its second piece is asked for): it
    never unstages (that piece)."""
    import os
    import signal

    cache = KVCache.allocate_host(layout)
    client = DecodeClient(cache, engine="nixl", coalesce="always", staging_blocks=pool)
    peer = client.connect("127.0.0.1", port)
    handle = peer.start_pull(list(range(0, 190)), list(range(190)), request_id=request, timeout=1)
    until = time.monotonic() + 10
    while not _answered(handle, pool < 190) and time.monotonic() < until:
        handle.poll()
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("decode_pool", [200, 64])
def test_a_decode_killed_mid_request_has_the_prefills_run_freed_and_released(decode_pool):
    """The decode process dies after the prefill answered its first chunk (a decode pool of 64
    blocks: once the first piece is unstaged and the second asked for), so no "unstage" comes:
    well after the request's deadline the prefill frees its pool's run and releases the
    request (get_released names it), as an unstaged one: a prefill's blocks never stay taken
    by a decode that is gone."""
    import multiprocessing

    from kvruntime.prefill.server import PrefillServer

    layout = KVLayout(CROSS_LAYER, 2, 200, 16, 8, 256, "float16")  # 256 KiB blocks
    cache = KVCache.allocate_host(layout)
    cache.fill_random(3)
    with PrefillServer(cache, coalesce="always", staging_blocks=200) as server:
        child = multiprocessing.get_context("spawn").Process(
            target=_decode_that_dies_mid_request,
            args=(server.address[1], layout, "gone-1", decode_pool))
        child.start()
        child.join(60)
        assert child.exitcode == -9, child.exitcode
        released, until = [], time.monotonic() + 20  # deadline 1 s, then the 5 s expiry
        while not released and time.monotonic() < until:
            released = [r for _agent, r in server.get_released() if r == "gone-1"]
            time.sleep(0.1)
        assert released == ["gone-1"]
        assert server.pool.largest_free_run() == server.pool.units
        time.sleep(0.5)
        assert not [r for _agent, r in server.get_released() if r == "gone-1"]  # once only
    cache.close()


def test_a_pushed_request_waits_for_an_exhausted_pool_until_its_deadline(pushing_prefill):
    """A push the prefill starts, through the pools, while the decode's pool is held: it fails
    at its deadline with the pool's numbers and nothing lands; once the pool is free the same
    push goes through."""
    layout = KVLayout(CROSS_LAYER, 2, 64, 16, 4, 32, "float16")
    with pushing_prefill([layout], seed=4, staging_blocks=16) as (_p, ports, push):
        cache = KVCache.allocate_host(layout)
        cache.fill_value(CANARY)
        canary = cache.block_digest(0)
        with DecodeClient(cache, engine="nixl", coalesce="always", staging_blocks=16) as client:
            peer = client.connect("127.0.0.1", ports[0])
            held = client.pool.try_acquire(40)  # 24 of 64 units left
            src, dst = [5, 9, 11, 20, 21, 22, 40, 50], list(range(8))
            handle = start_push(peer, push, client, src, dst, 0.5)
            with pytest.raises(TransferTimeout, match=r"decode's staging pool is exhausted: 32 "
                                                      r"units asked, 24 free"):
                handle.wait(5)
            assert handle.settled
            assert cache.block_digests(dst) == [canary] * 8
            client.pool.release(held, 40)
            res = start_push(peer, push, client, src, dst, 10).wait(10)
            assert res.coalesced and peer.digests(src) == cache.block_digests(dst)
            assert client.pool.largest_free_run() == client.pool.units
        cache.close()


def test_a_prefill_that_refuses_pools_leaves_requests_direct(prefill):
    layout = KVLayout(CROSS_LAYER, 2, 64, 16, 4, 32, "float16")
    with prefill([layout], seed=7, coalesce="never") as (_p, ports):
        cache = KVCache.allocate_host(layout)
        with DecodeClient(cache, engine="nixl", coalesce="always") as client:
            peer = client.connect("127.0.0.1", ports[0])
            assert peer.route is None
            assert peer.coalesce_reason == ("direct: the prefill offers no staging pool: "
                                            "coalesce='never' on this prefill")
            res = peer.pull([1, 5, 9], timeout=10)
            assert not res.coalesced and res.coalesce_reason == peer.coalesce_reason
        cache.close()
    cache = KVCache.allocate_host(layout)
    with pytest.raises(KVRuntimeError, match="coalesce must be one of auto, always, never"):
        DecodeClient(cache, coalesce="sometimes")
    cache.close()


def test_start_pulls_of_a_direct_peer_coalesce_as_start_pull_does(prefill):
    """coalesce="always" holds for a batch too: each request of ``start_pulls`` goes through
    the pools, as ``start_pull`` would take it (before: posted direct, ``coalesced`` False)."""
    layout = KVLayout(CROSS_LAYER, 2, 64, 16, 4, 32, "float16")
    with prefill([layout], seed=9, staging_blocks=16) as (_p, ports):
        cache = KVCache.allocate_host(layout)
        cache.fill_value(CANARY)
        canary = cache.block_digest(0)
        with DecodeClient(cache, engine="nixl", coalesce="always", staging_blocks=16) as client:
            peer = client.connect("127.0.0.1", ports[0])
            requests = [([1, 5, 9], [10, 30, 31], None), ([2, 60], [0, 63], None)]
            results = client.wait_all(peer.start_pulls(requests, timeout=20), timeout=30)
            assert [r.coalesced for r in results] == [True, True]
            assert {r.coalesce_reason for r in results} == {"coalesce='always'"}
            for src, dst, _rid in requests:
                assert peer.digests(src) == cache.block_digests(dst)
            others = sorted(set(range(64)) - {10, 30, 31, 0, 63})
            assert cache.block_digests(others) == [canary] * len(others)
            assert client.pool.largest_free_run() == client.pool.units
        cache.close()
