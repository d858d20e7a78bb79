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

import math
from collections.abc import Mapping

import attrs

from gradientmail.core import keys
from gradientmail.core.effects import (
    Effect,
    Expired,
    LeaseRead,
    LeasesListed,
    ListLeases,
    ReadLease,
    Rejected,
    RenewLease,
)
from gradientmail.core.records import Lease

__all__ = [
    "Keeper",
    "Known",
    "Leases",
    "Observed",
    "batch_share",
    "listed",
    "needs_read",
    "observe",
    "read",
    "renew",
    "watch",
]


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


def batch_share(global_batch: int | None, active: int) -> int | None:
    """A node's share of ``global_batch`` tokens over ``active`` live nodes (at least 1 each,
    rounded up, so the shares cover the batch); None when the algorithm sets no batch."""
    if global_batch is None:
        return None
    return max(1, -(-global_batch // max(1, active)))


@attrs.frozen(kw_only=True)
class Known:
    """A lease as this node last read it: the listing entry it was read at (``version``,
    ``size``) and what the record said."""

    version: str
    size: int
    left: bool
    nonce: str


@attrs.frozen(kw_only=True)
class Keeper:
    """A node's side of the leases: renewing its own every ``lease_every`` seconds, and its
    view of everyone's from a LIST of ``leases/`` every ``lease_every / 2`` seconds.

    ``known`` is what each lease said when last read, ``rejected`` the versions that did not
    verify (never read again), ``expired`` the nodes already reported expired. While a LIST's
    reads are in flight, ``listing`` holds the entries folded so far and ``waiting`` the
    version and size of each lease being read."""

    counter: int = 0
    next_renewal: float = -math.inf
    next_observation: float = -math.inf
    leaving: bool = False
    renewing: bool = True
    view: Leases = Leases()
    known: tuple[tuple[str, Known], ...] = ()
    rejected: tuple[tuple[str, str], ...] = ()
    listing: tuple[tuple[str, tuple[str, bool, str]], ...] | None = None
    waiting: tuple[tuple[str, tuple[str, int]], ...] = ()
    expired: frozenset[str] = frozenset()

    @property
    def deadline(self) -> float:
        """When this keeper next has something to do (seconds)."""
        renewal = self.next_renewal if self.renewing else math.inf
        observation = self.next_observation if self.listing is None else math.inf
        return min(renewal, observation)


def needs_read(known: Known | None, version: str, size: int) -> bool:
    """Whether a listed lease must be read (GET): it is new, or it changed in a way a renewal
    cannot (Decision 8: a renewal costs no GET). A lease's size changes whenever its ``left``
    flag does (``records.Lease``), so an entry of the same version or size as the one last
    read is that lease unchanged or renewed."""
    return known is None or (known.version != version and known.size != size)


def renew(
    keeper: Keeper, *, node: str, nonce: str, now: float, lease_every: float
) -> tuple[Keeper, list[Effect]]:
    """Renew this node's lease when it is due (every ``lease_every`` seconds)."""
    if not keeper.renewing or now < keeper.next_renewal:
        return keeper, []
    counter = keeper.counter + 1
    lease = Lease(node=node, nonce=nonce, counter=counter, left=keeper.leaving)
    keeper = attrs.evolve(keeper, counter=counter, next_renewal=now + lease_every)
    return keeper, [RenewLease(lease=lease)]


def watch(keeper: Keeper, *, now: float, lease_every: float) -> tuple[Keeper, list[Effect]]:
    """List everyone's leases when it is due (every ``lease_every / 2`` seconds, once the
    previous LIST is folded)."""
    if keeper.listing is not None or now < keeper.next_observation:
        return keeper, []
    keeper = attrs.evolve(keeper, next_observation=now + lease_every / 2, listing=())
    return keeper, [ListLeases()]


def listed(
    keeper: Keeper, result: LeasesListed, *, now: float, lease_timeout: float
) -> tuple[Keeper, list[Effect]]:
    """A LIST of ``leases/``: renewals fold at once; a lease that is new or changed beyond a
    renewal is read first (unless that version was rejected already)."""
    known, rejected = dict(keeper.known), dict(keeper.rejected)
    listing: dict[str, tuple[str, bool, str]] = {}
    updated = dict(known)
    waiting = []
    for node, version, size in result.entries:
        was = known.get(node)
        if was is not None and not needs_read(was, version, size):
            updated[node] = attrs.evolve(was, version=version)
            listing[node] = (version, was.left, was.nonce)
        elif rejected.get(node) != version:
            waiting.append((node, (version, size)))
    keeper = attrs.evolve(
        keeper,
        known=tuple(sorted(updated.items())),
        listing=tuple(sorted(listing.items())),
        waiting=tuple(waiting),
    )
    if waiting:
        return keeper, [ReadLease(node=node) for node, _ in waiting]
    return _fold(keeper, now=now, lease_timeout=lease_timeout)


def read(
    keeper: Keeper, result: LeaseRead, *, now: float, lease_timeout: float
) -> tuple[Keeper, list[Effect]]:
    """One lease read after a LIST; the view is folded once every read is back. A lease that
    does not verify is reported and its version never read again; one that is gone or names
    another node is left out of this listing (what was last seen of it stays)."""
    waiting = dict(keeper.waiting)
    if result.node not in waiting:
        return keeper, []
    version, size = waiting.pop(result.node)
    effects: list[Effect] = []
    lease = result.lease
    if result.rejected is not None:
        rejected = dict(keeper.rejected)
        rejected[result.node] = version
        keeper = attrs.evolve(keeper, rejected=tuple(sorted(rejected.items())))
        effects.append(Rejected(key=keys.lease(result.node), reason=result.rejected))
    elif lease is not None and lease.node == result.node:
        known = dict(keeper.known)
        known[result.node] = Known(version=version, size=size, left=lease.left, nonce=lease.nonce)
        listing = dict(keeper.listing or ())
        listing[result.node] = (version, lease.left, lease.nonce)
        keeper = attrs.evolve(
            keeper, known=tuple(sorted(known.items())), listing=tuple(sorted(listing.items()))
        )
    keeper = attrs.evolve(keeper, waiting=tuple(waiting.items()))
    if waiting:
        return keeper, effects
    keeper, folded = _fold(keeper, now=now, lease_timeout=lease_timeout)
    return keeper, effects + folded


def _fold(keeper: Keeper, *, now: float, lease_timeout: float) -> tuple[Keeper, list[Effect]]:
    """Fold the LIST just read into the view (``observe``) and report new expiries."""
    view = observe(keeper.view, dict(keeper.listing or ()), now=now)
    live = view.live(now=now, lease_timeout=lease_timeout)
    known = {node for node, _ in keeper.known}
    reports: list[Effect] = [Expired(node=node) for node in sorted(known - live - keeper.expired)]
    keeper = attrs.evolve(
        keeper, view=view, listing=None, waiting=(), expired=frozenset(known - live)
    )
    return keeper, reports
