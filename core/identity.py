"""Identity (Decision 9): which objects are this process's, by the nonce it writes into them.

Every record a node creates carries a nonce drawn by its process (snapshots, claims, commits,
the manifest), and every process has one of its own (``Lease.nonce``). Two rules follow:

- A create is ours when it created the object, or when an earlier try of it failed in transit
  and the object found at the key carries our nonce (the try landed and only its answer was
  lost). Anything else at the key is another writer's: for a snapshot, another incarnation's,
  so the round is missed; for a claim or a commit, another closer's.
- Joining under a learner id whose lease another process is still renewing is refused: a
  lease that changes (counter or nonce) between two reads ``lease_every * 1.5`` apart is live.
"""

from __future__ import annotations

import hashlib

from gradientmail.core.effects import Created
from gradientmail.core.records import Lease

__all__ = ["IDENTITY_WAIT", "conflict", "derived", "ours"]

IDENTITY_WAIT = 1.5
"""Lease intervals a joining node waits between its two reads of its own lease."""


def ours(created: Created, nonce: str) -> bool:
    """Whether the create reported by ``created`` left our object (``nonce``) at its key."""
    if created.outcome == "created":
        return True
    return created.outcome == "ambiguous" and created.nonce == nonce


def conflict(node: str, first: Lease | None, second: Lease | None) -> str | None:
    """Why joining as ``node`` must be refused, or None: its lease (read twice, ``lease_every *
    IDENTITY_WAIT`` seconds apart) was renewed meanwhile by a live process. A lease that says
    it left, or that stood still, belongs to a process that is gone."""
    if first is None or first.left or second is None or second.left:
        return None
    if (second.nonce, second.counter) == (first.nonce, first.counter):
        return None
    return (
        f"learner id {node!r} is in use by a live process (nonce {second.nonce}); "
        "choose another learner_id or stop that process"
    )


def derived(process: str, *parts: object) -> str:
    """A nonce of this process for ``parts`` (16 hex digits): distinct for distinct parts, so a
    process marks each snapshot and claim it writes without drawing randomness in a rule."""
    text = ":".join((process, *(str(p) for p in parts)))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
