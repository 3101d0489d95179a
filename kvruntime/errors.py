"""The one exception tree of kvruntime.

Every error says what failed and, where there is one, what to do next. Callers catch
``KVRuntimeError`` for everything; the subclasses exist so that the CLI and callers can tell
a bad peer from a bad argument from a missing NIXL.
"""

from __future__ import annotations


class KVRuntimeError(Exception):
    """Base class of every error kvruntime raises on purpose."""


class LayoutError(KVRuntimeError, ValueError):
    """A layout was described with impossible values."""


class PlanError(KVRuntimeError, ValueError):
    """A block list cannot be planned (out of range, duplicate, mismatched lengths)."""


class NixlNotFoundError(KVRuntimeError, ImportError):
    """No NIXL Python module could be imported."""


class NixlError(KVRuntimeError):
    """NIXL refused an operation (registration, metadata, preparation)."""


class TransportError(KVRuntimeError):
    """The UCX settings cannot work for the requested memory kinds."""


class FrameError(KVRuntimeError):
    """A side-channel frame was malformed, oversize, truncated or of another version."""


class ProtocolVersionError(FrameError):
    """The peer speaks another side-channel protocol version."""


class AuthError(KVRuntimeError):
    """The shared-secret challenge failed (wrong or missing secret)."""


class IncompatiblePeerError(KVRuntimeError):
    """The peer's KV layout differs; ``fields`` lists every field that differs."""

    def __init__(self, message: str, fields: list[str] | None = None):
        super().__init__(message)
        self.fields = list(fields or [])


class PeerError(KVRuntimeError):
    """The peer is unreachable, closed the connection, died, or answered with an error."""


class HandshakeTimeout(PeerError, TimeoutError):
    """The peer did not answer the handshake in time."""


class TransferError(KVRuntimeError):
    """A block transfer failed (the peer died or NIXL reported an error)."""


class StagingExhausted(TransferError):
    """No run of free staging blocks large enough came free before the deadline."""


class TransferTimeout(TransferError, TimeoutError):
    """A block transfer missed its deadline; it was aborted."""


class WaitTimeout(KVRuntimeError, TimeoutError):
    """A wait on a request ended before the request did; the request is still in flight."""
