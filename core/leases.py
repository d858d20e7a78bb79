"""Liveness from leases, timed on the observer's own monotonic clock.

A node renews its lease (``leases/<node>``) every ``lease_every`` seconds. Observers never compare
clocks across machines: they note when *they* saw a lease's version change, and call a node
expired once they have seen it unchanged for ``lease_timeout`` seconds while polling at least every
``lease_every`` seconds. A gap in the observer's own polling (its process was paused, say by a
long GC or a suspended VM) restarts every timer, so a pause never makes others look dead
(Decision 3).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

__all__ = ["Leases", "Observed", "observe"]


@attrs.frozen(kw_only=True)
class Observed:
    """What an observer knows of one lease: its version (etag), whether it says ``left``, its
    process nonce, and when (observer's clock, seconds) the version was last seen to change."""

    version: str
    left: bool
    nonce: str
    changed_at: float


@attrs.frozen(kw_only=True)
class Leases:
    """An observer's view of every lease in the run."""

    seen: tuple[tuple[str, Observed], ...] = ()
    polled_at: float | None = None

    @property
    def by_node(self) -> dict[str, Observed]:
        return dict(self.seen)

    def expired(self, node: str, *, now: float, lease_timeout: float) -> bool:
        """True once ``node``'s lease has been seen unchanged for ``lease_timeout`` seconds,
        or when it has no lease at all."""
        observed = self.by_node.get(node)
        return observed is None or now - observed.changed_at >= lease_timeout

    def live(self, *, now: float, lease_timeout: float) -> frozenset[str]:
        """Nodes whose lease has not expired, whether or not they have left."""
        return frozenset(n for n, o in self.seen if now - o.changed_at < lease_timeout)

    def active(self, *, now: float, lease_timeout: float) -> frozenset[str]:
        """Live nodes that have not left: the ones a round may wait for."""
        by_node = self.by_node
        return frozenset(
            n for n in self.live(now=now, lease_timeout=lease_timeout) if not by_node[n].left
        )

    def left(self) -> frozenset[str]:
        return frozenset(n for n, o in self.seen if o.left)


def observe(
    leases: Leases,
    listing: Mapping[str, tuple[str, bool, str]],
    *,
    now: float,
    lease_every: float,
) -> Leases:
    """Fold one poll of ``leases/`` into the view.

    ``listing`` maps each node with a lease to ``(version, left, nonce)``. A lease no longer
    listed is forgotten. When the previous poll is more than ``lease_every`` seconds ago, this
    observer was not watching, so every node counts as changed now.
    """
    gap = leases.polled_at is not None and now - leases.polled_at > lease_every
    before = leases.by_node
    seen = []
    for node in sorted(listing):
        version, left, nonce = listing[node]
        old = before.get(node)
        changed = gap or old is None or old.version != version
        changed_at = now if changed or old is None else old.changed_at
        seen.append(
            (node, Observed(version=version, left=left, nonce=nonce, changed_at=changed_at))
        )
    return Leases(seen=tuple(seen), polled_at=now)
