"""A request's state machine (kvruntime/decode/states.py): the table's moves, and an illegal
one raising and leaving the state as it was, on the table and on a real ``TransferHandle``
(made without a peer: failing a handle touches none)."""

import pytest

from kvruntime.decode import states
from kvruntime.decode.inflight import TransferHandle
from kvruntime.decode.states import IllegalTransition, RequestState
from kvruntime.errors import TransferError
from kvruntime.layout import CROSS_LAYER, KVLayout
from kvruntime.plan import make_plan

EVENTS = (states.FINISH, states.FAIL, states.FAIL_UNSETTLED, states.SETTLE)


def _in(state: str) -> RequestState:
    s = RequestState()
    s.current = state
    return s


@pytest.mark.parametrize("state", (states.PENDING, states.DONE, states.FAILED, states.UNSETTLED))
@pytest.mark.parametrize("event", EVENTS)
def test_each_pair_moves_as_the_table_says_or_raises(state, event):
    s = _in(state)
    nxt = states.TRANSITIONS.get((state, event))
    if nxt is None:
        with pytest.raises(IllegalTransition, match=f"in state '{state}' cannot {event}"):
            s.to(event)
        assert s.current == state  # unchanged
    else:
        assert s.to(event) == nxt == s.current


def test_a_request_ends_once_and_settles_after():
    s = RequestState()
    assert (s.outcome, s.settled) == (states.PENDING, True)
    s.to(states.FAIL_UNSETTLED)
    assert (s.outcome, s.settled) == (states.FAILED, False)
    s.to(states.SETTLE)
    assert (s.outcome, s.settled) == (states.FAILED, True)
    with pytest.raises(IllegalTransition):
        s.to(states.FINISH)  # a failed request never finishes after all


def test_an_illegal_transition_of_a_handle_raises():
    layout = KVLayout(CROSS_LAYER, 2, 8, 4, 2, 16, "float16")
    handle = TransferHandle(None, "pull", "r1", plan=make_plan(layout, [1, 2]), timeout=1.0)
    handle.fail(TransferError("first"), settled=False)
    assert (handle.state, handle.settled) == (states.FAILED, False)
    with pytest.raises(IllegalTransition):
        handle.fail(TransferError("second"))
    assert str(handle.error) == "first" and not handle.settled  # the first failure stands
