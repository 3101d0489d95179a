"""The same-node ring of readies (mailbox.py): written by a Mailbox, read back by a
MailboxReader through process_vm_readv, here from this very process (the kernel serves a
process reading itself as it serves a same-user peer)."""

import ctypes
import os

import pytest

from kvruntime.errors import FrameError
from kvruntime.wire import frames
from kvruntime.wire.mailbox import Mailbox, MailboxReader


def ready(request, n=0):
    return frames.encode_payload({"type": "ready", "request": request, "posted": 1.0,
                                  "src": frames.pack_ids(list(range(n)))})


def reader_of(box):
    return MailboxReader.from_offer(os.getpid(), box.offer())


def test_records_come_back_in_order_across_the_ring_end():
    box = Mailbox(1024)
    reader = reader_of(box)
    assert reader.read() == []
    names = []
    for i in range(40):  # ~100-byte records: the ring wraps several times
        names.append(f"r{i}")
        assert box.post(ready(f"r{i}", i % 5))
        if i % 3 == 2:
            got = reader.read()
            assert [m["request"] for m in got] == names
            assert all(frames.ids_field(m, "src").tolist() == list(range(int(m["request"][1:]) % 5))
                       for m in got)
            names = []
    assert [m["request"] for m in reader.read()] == names


def test_a_record_over_half_the_ring_is_left_to_its_frame():
    box = Mailbox(1024)
    reader = reader_of(box)
    assert not box.post(ready("big", 80))  # 640 bytes of ids and more
    assert box.post(ready("small"))
    assert [m["request"] for m in reader.read()] == ["small"]


def test_a_reader_lapped_by_the_writer_gives_the_ring_up():
    box = Mailbox(1024)
    reader = reader_of(box)
    for i in range(30):
        box.post(ready(f"r{i}"))
    with pytest.raises(FrameError, match="overwritten before it was read"):
        reader.read()


def test_anything_but_whole_records_is_refused():
    box = Mailbox(1024)
    reader = reader_of(box)
    box.post(ready("a"))
    # a record whose length runs past what was written (a hostile or broken writer)
    ctypes.memmove(box._base + 8, (200).to_bytes(4, "little"), 4)
    with pytest.raises(FrameError, match="runs past what was written"):
        reader.read()
    box2 = Mailbox(1024)
    reader2 = reader_of(box2)
    box2.post(b"not json at all")
    with pytest.raises(FrameError, match="not valid UTF-8 JSON"):
        reader2.read()


@pytest.mark.parametrize("ref", [None, [1], [0, 64], [4096, 0], [4096, 12], [4096, 32 << 20],
                                 ["4096", 64], [True, 64]])
def test_an_offer_naming_no_good_ring_gives_no_reader(ref):
    offer = {} if ref is None else {"mailbox": ref}
    assert MailboxReader.from_offer(os.getpid(), offer) is None
