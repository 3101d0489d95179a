"""Pushes the prefill starts (``expect_push`` / ``start_push``), with real NIXL agents and host
memory over 127.0.0.1: the decode names the blocks, the prefill WRITEs them with a NIXL
notification, and the notification alone finishes the decode's handle. Both orders (named
first, pushed first), many in flight beside pulls, deadlines on either side, ids checked on
both, forged notifications ignored. The prefill runs in the test's process (its own agent):
start_push is the prefill engine's call."""

import logging
import time

import pytest

from kvruntime.decode.client import DecodeClient
from kvruntime.errors import KVRuntimeError, TransferError, TransferTimeout
from kvruntime.layout import CROSS_LAYER, PER_LAYER, KVLayout
from kvruntime.memory import KVCache
from kvruntime.prefill.server import PrefillServer
from kvruntime.wire import frames, messages

pytestmark = pytest.mark.integration


def small(kind=CROSS_LAYER, blocks=128):
    return KVLayout(kind, 2, blocks, 16, 4, 32, "float16")


def _wait_expected(server, request, peer=None, seconds=5.0):
    until = time.monotonic() + seconds
    while not server.expects(request, peer):
        assert time.monotonic() < until, f"the prefill never saw the decode name {request}"
        time.sleep(0.001)


@pytest.mark.parametrize("engine,op,moved_by", [
    ("nixl", "WRITE", "nixl"),
    # a decode that opened the prefill's memory gets the ids ("ready") and copies them itself
    ("samenode", "READ", "samenode:process_vm_readv"),
    # through the pools: the decode gets the ids, has them staged and READs the run
    ("coalesced", "READ", "nixl")])
@pytest.mark.parametrize("kind", [CROSS_LAYER, PER_LAYER])
def test_named_first_then_pushed_lands_bit_exact(kind, engine, op, moved_by):
    layout = small(kind)
    src, dst = KVCache.allocate_host(layout), KVCache.allocate_host(layout)
    src.fill_random(3)
    dst.fill_value(0)
    options = (dict(engine="nixl", coalesce="always") if engine == "coalesced" else
               dict(engine=engine, coalesce="never"))
    with PrefillServer(src) as server, DecodeClient(dst, **options) as client:
        peer = client.connect(*server.address)
        handle = peer.expect_push([10, 11, 12, 40], request_id="r1", timeout=20)
        _wait_expected(server, "r1", client.agent.name)
        assert not handle.done()  # named, not pushed: nothing has moved
        server.start_push("r1", [3, 4, 5, 90])
        if engine == "samenode":
            assert not server.writes.in_flight  # nothing posted to NIXL
        result = handle.wait(10)
        assert result.op == op and result.engine == moved_by
        assert result.nbytes == 4 * layout.block_bytes
        # two runs, or one chunk of the pools
        assert result.descriptors == (1 if engine == "coalesced" else 2 * layout.num_regions)
        if engine != "samenode":
            assert result.coalesced == (engine == "coalesced")
            assert result.coalesce_reason == ("coalesce='always'" if engine == "coalesced"
                                              else "coalesce='never'")
        assert 0 < result.seconds < 10  # from the prefill's start to the arrival
        assert dst.block_digests([10, 11, 12, 40]) == src.block_digests([3, 4, 5, 90])
        assert server.wait_released("r1", 5, peer=client.agent.name)  # our blocks are free
        assert handle.settled and peer.in_flight == 0 and not peer.channel.pending
    src.close(), dst.close()


def test_pushed_first_waits_for_the_decode_then_lands(either_pair):
    server, client, peer, src, dst = either_pair
    server.start_push("early", [7, 8])  # no decode named it yet: kept, not an error
    assert not server.expects("early")
    time.sleep(0.05)
    handle = peer.expect_push([60, 61], request_id="early", timeout=20)
    assert handle.wait(10).coalesced == (client.coalesce == "always")
    assert dst.block_digests([60, 61]) == src.block_digests([7, 8])
    assert server.wait_released("early", 5, peer=client.agent.name)


def test_many_in_flight_beside_pulls_collected_by_get_finished(either_pair):
    """An engine's step loop: pulls and prefill pushes in flight together, collected by
    get_finished; the prefill pushes in another order than they were named."""
    server, client, peer, src, dst = either_pair
    named = {f"p{i}": ([2 * i, 2 * i + 1], [64 + 2 * i, 65 + 2 * i]) for i in range(16)}
    handles = [peer.expect_push(d, request_id=r, timeout=30) for r, (_s, d) in named.items()]
    handles += [peer.start_pull([100 + i], [40 + i], request_id=f"q{i}", timeout=30)
                for i in range(8)]
    for r in reversed(list(named)):
        _wait_expected(server, r)
        server.start_push(r, named[r][0], peer=client.agent.name)
    finished, until = [], time.monotonic() + 30
    while len(finished) < len(handles) and time.monotonic() < until:
        finished += client.get_finished()
    assert sorted(map(id, finished)) == sorted(map(id, handles))
    assert all(h.ok for h in finished), [h.error for h in finished if not h.ok]
    for r, (s, d) in named.items():
        assert dst.block_digests(d) == src.block_digests(s), r
    assert dst.block_digests(range(40, 48)) == src.block_digests(range(100, 108))
    assert client.in_flight == 0


def test_a_request_never_pushed_fails_at_its_deadline_and_is_dropped(either_pair):
    """The decode gives up at its deadline and says so; the prefill forgets the blocks it was
    given, so a late start_push writes nothing: it waits for a decode that never comes and
    is released with agent "" at its own timeout."""
    server, client, peer, src, dst = either_pair
    before = dst.block_digest(5)
    handle = peer.expect_push([5], request_id="never", timeout=0.4)
    _wait_expected(server, "never")
    with pytest.raises(TransferTimeout, match="had not pushed it"):
        handle.wait(10)
    until = time.monotonic() + 5  # the cancel's answer settles it
    while not handle.settled and time.monotonic() < until:
        peer.pump()
        time.sleep(0.01)
    assert handle.settled and not server.expects("never")
    server.start_push("never", [9], timeout=0.3)
    assert server.wait_released("never", 5, peer="")
    assert dst.block_digest(5) == before


def test_the_prefill_drops_a_named_request_past_its_deadline(either_pair):
    """The prefill's own sweep: a named request it has not pushed by the decode's deadline is
    dropped and the decode hears why, even when its own timer has not fired yet (here its
    handle's deadline is moved later, as a decode clock behind the prefill's would)."""
    server, client, peer, src, dst = either_pair
    before = dst.block_digest(6)
    handle = peer.expect_push([6], request_id="late", timeout=0.3)
    handle.deadline += 10
    _wait_expected(server, "late")
    with pytest.raises(TransferError, match="had not pushed it by its deadline"):
        handle.wait(10)
    assert handle.settled and not server.expects("late")
    # dropped before any block of the prefill's was given
    assert "late" not in {r for _agent, r in server.get_released()}
    server.start_push("late", [9], timeout=0.2)  # too late: kept for a decode, then released
    assert server.wait_released("late", 5, peer="")
    assert dst.block_digest(6) == before


def test_ids_are_checked_on_both_sides_and_a_bad_push_keeps_the_request(either_pair):
    server, client, peer, src, dst = either_pair
    with pytest.raises(KVRuntimeError, match="out of range|outside"):
        peer.expect_push([500], request_id="bad")  # our cache has 128 blocks
    with pytest.raises(KVRuntimeError, match="twice|duplicate"):
        peer.expect_push([3, 3], request_id="dup")
    handle = peer.expect_push([20, 21], request_id="n", timeout=20)
    _wait_expected(server, "n")
    with pytest.raises(KVRuntimeError, match="2 destination|source blocks"):
        server.start_push("n", [1, 2, 3])  # three for two
    with pytest.raises(KVRuntimeError, match="out of range|outside"):
        server.start_push("n", [1, 999])
    assert server.expects("n") and not handle.done()  # nothing was lost: push it right
    server.start_push("n", [1, 2])
    handle.wait(10)
    assert dst.block_digests([20, 21]) == src.block_digests([1, 2])
    for bad in ("", "x" * 257, None):
        with pytest.raises(KVRuntimeError, match="request must be"):
            server.start_push(bad, [1])
    with pytest.raises(KVRuntimeError, match="timeout"):
        server.start_push("t", [1], timeout=0)
    with pytest.raises(KVRuntimeError, match="no decode agent"):
        server.start_push("t", [1], peer="nobody")


def test_two_decodes_naming_one_request_need_the_peer_said():
    layout = small()
    src = KVCache.allocate_host(layout)
    src.fill_random(4)
    dsts = [KVCache.allocate_host(layout) for _ in range(2)]
    with PrefillServer(src) as server, DecodeClient(dsts[0], engine="nixl") as a, \
            DecodeClient(dsts[1], engine="nixl") as b:
        ha = a.connect(*server.address).expect_push([1], request_id="same", timeout=20)
        hb = b.connect(*server.address).expect_push([2], request_id="same", timeout=20)
        _wait_expected(server, "same", a.agent.name)
        _wait_expected(server, "same", b.agent.name)
        with pytest.raises(KVRuntimeError, match="named by 2 decodes"):
            server.start_push("same", [30])
        server.start_push("same", [30], peer=b.agent.name)
        server.start_push("same", [31], peer=a.agent.name)
        ha.wait(10), hb.wait(10)
        assert dsts[0].block_digest(1) == src.block_digest(31)
        assert dsts[1].block_digest(2) == src.block_digest(30)
    src.close()
    for d in dsts:
        d.close()


def test_forged_notifications_finish_nothing(pair, caplog):
    """A notification is input from the peer: junk, an unknown request, a "staged", or one
    without the session's MAC is logged and ignored; only the prefill's own WRITE finishes an
    expected push."""
    server, client, peer, src, dst = pair
    handle = peer.expect_push([50], request_id="real", timeout=20)
    _wait_expected(server, "real")
    me = client.agent.name
    send = server.agent.nixl.send_notif
    for raw in (b"junk", b"\xff" * 2000,
                frames.encode_notif({"type": "pushed", "request": "other"}),
                frames.encode_notif({"type": "staged", "request": "real"}),
                b'{"v":1,"type":"pushed","request":"real"}'):
        send(me, raw)
    with caplog.at_level(logging.WARNING, logger="kvruntime"):
        until = time.monotonic() + 2
        while time.monotonic() < until:
            assert not handle.done()
            time.sleep(0.01)
    assert "ignored" in caplog.text and "notification" in caplog.text
    server.start_push("real", [70])
    handle.wait(10)
    assert dst.block_digest(50) == src.block_digest(70)


def test_a_notification_without_the_sessions_mac_finishes_nothing(pair):
    """A well-formed "pushed" notification for the very request the decode waits for, as
    anyone who can send the decode's agent a notification could forge it: without the
    session's MAC (protocol 11) it is ignored, and only the prefill's own push finishes the
    handle. Before, it finished the handle with nothing written."""
    server, client, peer, src, dst = pair
    handle = peer.expect_push([51], request_id="real2", timeout=20)
    _wait_expected(server, "real2")
    dst.fill_value(0)
    zero = dst.block_digest(51)
    forged = frames.encode_notif({"type": "pushed", "request": "real2", "posted": time.time(),
                                  "descriptors": 1})
    server.agent.nixl.send_notif(client.agent.name, forged)
    until = time.monotonic() + 1
    while time.monotonic() < until:
        assert not handle.done()
        time.sleep(0.01)
    assert dst.block_digest(51) == zero
    server.start_push("real2", [71])
    handle.wait(10)
    assert dst.block_digest(51) == src.block_digest(71)


def _poll_until(client, done, seconds=10.0):
    until = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < until, "the notification never came"
        client.progress_worker()
        time.sleep(0.005)


def test_a_notification_of_an_earlier_connection_is_late_not_forged(pair, caplog):
    """A prefill posts a sealed "warm" notification at each connect of a device-memory decode
    (prefill/warm.py); a decode that connects again at once gets it after its new session's
    keys are in place (2 x H200: a bench's ten handshakes in a row logged "failed its MAC
    (forged or changed on the way)" three times). Forced here on host memory, where no warm is
    sent: one sealed with the first connection's session, sent after the second connect, is
    counted as late and not warned of; one sealed with a session the decode never held is
    still called forged, and the new connection's pushes land."""
    server, client, first, src, dst = pair
    old = server._peers[client.agent.name].info.session  # the prefill's side of it
    peer = client.connect(*server.address)
    assert server._peers[client.agent.name].info.session is not old
    send, me = server.agent.nixl.send_notif, client.agent.name
    with caplog.at_level(logging.WARNING, logger="kvruntime"):
        send(me, frames.encode_notif(messages.WARM.build(), old))
        _poll_until(client, lambda: client.late_notifs == 1)
        assert "notification" not in caplog.text
        stranger = frames.Session(b"s" * 32, b"r" * 32)
        send(me, frames.encode_notif(messages.WARM.build(), stranger))
        _poll_until(client, lambda: "failed its MAC" in caplog.text)
    assert client.late_notifs == 1
    handle = peer.expect_push([52], request_id="after", timeout=20)
    _wait_expected(server, "after")
    server.start_push("after", [72])
    handle.wait(10)
    assert dst.block_digest(52) == src.block_digest(72)


@pytest.mark.parametrize("asked_by", ["prefill", "decode"])
def test_a_replayed_notification_finishes_no_later_push_of_the_same_id(pair, monkeypatch,
                                                                        asked_by, caplog):
    """Request ids are the caller's and may come again. A genuine, sealed "pushed"
    notification of a push that ended, sent again while a later push of the same id waits (as
    anyone who saw it on the UCX path could), names that earlier push's number (protocol 14):
    it is ignored, and only the later push's own WRITE finishes the handle. Before, it
    finished the handle with nothing written."""
    server, client, peer, src, dst = pair
    sealed = []
    encode = frames.encode_notif
    monkeypatch.setattr(frames, "encode_notif",
                        lambda *a, **k: sealed.append(encode(*a, **k)) or sealed[-1])

    def push(dst_block, src_block):
        if asked_by == "decode":
            return peer.start_push([src_block], [dst_block], request_id="again", timeout=20)
        handle = peer.expect_push([dst_block], request_id="again", timeout=20)
        _wait_expected(server, "again")
        server.start_push("again", [src_block])
        return handle

    push(52, 72).wait(10)
    assert dst.block_digest(52) == src.block_digest(72) and len(sealed) == 1
    server.wait_released("again", 5, peer=client.agent.name)
    dst.fill_value(0)
    zero = dst.block_digest(53)
    if asked_by == "decode":  # the prefill is held back: its WRITE cannot answer first
        monkeypatch.setattr(server.pushes, "start_write", lambda *a: None)
        later = peer.start_push([73], [53], request_id="again", timeout=20)
    else:
        later = peer.expect_push([53], request_id="again", timeout=20)
        _wait_expected(server, "again")
    with caplog.at_level(logging.WARNING, logger="kvruntime"):
        server.agent.nixl.send_notif(client.agent.name, sealed[0])
        until = time.monotonic() + 20  # until the decode has read it and said why it ignored it
        while "replayed" not in caplog.text:
            assert not later.done() and time.monotonic() < until, caplog.text
            time.sleep(0.01)
    assert not later.done() and dst.block_digest(53) == zero
    if asked_by == "decode":  # its frame was dropped: the close cancels it, the prefill answers
        return
    server.start_push("again", [73])
    later.wait(10)
    assert dst.block_digest(53) == src.block_digest(73)


@pytest.mark.parametrize("posted,descriptors", [(10 ** 400, 10 ** 400), ("soon", -3),
                                                (-1.5, True)], ids=["huge", "text", "negative"])
def test_a_notifications_informing_fields_out_of_range_are_as_good_as_absent(
        pair, monkeypatch, posted, descriptors):
    """A "pushed" notification's "posted" (when the prefill started the push) and
    "descriptors" only inform its result: past a float's range, text or negative they are
    read as absent (the push is timed from the caller's start, its descriptors are the
    plan's), and the push finishes. (Before: an integer past a float's range raised
    OverflowError out of the caller's poll, and the push never finished.)"""
    server, client, peer, src, dst = pair
    encode = frames.encode_notif
    monkeypatch.setattr(frames, "encode_notif", lambda notify, session: encode(
        {**notify, "posted": posted, "descriptors": descriptors}, session))
    handle = peer.expect_push([44], request_id="inform", timeout=20)
    _wait_expected(server, "inform")
    server.start_push("inform", [64])
    result = handle.wait(10)
    assert dst.block_digest(44) == src.block_digest(64)
    assert 0 < result.seconds < 20 and result.descriptors == 1


@pytest.mark.parametrize("number", [None, 0, -1, True, 1.0, "7", 1 << 63])
@pytest.mark.parametrize("kind", ["push", "expect"])
def test_a_push_frame_without_a_good_number_ends_its_connection(pair, kind, number):
    """A "push" or "expect" frame's number is the peer's input: missing, not a positive
    integer below 2**63 (a bool, a float, text, too large to echo) ends the connection, said
    in one line, as any malformed frame does; nothing is written or named."""
    server, client, peer, src, dst = pair
    message = {"type": kind, "request": "n1", "timeout": 20, "deadline": time.time() + 20,
               "src" if kind == "push" else "dst": frames.pack_ids([1]),
               **({"dst": frames.pack_ids([2])} if kind == "push" else {})}
    if number is not None:
        message["number"] = number
    peer.send(message)
    until = time.monotonic() + 5
    while not server.stats.refused and time.monotonic() < until:
        time.sleep(0.01)
    assert [why for _addr, why in server.stats.refused] == [
        f"{kind!r} frame field 'number' must be " + (
            "an integer in 1..2**63-1, got " + str(number) if type(number) is int
            else "int, got " + type(number).__name__)]
    assert not server.expects("n1") and not server.writes.in_flight


@pytest.mark.parametrize("kind,name,value,why", [
    ("push", "split", 0, "must be an integer in 1..1024, got 0"),
    ("push", "split", 1025, "must be an integer in 1..1024, got 1025"),
    ("push", "split", 2.5, "must be int, got float"),
    ("push", "split", "2", "must be int, got str"),
    ("push", "timeout", 0, "must be a finite positive number of seconds, got 0"),
    ("expect", "timeout", -5, "must be a finite positive number of seconds, got -5"),
    ("push", "deadline", 10 ** 400, "must be a finite number of seconds, got " + "1" + "0" * 23),
    ("expect", "deadline", "soon", "must be int or float, got str"),
], ids=lambda v: str(v)[:12])
def test_a_push_frame_field_out_of_its_range_ends_its_connection(pair, kind, name, value, why):
    """A push's split, timeout and deadline are the peer's input too: a split outside
    1..MAX_SPLIT (before, anything but a positive integer was taken as 1), a timeout that is
    not a positive number, a deadline past a float's range end the connection, said in one
    line; nothing is written or named. (NaN and Infinity never get this far: the frame's JSON
    is refused, test_frames.py.)"""
    server, client, peer, src, dst = pair
    message = {"type": kind, "request": "r1", "number": 1, "timeout": 20,
               "deadline": time.time() + 20, "dst": frames.pack_ids([2]),
               **({"src": frames.pack_ids([1])} if kind == "push" else {}), name: value}
    peer.send(message)
    until = time.monotonic() + 5
    while not server.stats.refused and time.monotonic() < until:
        time.sleep(0.01)
    assert [why for _addr, why in server.stats.refused] == [
        f"{kind!r} frame field {name!r} {why}"]
    assert not server.expects("r1") and not server.writes.in_flight


def test_a_callers_split_outside_its_range_is_refused_before_anything_is_sent(pair):
    server, client, peer, src, dst = pair
    for split in (0, 1025, 2.0, True):
        for start in (peer.start_push, peer.start_pull):
            with pytest.raises(KVRuntimeError, match=r"split must be an integer in 1\.\.1024"):
                start([1], [2], split=split)
    with pytest.raises(KVRuntimeError, match="timeout must be a finite positive number"):
        peer.start_push([1], [2], timeout=float("inf"))
    assert peer.pull([1], [2], split=1024).nbytes and not server.stats.refused


def test_a_decode_that_leaves_takes_its_named_requests_with_it():
    layout = small()
    src, dst = KVCache.allocate_host(layout), KVCache.allocate_host(layout)
    src.fill_random(6)
    with PrefillServer(src) as server:
        with DecodeClient(dst, engine="nixl") as client:
            client.connect(*server.address).expect_push([1], request_id="gone", timeout=20)
            _wait_expected(server, "gone")
        until = time.monotonic() + 5
        while server.expects("gone") and time.monotonic() < until:
            time.sleep(0.01)
        assert not server.expects("gone")
    src.close(), dst.close()


def test_a_push_no_decode_named_is_released_when_the_server_closes():
    """start_push before any decode named the request (an offer), then the server closes: the
    push is released with agent "", as its deadline would have (start_push promises a
    release). (Before: the close stopped the progress loop that expires offers, and the
    release never came.)"""
    src = KVCache.allocate_host(small())
    server = PrefillServer(src)
    try:
        server.start_push("unnamed", [1, 2], timeout=600)
    finally:
        server.close()
    assert server.get_released() == [("", "unnamed")]
    src.close()


def test_a_host_staged_decode_is_told_to_pull():
    layout = small()
    src, dst = KVCache.allocate_host(layout), KVCache.allocate_host(layout)
    with PrefillServer(src, kv_buffer="host_staged", staging_blocks=16) as server, \
            DecodeClient(dst, kv_buffer="host_staged", staging_blocks=16) as client:
        peer = client.connect(*server.address)
        with pytest.raises(KVRuntimeError, match="pull instead"):
            peer.expect_push([1])
        with pytest.raises(KVRuntimeError, match="host-staged prefill pushes nothing"):
            server.start_push("r", [1])
    src.close(), dst.close()


def test_a_push_started_just_after_the_decodes_deadline_writes_nothing(either_pair,
                                                                       monkeypatch):
    """Between the decode's deadline and the sweep's grace, start_push finds the named blocks
    but not the time: the decode may have reused them. It writes nothing; the decode is told
    and the push waits for a decode that names the request again. The window is forced: the
    sweep's grace made a minute long, so a busy host's late wake-up cannot close it."""
    from kvruntime.prefill import pushes

    monkeypatch.setattr(pushes, "EXPECTED_GRACE", 60.0)
    server, client, peer, src, dst = either_pair
    before = dst.block_digest(7)
    handle = peer.expect_push([7], request_id="edge", timeout=0.3)
    _wait_expected(server, "edge")
    time.sleep(0.4)  # past its deadline; nobody polled the decode, so no cancel went out
    assert server.expects("edge")
    server.start_push("edge", [9], timeout=0.3)
    with pytest.raises((TransferError, TransferTimeout)):
        handle.wait(10)
    assert server.wait_released("edge", 5, peer="")
    assert dst.block_digest(7) == before


def test_a_prefill_process_pushes_into_a_decode_process(pushing_prefill):
    """The shape engines run: the prefill in its own process starts the push (after the
    decode named the blocks); timed from its start_push by the host's wall clock."""
    layout = small(PER_LAYER)
    with pushing_prefill([layout], seed=8) as (_proc, ports, push):
        cache = KVCache.allocate_host(layout)
        cache.fill_value(0)
        with DecodeClient(cache, engine="nixl") as client:
            peer = client.connect("127.0.0.1", ports[0])
            src, dst = [4, 5, 6, 30], [100, 101, 102, 0]
            handle = peer.expect_push(dst, request_id="x", timeout=30)
            assert push(0, "x", src, client.agent.name) is None
            result = handle.wait(30)
            assert 0 < result.seconds < 30
            assert cache.block_digests(dst) == peer.digests(src)
            # a push of ids the decode never named is the prefill's error, not a hang
            peer.expect_push([1], request_id="y", timeout=30)
            assert "source blocks" in push(0, "y", [1, 2], client.agent.name)
        cache.close()


def test_a_decode_names_no_more_blocks_than_its_cache_holds(either_pair):
    """What the prefill keeps for a decode's named requests is bounded by that decode's cache:
    each of its blocks named for one push at a time. Beyond it the request fails at once, and
    blocks become nameable again as pushes start."""
    server, client, peer, src, dst = either_pair
    first = peer.expect_push(list(range(100)), request_id="big", timeout=20)
    _wait_expected(server, "big")
    second = peer.expect_push(list(range(100, 128)) + list(range(50)), request_id="more",
                              timeout=20)
    with pytest.raises(TransferError, match="more than the decode's 128"):
        second.wait(10)
    # none of the prefill's blocks were involved
    assert "more" not in {r for _agent, r in server.get_released()}
    server.start_push("big", list(range(28, 128)))
    first.wait(10)
    third = peer.expect_push(list(range(100, 128)), request_id="more", timeout=20)
    _wait_expected(server, "more")
    server.start_push("more", list(range(28)))
    third.wait(10)
    moved = list(range(28, 128)) + list(range(28))
    assert dst.block_digests(range(128)) == src.block_digests(moved)


# -- a same-node decode copies the push itself (protocol 8) -----------------------------------
def test_a_ready_for_a_push_the_decode_gave_up_is_given_back(samenode_pair, caplog):
    """The prefill said "ready" just as the decode's deadline passed: the decode copies
    nothing into blocks it was told are free, releases the prefill's, and the answer to its
    cancel settles the handle."""
    server, client, peer, src, dst = samenode_pair
    before = dst.block_digest(20)
    handle = peer.expect_push([20], request_id="gone", timeout=20)
    _wait_expected(server, "gone")
    server.start_push("gone", [3])  # the ready frame is on its way
    handle.deadline = time.monotonic() - 1
    handle.advance()  # its deadline seen before the frame is read: failed, cancel sent
    with pytest.raises(TransferTimeout):
        handle.result()
    with caplog.at_level(logging.INFO, logger="kvruntime"):
        until = time.monotonic() + 5
        while not handle.settled and time.monotonic() < until:
            peer.pump()
            time.sleep(0.01)
    assert handle.settled and not peer.channel.pending
    assert "given back" in caplog.text
    assert server.wait_released("gone", 5, peer=client.agent.name)
    assert dst.block_digest(20) == before


def test_only_a_decode_that_opened_the_prefills_memory_may_copy_its_pushes(pair):
    """"copy" from a decode that never asked for the same-node offer is refused: the prefill
    would otherwise hand it ids it cannot read, and never see them released."""
    server, client, peer, src, dst = pair
    handle = peer.expect_push([30], request_id="sly", timeout=20)
    _wait_expected(server, "sly")
    server.start_push("sly", [4])
    handle.wait(10)  # a NIXL decode's push: a WRITE
    assert handle.result().engine == "nixl"
    peer.channel.pending["sly2"] = handle2 = peer.make_handle("push", "sly2", handle.plan, 20,
                                                   time.perf_counter())
    handle2.by_prefill = True
    client.track(handle2)
    peer.send({"type": "expect", "request": "sly2", "dst": frames.pack_ids([31]), "number": 99,
                "timeout": 20, "deadline": time.time() + 20, "copy": True})
    with pytest.raises(TransferError, match="has not opened this prefill's memory"):
        handle2.wait(10)
    assert not server.expects("sly2")


def test_a_ready_the_decode_cannot_copy_fails_its_request_alone(samenode_pair, caplog):
    """A ready frame is the prefill's word, checked as any: ids that do not pair with the
    named blocks fail that request (its blocks released, nothing copied), and a ready for a
    request nobody named is logged and ignored; other requests go on."""
    server, client, peer, src, dst = samenode_pair
    before = dst.block_digests([40, 41])
    bad = peer.expect_push([40, 41], request_id="bad", timeout=20)
    good = peer.expect_push([42], request_id="good", timeout=20)
    _wait_expected(server, "good")

    def ready(request, ids=None, spans=None):
        message = {"type": "ready", "request": request, "posted": time.time()}
        if spans is None:
            message["src"] = frames.pack_ids(ids)
        else:
            message["src_spans"] = frames.pack_spans(*spans)
        return frames.decode_frame(frames.encode_frame(message))

    # as spans: three blocks for two; and counts whose int64 sum wraps to two (refused
    # before any id is made of them)
    for name, spans in (("spans3", ([1], [3])),
                        ("wraps", ([0, 9, 20, 30], [2**62, 2**62, 2**62, 2**62 + 2]))):
        h = peer.expect_push([50, 51], request_id=name, timeout=20)
        peer.channel.dispatch(ready(name, spans=spans))
        with pytest.raises(TransferError, match="its spans name"):
            h.wait(5)
        assert server.wait_released(name, 5, peer=client.agent.name)
    peer.channel.dispatch(ready("bad", [1, 2, 3]))  # three ids for two blocks
    with caplog.at_level(logging.WARNING, logger="kvruntime"):
        peer.channel.dispatch(ready("nobody", [1]))
    assert "unexpected 'ready' frame" in caplog.text
    with pytest.raises(TransferError, match="could not be copied"):
        bad.wait(5)
    assert server.wait_released("bad", 5, peer=client.agent.name)
    assert dst.block_digests([40, 41]) == before
    server.start_push("good", [5])
    good.wait(10)
    assert dst.block_digest(42) == src.block_digest(5)


def test_a_same_node_decode_takes_readies_from_the_prefills_ring(samenode_pair, caplog):
    """A same-node decode reads the prefill's readies out of its memory (mailbox.py) and drops
    their frames, which follow; a ring it fell behind on is given up and the frames carry on.
    Here the ring is lapped on purpose: records for nobody written into it while the decode
    does not poll."""
    server, client, peer, src, dst = samenode_pair
    assert peer.channel.ring is not None
    with caplog.at_level(logging.WARNING, logger="kvruntime"):
        for i, (s, d) in enumerate([([1, 2, 3], [60, 61, 62]), ([9, 4], [63, 64])]):
            handle = peer.expect_push(d, request_id=f"ring{i}", timeout=20)
            _wait_expected(server, f"ring{i}")
            server.start_push(f"ring{i}", s)
            handle.wait(10)
            assert dst.block_digests(d) == src.block_digests(s)
        assert peer.channel.ring is not None and peer.channel.ring.tail > 0  # they came by the ring
        assert not peer.channel.from_ring  # and each frame after it was dropped, unseen
        assert not caplog.records  # nothing unexpected: no ready handled twice
        box = next(iter(server._peers.values())).mailbox
        junk = frames.encode_payload({"type": "ready", "request": "nobody", "posted": 0.0,
                                      "src": frames.pack_ids([0])})
        for _ in range(box.size // len(junk) + 2):
            box.post(junk)
        handle = peer.expect_push([70], request_id="after", timeout=20)
        _wait_expected(server, "after")
        server.start_push("after", [5])
        handle.wait(10)
    assert dst.block_digest(70) == src.block_digest(5)
    assert peer.channel.ring is None
    assert "its ring of readies is given up" in caplog.text


def test_a_ready_whose_frame_comes_before_the_ring_is_read_is_copied_once(samenode_pair, caplog):
    """The frame of a ready written to the ring can reach the decode before its poll reads the
    ring: the frame says so ("ring"), the decode reads the ring then and there, copies the
    request once, and the record's frame is not handled again. Written here as the prefill
    writes them (its real ring, then the frame's message)."""
    server, client, peer, src, dst = samenode_pair
    handle = peer.expect_push([80, 81], request_id="early", timeout=20)
    _wait_expected(server, "early")
    box = next(iter(server._peers.values())).mailbox
    message = {"type": "ready", "request": "early", "posted": time.time(),
               "src": frames.pack_ids([6, 7])}
    assert box.post(frames.encode_payload(message))
    with caplog.at_level(logging.WARNING, logger="kvruntime"):
        with peer.channel._recv_lock:  # as pump holds it
            peer.channel.dispatch(
                frames.decode_frame(frames.encode_frame({**message, "ring": True}))
            )
        handle.wait(10)
    assert dst.block_digests([80, 81]) == src.block_digests([6, 7])
    assert not peer.channel.from_ring and not caplog.records


def test_a_pooled_push_that_fails_gives_the_prefill_its_blocks_back(coalesced_pair):
    """Through the pools the decode has the push staged as a pull; when that fails (here: the
    prefill's pool held, so its stage waits in the prefill's queue past the deadline) the
    decode's "unstage" drops it from the queue and still releases the request: the prefill's
    engine gets its blocks back, nothing lands, and the next push goes through."""
    server, client, peer, src, dst = coalesced_pair
    held, until = None, time.monotonic() + 5
    while held is None and time.monotonic() < until:  # the fixture's pull unstaged by now
        held = server.pool.try_acquire(server.pool.units)
        time.sleep(0.001)
    assert held is not None
    try:
        before = dst.block_digests([20, 21, 22])
        handle = peer.expect_push([20, 21, 22], request_id="held", timeout=0.5)
        _wait_expected(server, "held")
        server.start_push("held", [1, 5, 9])
        # our deadline, or the prefill's queue refusing it at the same deadline: either wins
        with pytest.raises(TransferError, match="the prefill had not staged it|the prefill's "
                                                "staging pool is exhausted"):
            handle.wait(5)
        assert server.wait_released("held", 5, peer=client.agent.name)
        assert handle.settled and dst.block_digests([20, 21, 22]) == before
    finally:
        server.pool.release(held, server.pool.units)
    handle = peer.expect_push([20, 21, 22], request_id="again", timeout=10)
    _wait_expected(server, "again")
    server.start_push("again", [1, 5, 9])
    assert handle.wait(10).coalesced
    assert dst.block_digests([20, 21, 22]) == src.block_digests([1, 5, 9])


def _decode_that_names_then_sleeps(port: int, layout, request: str, engine: str, queue) -> None:
    """A decode process: names ``request``'s blocks (expect_push), says its agent's name on
    ``queue``, then sleeps without ever polling, until the test kills it (SIGKILL)."""
    cache = KVCache.allocate_host(layout)
    options = {"coalesce": "always"} if engine == "coalesced" else {}
    client = DecodeClient(cache, engine="nixl" if engine == "coalesced" else engine,
                          ucx_threads=0, **options)
    peer = client.connect("127.0.0.1", port)
    peer.expect_push([3, 4, 5], request_id=request, timeout=60)
    queue.put(client.agent.name)
    time.sleep(600)


@pytest.mark.parametrize("engine", ["samenode", "coalesced"])
def test_a_decode_killed_after_the_ready_still_has_the_push_released(engine):
    """The decode names a push it copies itself (same-node, or through the pools), the prefill
    starts it (its "ready" sent), and the decode is killed before it polls: no release or
    unstage will ever come from it, and its connection's end releases the request, as
    start_push promises. (Before: get_released never listed it.)"""
    import multiprocessing
    import os
    import signal

    layout = small()
    src = KVCache.allocate_host(layout)
    src.fill_random(8)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with PrefillServer(src) as server:
        child = ctx.Process(target=_decode_that_names_then_sleeps, daemon=True,
                            args=(server.address[1], layout, "orphan", engine, queue))
        child.start()
        try:
            agent = queue.get(timeout=60)
            _wait_expected(server, "orphan", agent, 30)
            server.start_push("orphan", [10, 11, 12], peer=agent, timeout=60)
            assert not server.expects("orphan")  # its ready has gone out
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.join(30)
        assert child.exitcode == -signal.SIGKILL
        assert server.wait_released("orphan", 10, peer=agent)
        assert not server.wait_released("orphan", 0.2)  # once
    queue.close()
    src.close()


def _decode_that_names_then_stops(port: int, layout, request: str, queue) -> None:
    """A decode process: names ``request``'s blocks (a WRITE's: NIXL, direct), says its
    agent's name on ``queue``, then stops itself (SIGSTOP) until the test kills it."""
    import os
    import signal

    cache = KVCache.allocate_host(layout)
    client = DecodeClient(cache, engine="nixl", coalesce="never", ucx_threads=0)
    peer = client.connect("127.0.0.1", port)
    peer.expect_push(list(range(64)), request_id=request, timeout=60)
    queue.put(client.agent.name)
    queue.close()
    queue.join_thread()  # the name is on its way before we stop (the queue's thread writes it)
    os.kill(os.getpid(), signal.SIGSTOP)


def test_a_decode_killed_under_a_write_still_has_the_push_released(monkeypatch, stall):
    """A push of ours WRITEs 32 MiB over tcp into a decode that is stopped (the WRITE cannot
    end: tcp needs the target's progress), then killed: its connection's end takes the WRITE
    (aborted, or polled until UCX ends it) and the request is released, as start_push
    promises. (Before: dropped with the connection, never released.)"""
    import multiprocessing
    import os
    import signal

    monkeypatch.setenv("UCX_TLS", "tcp")  # both processes: the decode is spawned with it
    layout = KVLayout(CROSS_LAYER, 2, 128, 64, 8, 128, "float16")  # 512 KiB blocks
    src = KVCache.allocate_host(layout)
    src.fill_random(9)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with PrefillServer(src, coalesce="never", ucx_threads=0) as server:
        child = ctx.Process(target=_decode_that_names_then_stops, daemon=True,
                            args=(server.address[1], layout, "under", queue))
        child.start()
        try:
            agent = queue.get(timeout=60)
            _wait_expected(server, "under", agent, 30)
            stall(child.pid)
            server.start_push("under", list(range(64, 128)), peer=agent, timeout=60)
            assert server.writes.in_flight == 1  # posted, and it cannot end while stopped
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.join(30)
        assert server.wait_released("under", 20, peer=agent)
        assert not server.wait_released("under", 0.2)  # once
    queue.close()
    src.close()
