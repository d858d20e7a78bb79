"""Which object at a round's commit keys is its commit (Decision 17: a squatted key costs
reads, not progress).

A round has a fixed sequence of commit keys, ``keys.commit(r, 0)``, ``keys.commit(r, 1)``, ...
(``rounds/<r>/commit``, ``rounds/<r>/commit-0001``, ...), all create-only. **The round's commit
is the object at the first of them that verifies.** Readers walk the keys in order: a missing key
ends the walk (the round has no commit yet); an object that does not verify (garbage, a forgery
in a signed run, a genuine record of another round replayed there) is reported and passed; the
first one that verifies is the commit. A closer creates its commit at the first key it has not
seen passed; when that key is taken, it reads what is there: a commit that verifies ends its
close (another closer won), anything else is passed and the next key is tried.

Exactly once: objects at create-only keys never change (deleting them is an operator's act,
outside the protocol), and whether an object verifies depends on its bytes and the run's secret
only, so every honest node passes the same keys. An honest closer writes at key ``s`` only after
reading every key before ``s`` as holding an object that does not verify; so two verified commits
at ``s1 < s2`` would mean the writer of ``s2`` read ``s1``, a verified commit, as not verifying.
A read damaged in transit could do that, so an object is passed only after a second read fails
too (the shell's part). A writer without the secret costs each node a bounded number of reads per
object it plants (each passed key is remembered), and it must plant before the honest commit to
cost anything; it can stop a round only by filling all ``keys.MAX_SLOT + 1`` keys.

Key rotation keeps this true because an open round's commit is judged by nodes holding the secret
it was signed with (docs/security.md: a node drops the old secret only once every node signs with
the new one); old rounds whose commits verify under no secret held are only walked past by the
chain walk (``core.chain``), never closed again.
"""

from __future__ import annotations

from typing import Literal

from gradientmail.core import keys

__all__ = ["Seen", "next_slot"]

Seen = Literal["missing", "verified", "refused"]


def next_slot(slot: int, seen: Seen) -> int | None:
    """After finding ``seen`` at commit key ``slot`` of a round: the slot to read (or create at)
    next, or None when the walk ends there: ``missing`` (no commit yet, or the key to create
    at), ``verified`` (this is the round's commit), or ``refused`` at the last slot (every key is
    taken by objects that do not verify: the round cannot commit)."""
    if seen == "refused" and slot < keys.MAX_SLOT:
        return slot + 1
    return None
