"""The mailbox of a world: immutable abstract objects under the real key layout.

Objects carry what the protocol reads from a record, without payload bytes: a snapshot carries
the half-open interval of sample indices it covers (``lo``, ``hi``) in its writer's incarnation
(``epoch``), so "each published sample is counted in at most one commit" can be checked. An
incarnation's nonce is its ``epoch``: a node's objects of one process share it, and a restarted
process has a new one (Decision 9).

Snapshots, claims, commits, payloads and the manifest are create-only; leases are put by their
owner. Keys come from ``gradientmail.core.keys``, so a model object lies where the real one does.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from typing import NamedTuple, Union

from gradientmail.core import keys

__all__ = [
    "ClaimObj",
    "CommitObj",
    "Inc",
    "LeaseObj",
    "Mailbox",
    "ManifestObj",
    "Obj",
    "ParamsObj",
    "SnapObj",
    "nonce",
]


def nonce(node: int, epoch: int, attempt: int = 0) -> str:
    """The 16-hex-digit nonce of incarnation ``epoch`` of node ``node`` (``attempt`` tells a
    closer's payloads of different attempts apart)."""
    return f"{node:04x}{epoch:06x}{attempt:06x}"


class ManifestObj(NamedTuple):
    creator: str
    epoch: int


class LeaseObj(NamedTuple):
    node: str
    epoch: int
    counter: int
    left: bool

    @property
    def version(self) -> str:
        """The etag: every put of a lease changes it."""
        return f"{self.epoch}.{self.counter}"


class SnapObj(NamedTuple):
    node: str
    epoch: int
    round: int
    base: int
    lo: int
    hi: int
    steps: int

    @property
    def samples(self) -> int:
        return self.hi - self.lo


class ClaimObj(NamedTuple):
    node: str
    epoch: int
    round: int
    attempt: int


class Inc(NamedTuple):
    """A snapshot a commit includes: who, which incarnation, its base and samples."""

    node: str
    epoch: int
    base: int
    lo: int
    hi: int
    steps: int


class CommitObj(NamedTuple):
    round: int
    base: int
    closer: str
    epoch: int
    attempt: int
    included: tuple[Inc, ...]

    @property
    def params_key(self) -> str:
        return keys.params(self.round, nonce(int(self.closer[1:]), self.epoch, self.attempt))

    def includes(self, node: str, epoch: int) -> bool:
        return any(i.node == node and i.epoch == epoch for i in self.included)


class ParamsObj(NamedTuple):
    round: int
    closer: str
    epoch: int
    attempt: int


Obj = Union[ManifestObj, LeaseObj, SnapObj, ClaimObj, CommitObj, ParamsObj]  # noqa: UP007


class Mailbox:
    """An immutable map from key to object, sorted by key; every write returns a new one."""

    __slots__ = ("_index", "keys", "values")

    def __init__(self, keys: tuple[str, ...] = (), values: tuple[Obj, ...] = ()) -> None:
        self.keys = keys
        self.values = values
        self._index: dict[str, Obj] | None = None

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Mailbox) and self.keys == other.keys and self.values == other.values
        )

    def __hash__(self) -> int:
        return hash((self.keys, self.values))

    def __repr__(self) -> str:
        return f"Mailbox({len(self.keys)} objects)"

    def __len__(self) -> int:
        return len(self.keys)

    def items(self) -> Iterator[tuple[str, Obj]]:
        return zip(self.keys, self.values, strict=True)

    def get(self, key: str) -> Obj | None:
        if self._index is None:
            self._index = dict(zip(self.keys, self.values, strict=True))
        return self._index.get(key)

    def __contains__(self, key: str) -> bool:
        return self.get(key) is not None

    def list(self, prefix: str) -> list[tuple[str, Obj]]:
        """The objects under ``prefix``, in key order (one LIST)."""
        i = bisect_left(self.keys, prefix)
        found = []
        while i < len(self.keys) and self.keys[i].startswith(prefix):
            found.append((self.keys[i], self.values[i]))
            i += 1
        return found

    def put(self, key: str, obj: Obj) -> Mailbox:
        i = bisect_left(self.keys, key)
        if i < len(self.keys) and self.keys[i] == key:
            values = (*self.values[:i], obj, *self.values[i + 1 :])
            return Mailbox(self.keys, values)
        return Mailbox(
            (*self.keys[:i], key, *self.keys[i:]), (*self.values[:i], obj, *self.values[i:])
        )

    def create(self, key: str, obj: Obj) -> tuple[Mailbox, bool]:
        """Put-if-absent: the new mailbox and whether this create made the object."""
        if key in self:
            return self, False
        return self.put(key, obj), True

    def delete(self, key: str) -> Mailbox:
        i = bisect_left(self.keys, key)
        if i < len(self.keys) and self.keys[i] == key:
            return Mailbox(
                self.keys[:i] + self.keys[i + 1 :], self.values[:i] + self.values[i + 1 :]
            )
        return self

    def commits(self) -> Iterator[CommitObj]:
        for _, obj in self.list(keys.ROUNDS):
            if isinstance(obj, CommitObj):
                yield obj
