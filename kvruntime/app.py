"""An application's descriptor: what both sides must agree on beyond the KV layout.

Pure (no NIXL, no torch). The layout says how KV bytes are laid out; it cannot say whose KV they
are. Two caches of one layout filled by different models (another config, other weights) pair
byte for byte and decode garbage. An application names what it needs alike in ``Options.app``:
a flat JSON object of short keys and scalar values (a model's config, a digest of its weights).
Both sides send it in the handshake (the hello and the peer info, under the transcript's MAC),
and a connection whose descriptors differ is refused with every differing key and both values,
before any metadata goes out. Bounded: at most ``MAX_KEYS`` keys of at most ``MAX_KEY`` characters,
strings of at most ``MAX_TEXT``; never anything but JSON scalars.
"""

from __future__ import annotations

import math
import re

from .errors import IncompatiblePeerError, LayoutError

MAX_KEYS = 32
MAX_KEY = 64
MAX_TEXT = 256
_KEY = re.compile(r"[A-Za-z0-9_.-]+")


def check_app(data: object, who: str = "app") -> dict | None:
    """``data`` as a descriptor (a new dict), or None; ``LayoutError`` says what is wrong."""
    if data is None:
        return None
    if not isinstance(data, dict):
        raise LayoutError(f"{who} must be a JSON object, got {type(data).__name__}")
    if len(data) > MAX_KEYS:
        raise LayoutError(f"{who} has {len(data)} keys; at most {MAX_KEYS}")
    out = {}
    for key, value in data.items():
        if not isinstance(key, str) or len(key) > MAX_KEY or not _KEY.fullmatch(key):
            raise LayoutError(f"{who} key {str(key)[:MAX_KEY]!r} is not 1-{MAX_KEY} of "
                              f"A-Z a-z 0-9 _ . -")
        if isinstance(value, str):
            ok = len(value) <= MAX_TEXT
        elif isinstance(value, float):
            ok = math.isfinite(value)
        else:
            ok = value is None or isinstance(value, (bool, int)) and abs(value) < 2**63
        if not ok:
            raise LayoutError(f"{who}[{key!r}] must be a string of at most {MAX_TEXT} "
                              f"characters, a finite number, a bool or null")
        out[key] = value
    return out


def app_differences(prefill: dict | None, decode: dict | None) -> list[str]:
    """Every key whose value differs (a missing key is ``<none>``), as 'app.key: prefill=X
    decode=Y' (both sides name them alike); a side without a descriptor differs from one with."""
    if prefill is None or decode is None:
        return [] if prefill is decode else [
            f"app: prefill={'<none>' if prefill is None else prefill} "
            f"decode={'<none>' if decode is None else decode}"]
    none = "<none>"
    return [f"app.{k}: prefill={prefill.get(k, none)!r} decode={decode.get(k, none)!r}"
            for k in sorted(set(prefill) | set(decode))
            if repr(prefill.get(k, none)) != repr(decode.get(k, none))]


def check_same_app(prefill: dict | None, decode: dict | None) -> None:
    diffs = app_differences(prefill, decode)
    if diffs:
        raise IncompatiblePeerError("the application descriptors differ (another model or "
                                    "another config: its KV would decode garbage): "
                                    + "; ".join(diffs), [d.split(":", 1)[0] for d in diffs])
