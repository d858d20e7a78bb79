"""The error tree every layer raises from; each carries the data a caller needs to act on it.

::

    GradientmailError                  the root: catch it to catch everything of ours
    ├── ProtocolError                  the run or a peer broke the protocol, or a request cannot
    │   └── ConfigMismatch             be honoured; this node's algorithm differs from the run's
    ├── SchemaMismatch                 tensors (a model, a payload) do not match the schema
    ├── NonFinite                      a delta holds NaN or Inf
    ├── RejectedObject                 bytes from the mailbox that a node does not use
    │   └── FormatError                not a valid object of ours: corrupt, forged, foreign
    └── MailboxError                   (gradientmail.mailboxes) a request to the store failed
        ├── TransientMailboxError      it may pass: retried
        └── BadKey                     a key outside the documented layout; nothing was sent

Untrusted bytes are rejected only through ``RejectedObject``: no layer catches a bare
``ValueError`` to mean "this object is garbage", so a bug in our own decoding never looks like
an attacker's object. ``SchemaMismatch`` and ``NonFinite`` are also ``ValueError``s, as is
``FormatError``, for callers that predate the tree.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "ConfigMismatch",
    "FormatError",
    "GradientmailError",
    "NonFinite",
    "ProtocolError",
    "RejectedObject",
    "SchemaMismatch",
]


class GradientmailError(Exception):
    """The root of every error gradientmail raises on purpose."""


class ProtocolError(GradientmailError):
    """The mailbox or a peer broke the protocol, or a request cannot be honoured under it."""


class RejectedObject(GradientmailError, ValueError):
    """Bytes read from the mailbox that a node does not use (the family of untrusted input)."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        self.key = key
        super().__init__(f"{key}: {message}" if key else message)


class FormatError(RejectedObject):
    """Bytes read from the mailbox are not a valid object of ours (record, envelope, frame)."""


class ConfigMismatch(ProtocolError):
    """This node's algorithm configuration differs from the run's; ``fields`` names each."""

    def __init__(self, fields: Iterable[tuple[str, object, object]]) -> None:
        self.fields = tuple(fields)
        detail = "; ".join(
            f"{name}: run has {theirs!r}, this node {ours!r}" for name, theirs, ours in self.fields
        )
        super().__init__(f"algorithm differs from the run's: {detail}")


class SchemaMismatch(GradientmailError, ValueError):
    """Tensors do not match the schema; ``names`` lists the offending parameters."""

    names: tuple[str, ...]

    def __init__(
        self, names: Iterable[str], message: str = "parameters do not match the schema"
    ) -> None:
        self.names = tuple(names)
        super().__init__(f"{message}: {', '.join(self.names)}")


class NonFinite(GradientmailError, ValueError):
    """A delta holds NaN or Inf; ``names`` lists the tensors. A diverged node must not publish."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = tuple(names)
        super().__init__(f"non-finite values (NaN or Inf) in: {', '.join(self.names)}")
