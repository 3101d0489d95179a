"""Every message kvruntime's two sides exchange: its type, who sends it, and its fields.

The side channel carries JSON objects in MAC'd frames (frames.py, which also holds the protocol
version); a push the prefill starts is answered by a NIXL notification in the same encoding.
Each message is one ``Message`` below: ``build`` makes it (refusing a field it does not have, or
a missing one: a sender's bug, caught where it is made), ``is_`` tells a received one, and a
receiver still reads each field through ``frames.field``/``ids_field``... which check its kind.
Nothing here changes the wire: a message is the same dict it always was.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import KVRuntimeError

# Who sends it.
DECODE = "decode -> prefill"
PREFILL = "prefill -> decode"
EITHER = "either side"


@dataclass(frozen=True)
class Message:
    type: str
    direction: str
    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    doc: str = ""
    open: bool = False  # it may carry more fields than these (the same-node offer's)

    def build(self, **fields) -> dict:
        """The message with ``fields``, checked against the catalog."""
        names = fields.keys()
        if not names >= set(self.required) or not (
                self.open or names <= {*self.required, *self.optional}):
            raise KVRuntimeError(f"a {self.type!r} message has fields {sorted(self.required)} "
                                 f"(and optionally {sorted(self.optional)}), not {sorted(names)}")
        return {"type": self.type, **fields}

    def is_(self, message: dict) -> bool:
        return message.get("type") == self.type


# -- the handshake (handshake.py) -------------------------------------------------------------
HELLO = Message("hello", DECODE, ("layout", "nonce", "kv_buffer", "app"), (),
                "opens a connection (app: the application's descriptor, or null)")
CHALLENGE = Message("challenge", PREFILL, ("nonce", "auth"), (),
                    "the prefill's nonce, and whether it asks for proof of the secret")
AUTH = Message("auth", DECODE, ("proof",), (), "the decode's proof (empty: no secret)")
WELCOME = Message("welcome", PREFILL, ("info",), ("proof",),
                  "the prefill's agent, regions, layout; its proof, added once the transcript "
                  "holds the rest")
INFO = Message("info", DECODE, ("info",), ("proof",), "the decode's agent, regions, layout")
READY = Message("ready", PREFILL, (), (), "the prefill has admitted the decode (the first "
                "MAC'd frame)")
ERROR = Message("error", EITHER, ("code", "message", "fields"), (),
                "refused: what, why, which layout fields differ")

# -- requests a decode sends once connected ---------------------------------------------------
PUSH = Message("push", DECODE, ("request", "number", "timeout", "deadline"),
               ("src", "dst", "runs", "split"),
               "write these blocks of yours into mine (ids, or runs); number: this push's, "
               "unique in the connection, for its notification to name")
EXPECT = Message("expect", DECODE, ("request", "number", "dst", "timeout", "deadline"),
                 ("copy", "stage"),
                 "my blocks for a push you will start (copy: send ids, I copy; stage: send "
                 "ids, I ask you to stage them and READ them through the pools); number: as "
                 "a push's")
CANCEL = Message("cancel", DECODE, ("request",), (), "drop a push past its deadline")
SAMENODE = Message("samenode", EITHER, ("request",), (), "asks for the same-node offer; the "
                   "reply carries the offer's fields too", open=True)
STAGE = Message("stage", DECODE, ("request", "src", "deadline"), ("heads", "piece"),
                "gather these blocks into your staging pool (piece: which piece of a request "
                "larger than the pools)")
UNSTAGE = Message("unstage", DECODE, ("request",), ("piece", "more"),
                  "free a staged run; the request is done (more: other pieces of it come)")
POOL = Message("pool", EITHER, (), ("request", "region", "mem_type", "units", "unit_bytes",
                                    "unavailable"),
               "where is your staging pool (coalesce.py); answered with its region and units, "
               "or why there is none")
RELEASE = Message("release", DECODE, ("requests",), (), "these requests' blocks may be freed")
DIGESTS = Message("digests", EITHER, ("request",), ("blocks", "digests"),
                  "block digests: asked for (blocks), answered (digests)")
BYE = Message("bye", DECODE, (), (), "the decode closes")

# -- answers a prefill sends ------------------------------------------------------------------
PUSHED = Message("pushed", PREFILL, ("request", "number"), ("descriptors", "posted"),
                 "a push's WRITE landed (its NIXL notification, never a frame); number: its "
                 "push or expect frame's")
WARM = Message("warm", PREFILL, (), (),
               "sent once at a direct decode's connect, beside the WRITE into its scratch "
               "(prefill/warm.py), so that UCX's first active message to it is not a push's "
               "answer; a NIXL notification, dropped on arrival")
PUSH_FAILED = Message("push_failed", PREFILL, ("request", "error"), (), "a push was not written")
CANCELLED = Message("cancelled", PREFILL, ("request", "state"), (), "a cancel's answer")
READY_IDS = Message("ready", PREFILL, ("request", "posted"), ("src", "src_spans", "ring"),
                    "a push we start, to a same-node decode: the ids for it to copy")
STAGED = Message("staged", PREFILL, ("request", "start", "count"), ("rows", "last"),
                "a chunk of a staged run is in the pool (rows; last: no more come)")
STAGE_FAILED = Message("stage_failed", PREFILL, ("request", "error"), (), "a stage refused")
STAGE_QUEUED = Message("stage_queued", PREFILL, ("request", "pool"), ("piece",),
                       "a stage waits for pool blocks: the pool's numbers as it queued, so a "
                       "decode whose deadline comes first can say which pool was full")

CATALOG = (HELLO, CHALLENGE, AUTH, WELCOME, INFO, READY, ERROR, PUSH, EXPECT, CANCEL, SAMENODE,
           STAGE, UNSTAGE, POOL, RELEASE, DIGESTS, BYE, PUSHED, WARM, PUSH_FAILED, CANCELLED,
           READY_IDS, STAGED, STAGE_FAILED, STAGE_QUEUED)
# What a connected decode may ask (the prefill refuses any other type).
REQUESTS = {m.type: m for m in (PUSH, EXPECT, CANCEL, SAMENODE, STAGE, UNSTAGE, POOL,
                                RELEASE, DIGESTS, BYE)}
# Answers that go to the handle of their request (the decode's channel.py).
HANDLE_REPLIES = frozenset(m.type for m in (PUSH_FAILED, CANCELLED, STAGED,
                                            STAGE_FAILED, STAGE_QUEUED, READY_IDS))
