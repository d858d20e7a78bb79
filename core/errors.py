"""The error tree every layer raises from; each carries the data a caller needs to act on it."""

from __future__ import annotations

from collections.abc import Iterable

from gradientmail.core.tensors import SchemaMismatch

__all__ = ["ConfigMismatch", "FormatError", "NonFinite", "ProtocolError", "SchemaMismatch"]


class ProtocolError(Exception):
    """The mailbox or a peer broke the protocol, or a request cannot be honoured under it."""


class FormatError(ValueError):
    """Bytes read from the mailbox are not a valid object of ours (record, envelope, frame)."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        self.key = key
        super().__init__(f"{key}: {message}" if key else message)


class ConfigMismatch(ProtocolError):
    """This node's algorithm configuration differs from the run's; ``fields`` names each."""

    def __init__(self, fields: Iterable[tuple[str, object, object]]) -> None:
        self.fields = tuple(fields)
        detail = "; ".join(
            f"{name}: run has {theirs!r}, this node {ours!r}" for name, theirs, ours in self.fields
        )
        super().__init__(f"algorithm differs from the run's: {detail}")


class NonFinite(ValueError):
    """A delta holds NaN or Inf; ``names`` lists the tensors. A diverged node must not publish."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = tuple(names)
        super().__init__(f"non-finite values (NaN or Inf) in: {', '.join(self.names)}")
