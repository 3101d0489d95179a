"""The catalog of messages (messages.py): a message is built only with the fields its entry
names, every entry's type is known to the framing, and what a connected decode may ask is
exactly what the prefill serves."""

import ast
from pathlib import Path

import pytest

from kvruntime.errors import KVRuntimeError
from kvruntime.wire import frames, messages

ROOT = Path(__file__).resolve().parents[3]


def test_a_message_is_built_with_its_fields_only():
    assert messages.CANCEL.build(request="r1") == {"type": "cancel", "request": "r1"}
    with pytest.raises(KVRuntimeError, match="'cancel' message has fields"):
        messages.CANCEL.build(request="r1", colour="blue")
    with pytest.raises(KVRuntimeError, match="'push' message has fields"):
        messages.PUSH.build(request="r1")  # no timeout, no deadline
    # an open entry (the same-node offer) carries whatever the offer holds
    assert messages.SAMENODE.build(request="c1", pid=7)["pid"] == 7


def test_every_entry_frames_and_parses_back():
    for entry in messages.CATALOG:
        message = entry.build(**{name: 1 for name in entry.required})
        back = frames.decode_frame(frames.encode_frame(message))
        assert back.pop("v") == frames.PROTOCOL_VERSION and back == message  # the framing's "v"
        assert entry.is_(message) and entry.direction in (messages.DECODE, messages.PREFILL,
                                                          messages.EITHER)


def test_types_are_unique_but_for_the_two_readies():
    types = [m.type for m in messages.CATALOG]
    assert {t for t in types if types.count(t) > 1} == {"ready"}  # handshake's, a push's ids


def test_the_prefill_serves_exactly_the_requests_of_the_catalog():
    """Read from PrefillServer._handle: each branch compares the type with a catalog entry."""
    tree = ast.parse((ROOT / "kvruntime" / "prefill/server.py").read_text())
    handle = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
                  and n.name == "_handle")
    served = {node.value.attr for node in ast.walk(handle)
              if isinstance(node, ast.Attribute) and node.attr == "type"
              and isinstance(node.value, ast.Attribute)}
    served = {getattr(messages, name).type for name in served}
    assert served | {"bye"} == set(messages.REQUESTS)  # "bye" ends the connection loop
