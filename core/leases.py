"""Liveness from leases, timed on the observer's own monotonic clock.

A node renews its lease (``leases/<node>``) every ``lease_every`` seconds. Observers never compare
clocks across machines: they note when *they* first saw each version of a lease, and call a node
expired once a poll shows that version unchanged ``lease_timeout`` seconds after it was first seen.

Expiry is judged at the observer's last poll, never at "now": an observer that was paused (a long
GC, a suspended VM) sees nobody age until it has polled again, and that poll shows every lease
renewed meanwhile as changed, so a pause never makes others look dead (Decision 3, as refined in
docs/decisions.md). A lease missing from one listing is kept as last seen, so a stale or partial
LIST cannot expire a live node at once; it ages like any unchanged lease.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

__all__ = ["Leases", "Observed", "observe"]


@attrs.frozen(kw_only=True)
class Observed:
    """What an observer knows of one lease: its version (etag), whether it says ``left``, its
    process nonce, and when (observer's clock, seconds) the version was first seen."""

    version: str
    left: bool
    nonce: str
    changed_at: float


@attrs.frozen(kw_only=True)
class Leases:
    """An observer's view of every lease in the run, as of its poll at ``polled_at`` seconds."""

    seen: tuple[tuple[str, Observed], ...] = ()
    polled_at: float | None = None

    @property
    def by_node(self) -> dict[str, Observed]:
        return dict(self.seen)

    def _at(self, now: float) -> float:
        return now if self.polled_at is None else min(now, self.polled_at)

    def expired(self, node: str, *, now: float, lease_timeout: float) -> bool:
        """True once a poll has shown ``node``'s lease unchanged for ``lease_timeout`` seconds,
        or when it has no lease at all. Judged at the last poll (no later than ``now``)."""
        observed = self.by_node.get(node)
        return observed is None or self._at(now) - observed.changed_at >= lease_timeout

    def live(self, *, now: float, lease_timeout: float) -> frozenset[str]:
        """Nodes whose lease has not expired, whether or not they have left."""
        at = self._at(now)
        return frozenset(n for n, o in self.seen if at - o.changed_at < lease_timeout)

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
) -> Leases:
    """Fold one poll of ``leases/``, made at ``now`` (observer's clock, seconds), into the view.

    ``listing`` maps each listed node to ``(version, left, nonce)``. A new version counts as a
    change now; a lease not listed keeps what was last seen of it (and so ages).
    """
    seen = leases.by_node
    for node, (version, left, nonce) in listing.items():
        old = seen.get(node)
        changed_at = old.changed_at if old is not None and old.version == version else now
        seen[node] = Observed(version=version, left=left, nonce=nonce, changed_at=changed_at)
    return Leases(seen=tuple(sorted(seen.items())), polled_at=now)
