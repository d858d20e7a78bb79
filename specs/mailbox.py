"""The mailbox of a world: immutable objects under the real key layout.

Records are the core's own (``Manifest``, ``Lease``, ``Claim``, ``Commit``), so the rules read
exactly what a real reader parses. Snapshots are ``SnapObj``: the record a reader gets
(``record``) plus what only the world knows, the half-open interval of sample indices the
snapshot covers in its writer's incarnation (``lo``, ``hi``), so "each published sample is
counted in at most one commit" can be checked. Payloads (``params``, ``state``, initial
parameters) are ``Payload`` markers: the rules only ever ask whether one is there.

Snapshots, claims, commits, payloads and the manifest are create-only; leases and the heads
hint are put by their owner. Keys come from ``gradientmail.core.keys``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from functools import lru_cache
from typing import NamedTuple, Union

from gradientmail.core import keys, slots
from gradientmail.core.records import Claim, Commit, Lease, Manifest, Snapshot, to_bytes

__all__ = [
    "DIGEST",
    "Forged",
    "Mailbox",
    "Obj",
    "Payload",
    "SnapObj",
    "commit_at",
    "lease_size",
    "nonce",
]

DIGEST = "0" * 64
"""The payload digest every model snapshot and payload carries (no bytes are modelled)."""


def nonce(node: int, epoch: int) -> str:
    """The process nonce of incarnation ``epoch`` of node ``node`` (16 hex digits)."""
    return f"{node:04x}{epoch:012x}"


class SnapObj(NamedTuple):
    """A snapshot: the record a reader gets, and the samples ``lo .. hi - 1`` it covers."""

    record: Snapshot
    epoch: int
    lo: int
    hi: int


class Payload(NamedTuple):
    """A payload object (params, state or initial parameters): only its presence matters."""

    key: str


class Forged(NamedTuple):
    """An object a writer without the run's secret planted at a create-only key: garbage or a
    forgery, which no reader verifies (``Config.forgeries``)."""

    key: str


Obj = Union[Manifest, Lease, SnapObj, Claim, Commit, Payload, Forged, int]  # noqa: UP007


def commit_at(mailbox: Mailbox, r: int) -> tuple[str, Commit | None]:
    """Round ``r``'s commit as every reader finds it (``core.slots``): the commit at the first
    of its commit keys that verifies, with that key; or None with the key the walk stopped at
    (the first free one, where a closer creates)."""
    slot: int | None = 0
    while slot is not None:
        key = keys.commit(r, slot)
        found = mailbox.get(key)
        if isinstance(found, Commit):
            return key, found
        slot = slots.next_slot(slot, "missing" if found is None else "refused")
    return key, None


def snapshot_at(mailbox: Mailbox, r: int, node: str) -> tuple[str, SnapObj | None]:
    """``node``'s snapshot of round ``r`` as every reader finds it (``core.slots``): the one at
    the first of its snapshot keys that verifies, with that key; or None with the key the walk
    stopped at (the first free one, where the node creates)."""
    slot: int | None = 0
    while slot is not None:
        key = keys.snapshot(r, node, slot)
        found = mailbox.get(key)
        if isinstance(found, SnapObj):
            return key, found
        slot = slots.next_slot(slot, "missing" if found is None else "refused")
    return key, None


def manifest_at(mailbox: Mailbox) -> tuple[str, Manifest | None]:
    """The run's manifest as every reader finds it (``core.slots``), with its key; or None with
    the first free manifest key."""
    slot: int | None = 0
    while slot is not None:
        key = keys.manifest(slot)
        found = mailbox.get(key)
        if isinstance(found, Manifest):
            return key, found
        slot = slots.next_slot(slot, "missing" if found is None else "refused")
    return key, None


@lru_cache(maxsize=4096)
def lease_size(lease: Lease) -> int:
    """The size a store lists for ``lease``: its record's bytes (``left`` makes it longer)."""
    return len(to_bytes(lease))


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

    def commits(self) -> Iterator[Commit]:
        for _, obj in self.list(keys.ROUNDS):
            if isinstance(obj, Commit):
                yield obj
