"""A request's states and the moves between them: everything that affects a ``TransferHandle``'s
state lives here, its transitions as a table (as h11 keeps its state machine).

A handle starts ``PENDING`` and ends once, ``DONE`` or failed. A failed one is *unsettled* while
its copy (our READ, or the prefill's WRITE) may still write into its blocks, and *settled* once
nothing can (inflight.py says when). Events:

- ``FINISH``: its copy landed (a poll saw it, a batch's gather, the prefill's "pushed");
- ``FAIL``: it failed and nothing more lands (refused, an ended copy, the prefill's refusal);
- ``FAIL_UNSETTLED``: it failed while its copy or the prefill's WRITE may still run (its
  deadline, a lost peer, a close);
- ``SETTLE``: nothing more lands (the copy ended, the prefill answered): a failed handle becomes
  settled; the prefill's late word on one already settled, or done, changes nothing.

Anything else (finishing a failed request, failing a done one, settling a pending one) is a bug
of ours, never the peer's: ``IllegalTransition`` is raised, and the state stays as it was.
"""

from __future__ import annotations

# what ``TransferHandle.state`` says: one of three
PENDING, DONE, FAILED = "pending", "done", "failed"
# a failed request whose blocks may still be written (``TransferHandle.settled`` is False)
UNSETTLED = "failed, unsettled"

FINISH, FAIL, FAIL_UNSETTLED, SETTLE = "finish", "fail", "fail unsettled", "settle"

# (state, event) -> the next state; a pair not listed is an illegal transition
TRANSITIONS = {
    (PENDING, FINISH): DONE,
    (PENDING, FAIL): FAILED,
    (PENDING, FAIL_UNSETTLED): UNSETTLED,
    (UNSETTLED, SETTLE): FAILED,
    (FAILED, SETTLE): FAILED,  # a second word that nothing lands (the prefill's late answer)
    (DONE, SETTLE): DONE,  # a cancel's answer for a push that landed first
}


class IllegalTransition(RuntimeError):
    """A transition the table does not allow: a bug in kvruntime (not a peer's fault)."""


class RequestState:
    """One request's state, moved only through ``TRANSITIONS`` (callers hold the handle's lock
    where threads meet)."""

    __slots__ = ("current",)

    def __init__(self) -> None:
        self.current = PENDING

    def to(self, event: str) -> str:
        """Apply ``event``; returns the new state, or raises ``IllegalTransition``."""
        nxt = TRANSITIONS.get((self.current, event))
        if nxt is None:
            raise IllegalTransition(f"a request in state {self.current!r} cannot {event}")
        self.current = nxt
        return nxt

    @property
    def outcome(self) -> str:
        """``PENDING``, ``DONE`` or ``FAILED`` (settled or not)."""
        return FAILED if self.current == UNSETTLED else self.current

    @property
    def settled(self) -> bool:
        """Nothing more can write into the request's blocks (a pending one: nothing has yet
        been reported, so nothing is to be waited for)."""
        return self.current != UNSETTLED
