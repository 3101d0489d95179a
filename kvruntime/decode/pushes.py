"""Pushes into this decode that the prefill starts: the decode names the blocks ahead of time
(``PrefillPeer.expect_push``: an "expect" frame), the prefill pushes once it has them
(``PrefillServer.start_push``).

Over NIXL the prefill WRITEs them with a notification, which finishes the handle here
(``on_notif``, its MAC checked, and the push's number: each "expect" or "push" frame numbers its
push, and the notification must name it, so that one replayed from an earlier push of the same
request id finishes nothing), as it finishes a push we ask for (``ask``). To a same-node
decode it sends their ids instead (a "ready" frame, or a record in its ring read first) and the
decode copies them out of its memory itself, as a pull (``copy_ready``); so does a coalesced
NIXL decode (coalesce.py chose the pools at ``expect``), which has them staged and READs them
through both pools as a pull (staged.py): all the pools' rules (deadlines, units given back,
no scatter after a failure) are a pull's.
"""

from __future__ import annotations

import logging
import time

from ..errors import KVRuntimeError, TransferError
from ..numbers import finite
from ..plan import Planner, TransferPlan, make_plan, spans_ids
from ..wire import frames, messages
from .inflight import PENDING, TransferHandle

log = logging.getLogger(__name__)


def expect(peer, dst_blocks, request_id: str | None, timeout: float,
           t0: float) -> TransferHandle:
    """``PrefillPeer.expect_push``: name our blocks for ``request_id`` (an "expect" frame);
    the handle waits for the prefill's push. ``t0``: when the caller called."""
    peer.check_request(timeout)
    refused = peer.mover.pushes_refused(peer)
    if refused is not None:
        raise KVRuntimeError(refused)
    if peer.info.kv_buffer == "host_staged":
        raise KVRuntimeError(f"{peer.name} is host-staged: it pushes nothing directly; pull "
                             f"instead")
    # our ids, checked here (range, duplicates): the prefill pairs them with its own
    plan = make_plan(peer.client.cache.layout, dst_blocks)
    request_id = peer.name_request(request_id)
    peer.channel.check_new(request_id)
    handle = peer.make_handle("push", request_id, plan, timeout, t0, by_prefill=True)
    copy = peer.mover.expect(peer, handle)  # how the prefill is to deliver (engines/engine.py)
    peer.channel.expect(handle)
    peer.port.track(handle)
    handle.number = next(peer.push_numbers)
    peer.send(messages.EXPECT.build(request=request_id, dst=frames.pack_ids(plan.block_ids()[0]),
                                    number=handle.number, timeout=timeout,
                                    deadline=time.time() + timeout, **copy))
    return handle


def ask(peer, handle: TransferHandle, split: int) -> TransferHandle:
    """``start_push`` over NIXL, not coalesced: a "push" frame asks the prefill to WRITE the
    blocks; the handle waits for the WRITE's notification (a "push_failed" frame if it
    fails)."""
    plan, request_id, timeout = handle.plan, handle.request_id, handle.timeout
    src, dst = plan.block_ids()
    peer.channel.expect(handle)
    peer.port.track(handle)
    # The deadline travels as wall-clock time: the prefill refuses a push it reads after
    # it (a stalled prefill must not write into blocks the caller was told are free).
    if 3 * plan.num_runs < 2 * len(src):  # its runs are shorter than its ids: they go
        blocks = {"runs": frames.pack_runs(plan.run_src, plan.run_dst, plan.run_count)}
    else:
        blocks = {"src": frames.pack_ids(src), "dst": frames.pack_ids(dst)}
    handle.number = next(peer.push_numbers)
    peer.send(messages.PUSH.build(request=request_id, **blocks, number=handle.number,
                                  timeout=timeout, deadline=time.time() + timeout, split=split))
    return handle


def copy_ready(peer, handle: TransferHandle, message: dict) -> None:
    """The prefill has the blocks of a request we named with "copy" (a "ready" frame):
    copy them out of its memory into the named ones, as a pull would, and release them
    when done. A ready for a request that already failed (its deadline, its cancel) or
    that cannot be planned gives the blocks straight back (a release): nothing reads
    them."""
    request = handle.request_id
    copied = gave_up = staged = False
    with handle.lock:
        try:
            if handle.state != PENDING:
                gave_up = True  # failed here first: the answer to its cancel settles it
                raise KVRuntimeError("it had already failed here")
            staged = handle.coalesced
            if not peer.mover.copies_ready(handle):
                raise KVRuntimeError("no same-node engine serves this peer here, and it was "
                                     "not asked for through the pools")
            plan = ready_plan(peer.planner(), handle.plan, message)
            posted = finite(message.get("posted"))  # informs: a bad one is none
            started = None
            if posted is not None:
                # its start on our clock: one host's wall clock, read on both sides
                started = time.perf_counter() - max(0.0, time.time() - posted)
            handle.replan(plan, started)  # from here it is our copy's, as a pull's
            # our copy, or (through the pools) a staged READ whose "staged" answers come to
            # this handle: not settled yet (engines/engine.py)
            peer.mover.ready(peer, handle)
            copied = True
        except Exception as exc:  # bad ids, or a launch that failed: this request fails,
            # whoever polled (an engine's get_finished) goes on with the others
            peer.release_later([request])
            if gave_up:
                log.info("%s: ready for request %s given back: %s", peer.name, request, exc)
            else:
                handle.fail(TransferError(f"push of request {request}: the prefill's "
                                          f"ready could not be copied: {exc}"))
    if not copied:  # its blocks go back now (no poll of it may come again), outside its
        peer.releases.flush()  # lock: a send that fails fails the peer's handles
    if not gave_up and not (copied and staged):
        peer.channel.settled(handle)  # the prefill has nothing more to say of it


def ready_plan(planner: Planner, named: TransferPlan, message: dict) -> TransferPlan:
    """The plan of a ready's source blocks (its ``src`` ids, or ``src_spans``) into the
    ones we ``named``, checked against both caches as a pull's. Spans are bounded before
    any id is made from them: as many blocks as we named, each span at least one. One
    span into one run of ours is planned from the three numbers alone."""
    if "src" in message:
        return planner.plan(frames.ids_field(message, "src"), named.block_ids()[0])
    starts, counts = frames.spans_field(message, "src_spans")
    n = named.num_blocks
    if len(counts) == 1 and counts[0] == n:  # one span, bounded by this one comparison
        if named.num_runs == 1:
            return planner.plan_runs(starts, named.run_dst, counts)
    elif not len(counts) or counts.min() < 1 or counts.max() > n or counts.sum() != n:
        raise KVRuntimeError(f"its spans name {int(counts.sum()) if len(counts) else 0} "
                             f"blocks (each at least one), we named {n}")
    return planner.plan(spans_ids(starts, counts), named.block_ids()[0])


def on_notif(peer, raw) -> str | None:
    """A NIXL notification from this peer's agent: a push's WRITE that has landed, one we
    asked for or one it started. Returns why it was ignored, if it was."""
    try:
        message = frames.parse_notif(raw, peer.channel.session)
    except KVRuntimeError as exc:
        return str(exc)
    if messages.WARM.is_(message):  # the prefill's first active message to us (warm.py)
        peer.warm_notes += 1
        return None
    request = message.get("request")
    handle = peer.channel.pending.get(request) if isinstance(request, str) else None
    if not messages.PUSHED.is_(message) or handle is None or handle.op != "push":
        return (f"an unexpected {str(message.get('type'))[:40]!r} notification (request "
                f"{str(request)[:80]!r})")
    if message.get("number") != handle.number:  # sealed by the prefill, but not for this push
        return (f"a notification of an earlier push of request {request[:80]!r} (number "
                f"{str(message.get('number'))[:24]}, this one's is {handle.number}): replayed")
    handle.on_reply(message)
    return None


def of_an_earlier_connection(retired, agent: str, raw) -> bool:
    """Whether a notification from ``agent`` that our peer of it now (or none) does not take
    is sealed with the session of an earlier connection to that agent: one it sent before we
    connected again (a "warm" the prefill posts at each connect lands after a quick reconnect:
    ten handshakes in a row on 2 x H200 left three). ``retired`` holds the (agent, session)
    pairs of the last peers forgotten. Such a one is late, not forged."""
    for name, session in retired:
        if name == agent:
            try:
                frames.parse_notif(raw, session)
            except KVRuntimeError:
                continue
            return True
    return False


def settle_on_close(peer) -> None:
    """``PrefillPeer.close``, before it hangs up: pushes the prefill WRITEs fail and are
    cancelled, and the prefill's answers, read for at most the client's timeout, settle them
    (it answers a cancel once the WRITE has ended). After the hang-up nothing reads its
    answers: they stayed unsettled for good although the prefill lived. One it does not
    answer in time stays unsettled, its error says so. Only a close with such pushes waits."""
    why = "the decode closed its connection to the prefill before the push ended"
    asked = [(h, h.close_push(why)) for h in list(peer.channel.pending.values())]
    waiting = [h for h, what in asked if what is not None]
    for handle, what in asked:
        if what == "cancel":
            peer.channel.cancel(handle.request_id)
    start = time.monotonic()
    until = start + peer.port.timeout
    while (any(not h.settled for h in waiting) and not peer.channel.losing
           and time.monotonic() < until):
        peer.pump()  # the answers, and our worker's progress (a WRITE over tcp needs it)
        if any(not h.settled for h in waiting):
            peer.await_frame(min(0.005, max(0.0, until - time.monotonic())))
    for handle, what in asked:  # one failed by its deadline keeps that error
        if what == "cancel":
            handle.closed_unanswered(why, time.monotonic() - start)
