"""Numbers from outside, as kvruntime takes them: a caller's argument or a peer's field is a
finite number (an integer past a float's range, NaN, infinity or a bool is none), and a
duration is above 0 too. ``wire.frames`` reads a frame's fields through ``finite``; the
constructors and request calls check their durations with ``check_seconds``."""

from __future__ import annotations

import math

from .errors import KVRuntimeError


def finite(value) -> float | None:
    """``value`` as a finite float; None for anything else (a bool, text, NaN, infinity, an
    integer past a float's range). Where a peer's field only informs (a push's start, its
    descriptors) it is read so, and a bad one is as good as absent."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        out = float(value)
    except OverflowError:
        return None
    return out if math.isfinite(out) else None


def check_seconds(name: str, value):
    """A caller's duration ``name``: a finite number of seconds above 0 (returned as given),
    or KVRuntimeError saying what came. One past a float's range is none either: a deadline
    adds it to the clock."""
    out = finite(value)
    if out is None or not out > 0:
        raise KVRuntimeError(f"{name} must be a finite positive number of seconds, got "
                             f"{value!r}")
    return value
