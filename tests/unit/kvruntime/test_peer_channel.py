"""The decode's end of a side channel (wire/channel.py: PeerChannel) over a real socket pair,
the prefill's end a plain Channel of the same session."""

import itertools
import socket

from kvruntime.wire import channel as channel_mod
from kvruntime.wire import frames, messages
from kvruntime.wire.channel import Channel, PeerChannel


def _pair():
    a, b = socket.socketpair()
    k1, k2 = b"k" * 32, b"m" * 32
    decode = PeerChannel(a, frames.Session(k1, k2), "prefill", timeout=5.0,
                         progress=lambda: None, on_ready=lambda *_: None, on_lost=lambda: None)
    return decode, Channel(b, frames.Session(k2, k1)), (a, b)


def test_a_call_whose_answer_is_read_by_its_first_pump_returns_without_a_nap(monkeypatch):
    """A call looks for its answer right after each pump, before napping: the answer is made
    readable before the call starts (its id known in advance), so the first pump reads it, and
    no nap may follow (each cost a connect's "pool" exchange 0.2-0.4 ms). Before, the loop
    napped once after the pump that read the answer."""
    monkeypatch.setattr(channel_mod, "_call_ids", itertools.count(7))
    decode, prefill, socks = _pair()
    naps = []
    monkeypatch.setattr(decode, "await_frame", lambda seconds: naps.append(seconds))
    try:
        prefill.send(messages.POOL.build(request="c7", unavailable="none here"), 5.0)
        reply = decode.call(messages.POOL, 5.0)
        assert reply["unavailable"] == "none here" and naps == []
        asked = frames.read_frame(socks[1], 5.0, session=prefill.session)
        assert (asked["type"], asked["request"]) == (messages.POOL.type, "c7")
    finally:
        for s in socks:
            s.close()


def test_a_call_naps_until_its_answer_comes():
    """The other way round: no answer yet, the call naps on the socket (woken by the frame)
    until the prefill's end, a thread here, answers what it read."""
    import threading

    decode, prefill, socks = _pair()

    def answer():
        asked = frames.read_frame(socks[1], 5.0, session=prefill.session)
        prefill.send(messages.POOL.build(request=asked["request"], unavailable="later"), 5.0)

    t = threading.Thread(target=answer)
    t.start()
    try:
        assert decode.call(messages.POOL, 5.0)["unavailable"] == "later"
    finally:
        t.join(5)
        for s in socks:
            s.close()
