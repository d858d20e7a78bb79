"""Liveness from leases, timed on the observer's own monotonic clock.

A node renews its lease (``leases/<node>``) every ``lease_every`` seconds. Observers never compare
clocks across machines: they note when *they* first saw each version of a lease, and call a node
expired once a poll shows that version unchanged ``lease_timeout`` seconds after it was first seen.

Expiry is judged at the observer's last poll, never at "now": an observer that was paused (a long
GC, a suspended VM) sees nobody age until it has polled again, and that poll shows every lease
renewed meanwhile as changed, so a pause never makes others look dead (Decision 3, as refined in
docs/decisions.md). A lease missing from one listing is kept as last seen, so a stale or partial
LIST cannot expire a live node at once; it ages like any unchanged lease.

A change counts only when the record says so: a later ``counter`` of the same process
(``nonce``), or a process not seen before. A listed change whose MD5 (the etag S3 and GCS list)
is that of one of the next genuine renewals this observer expects (``renewal``: the exact bytes
the node writes, signed in a signed run) counts without a GET; any other change is read, and a
forgery, or a record whose counter is not above the highest judged of its process, is reported
and never read again, so it cannot keep a dead node alive.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Iterable, Mapping
from typing import Protocol

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
from gradientmail.core.envelope import seal
from gradientmail.core.records import Lease, to_bytes
from gradientmail.core.signing import Keyring

__all__ = [
    "Keeper",
    "Known",
    "Leases",
    "Observed",
    "awaited",
    "batch_share",
    "covers",
    "gathered",
    "lease_md5",
    "listed",
    "observe",
    "read",
    "renew",
    "renewal",
    "watch",
]


@attrs.frozen(kw_only=True)
class Observed:
    """What an observer knows of one lease: the record it last judged (``version``:
    ``nonce.counter``, ``Known.record``), whether it says ``left``, its process nonce, and when
    (observer's clock, seconds) that record was first seen."""

    version: str
    left: bool
    nonce: str
    changed_at: float


@attrs.frozen(kw_only=True)
class Leases:
    """An observer's view of every lease in the run, as of its poll at ``polled_at`` seconds."""

    seen: tuple[tuple[str, Observed], ...] = ()
    polled_at: float | None = None

    @functools.cached_property
    def by_node(self) -> Mapping[str, Observed]:
        """``seen`` as a mapping (made once: a view is asked many times each step)."""
        return dict(self.seen)

    @functools.cached_property
    def _live(self) -> dict[tuple[float, float], frozenset[str]]:
        return {}

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
        found = self._live.get((at, lease_timeout))
        if found is None:
            found = frozenset(n for n, o in self.seen if at - o.changed_at < lease_timeout)
            if len(self._live) < 16:  # memoized: the rules ask the same view many times a step
                self._live[(at, lease_timeout)] = found
        return found

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

    ``listing`` maps each listed node to ``(version, left, nonce)``, the version naming the
    record (``Known.record``). A new version counts as a change now; a lease not listed keeps
    what was last seen of it (and so ages).
    """
    seen = dict(leases.seen)
    for node, (version, left, nonce) in listing.items():
        old = seen.get(node)
        if old is not None and old.version == version and (old.left, old.nonce) == (left, nonce):
            continue  # unchanged: the same record, kept (most of every poll)
        changed_at = old.changed_at if old is not None and old.version == version else now
        seen[node] = Observed(version=version, left=left, nonce=nonce, changed_at=changed_at)
    return Leases(seen=tuple(sorted(seen.items())), polled_at=now)


class Observe(Protocol):
    """``observe``'s signature: a rule that folds a LIST into an observer's view."""

    def __call__(
        self, leases: Leases, listing: Mapping[str, tuple[str, bool, str]], *, now: float
    ) -> Leases: ...


def gathered(
    leases: Leases, *, now: float, lease_timeout: float, count: int
) -> frozenset[str] | None:
    """The start barrier (``Session.wait_for_nodes``): the active nodes of ``leases`` once they
    are at least ``count`` (the observer included), else None. The view is the one rounds are
    closed by, so every round after the barrier expects those nodes."""
    active = leases.active(now=now, lease_timeout=lease_timeout)
    return active if len(active) >= count else None


def covers(committed: int, r: int, fragments: int) -> bool:
    """A commit of round ``committed`` settles round ``r``: the same fragment, and ``r`` is
    that round or an earlier one (each commit's base is the one before)."""
    return committed >= r and committed % fragments == r % fragments


def awaited(
    after: Iterable[int], *, uploaded: Iterable[int], counted: Iterable[int], fragments: int
) -> frozenset[int]:
    """Decision 11: the rounds of ``after`` (a leaving node's snapshots in flight) that its
    ``left`` lease waits for: those whose snapshot is not under its key yet (``uploaded``: the
    rounds it is) and that no commit counting the node's snapshot settles (``counted``: those
    commits' rounds; ``covers``). A closer that sees the lease ``left`` then finds those
    snapshots."""
    done, settled = frozenset(uploaded), tuple(counted)
    return frozenset(
        r for r in after if r not in done and not any(covers(c, r, fragments) for c in settled)
    )


def batch_share(global_batch: int | None, active: int) -> int | None:
    """A node's share of ``global_batch`` tokens over ``active`` live nodes (at least 1 each,
    rounded up, so the shares cover the batch); None when the algorithm sets no batch."""
    if global_batch is None:
        return None
    return max(1, -(-global_batch // max(1, active)))


@attrs.frozen(kw_only=True)
class Known:
    """A lease as this node last judged it: the listing ``version`` it was seen at, and what
    the record said (``counter``, ``left``, the process ``nonce``); ``others``: the highest
    counter judged of each other process of the node seen lately (``nonce, counter``), whose
    records up to it are replays."""

    version: str
    left: bool
    nonce: str
    counter: int
    others: tuple[tuple[str, int], ...] = ()

    @property
    def record(self) -> str:
        """The record's identity (``nonce.counter``): the view counts a change when it moves."""
        return f"{self.nonce}.{self.counter}"


RENEWALS_AHEAD = 64
"""How many renewals past the last one judged an observer recognizes from a listed MD5 by
default (``listed(ahead=)``): an observer attentive to a round lists every ``lease_every / 2``
seconds, so normally the next one, but an idle one lists only when it becomes attentive, up
to ``64 * lease_every`` later without a GET per lease; one that listed longer ago, or was
paused that long, reads the lease. Each renewal recognized costs two MD5s, cached."""

OTHERS_KEPT = 4


@functools.lru_cache(maxsize=65536)
def lease_md5(lease: Lease, keyring: Keyring | None) -> str:
    """The MD5 (hex) of the object a node writes for ``lease``: its etag on S3 and GCS."""
    return hashlib.md5(seal(to_bytes(lease, keyring)), usedforsecurity=False).hexdigest()


def renewal(
    node: str,
    known: Known,
    md5: str | None,
    keyring: Keyring | None,
    ahead: int = RENEWALS_AHEAD,
) -> tuple[int, bool] | None:
    """``(counter, left)`` of the genuine renewal of ``known`` whose object has this ``md5``
    (one of the next ``ahead``, left or not), or None: the change must be read."""
    if md5 is None:
        return None
    for counter in range(known.counter + 1, known.counter + 1 + ahead):
        for left in (False, True):
            if _renewal_md5(node, known.nonce, counter, left, keyring) == md5:
                return counter, left
    return None


@functools.lru_cache(maxsize=65536)
def _renewal_md5(node: str, nonce: str, counter: int, left: bool, keyring: Keyring | None) -> str:
    """``lease_md5`` of that renewal, memoized by its fields: an observer asks it of the same
    few renewals of every node at each LIST, and making the record each time cost more than
    the lookup."""
    lease = Lease(node=node, nonce=nonce, counter=counter, left=left)
    return lease_md5.__wrapped__(lease, keyring)


def judge(node: str, known: Known | None, lease: Lease) -> str | None:
    """Why a verified ``lease`` read after a listed change is refused: a replay, a record of a
    process (``nonce``) whose counter is not above the highest judged of that process. None:
    a renewal, a process not seen lately, or the record already judged (rewritten by a retry,
    or read before the listing caught up), which is no change. Processes are not ordered (a
    nonce is random), so a record of a process never seen counts once, whichever it is: a
    replayed record costs at most one change per record the replayer holds, never a run of
    them, and a live process's next renewal always counts."""
    if known is None:
        return None
    if lease.nonce == known.nonce:
        highest = known.counter
        if lease.counter < highest:
            return f"replayed: counter {lease.counter}, and {highest} was seen"
        return None
    highest_other = dict(known.others).get(lease.nonce)
    if highest_other is not None and lease.counter <= highest_other:
        return (
            f"replayed: counter {lease.counter} of {node}'s process {lease.nonce}, and "
            f"{highest_other} was seen"
        )
    return None


@attrs.frozen(kw_only=True)
class Keeper:
    """A node's side of the leases: renewing its own every ``lease_every`` seconds, and its
    view of everyone's from a LIST of ``leases/`` at the cadence its syncer sets (``watch``).

    ``known`` is what each lease said when last judged, ``rejected`` the versions that did not
    verify or were replays (never read again), ``expired`` the nodes already reported expired.
    While a LIST's reads are in flight, ``listing`` holds the entries folded so far and
    ``waiting`` the version of each lease being read. ``listed_at`` is when the last LIST was
    made, ``next_observation`` when the next is due at the cadence last asked for."""

    counter: int = 0
    next_renewal: float = -math.inf
    listed_at: float = -math.inf
    next_observation: float = -math.inf
    leaving: bool = False
    renewing: bool = True
    view: Leases = Leases()
    known: tuple[tuple[str, Known], ...] = ()
    rejected: tuple[tuple[str, str], ...] = ()
    listing: tuple[tuple[str, tuple[str, bool, str]], ...] | None = None
    waiting: tuple[tuple[str, str], ...] = ()
    expired: frozenset[str] = frozenset()

    @property
    def deadline(self) -> float:
        """When this keeper next has something to do (seconds)."""
        renewing = self.next_renewal if self.renewing else math.inf
        observation = self.next_observation if self.listing is None else math.inf
        return min(renewing, observation)


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


def watch(keeper: Keeper, *, now: float, every: float) -> tuple[Keeper, list[Effect]]:
    """List everyone's leases ``every`` seconds after the last LIST (at once if there was none;
    never again when ``every`` is infinite), once that one is folded. The cadence may change
    from call to call (the syncer's ``lease_cadence``): the next LIST is due ``every`` seconds
    after the last one at the cadence asked for now."""
    if keeper.listing is not None:
        return keeper, []
    due = keeper.listed_at + every if keeper.listed_at > -math.inf else -math.inf
    if now < due:
        if due != keeper.next_observation:
            keeper = attrs.evolve(keeper, next_observation=due)
        return keeper, []
    keeper = attrs.evolve(keeper, listed_at=now, next_observation=now + every, listing=())
    return keeper, [ListLeases()]


def listed(
    keeper: Keeper,
    result: LeasesListed,
    *,
    now: float,
    lease_timeout: float,
    keyring: Keyring | None = None,
    ahead: int = RENEWALS_AHEAD,
    fold: Observe = observe,
) -> tuple[Keeper, list[Effect]]:
    """A LIST of ``leases/``: an unchanged entry, or one whose MD5 is one of the next ``ahead``
    renewals (``renewal``), folds at once; any other change is read first, unless that
    version was refused already. ``fold`` folds the listing into the view (``observe``, the
    rules' own: ``core.rules``)."""
    known, rejected = dict(keeper.known), dict(keeper.rejected)
    listing: dict[str, tuple[str, bool, str]] = {}
    updated = dict(known)
    waiting = []
    for node, version, _size, md5 in result.entries:
        was = known.get(node)
        if was is not None and was.version == version:
            listing[node] = (was.record, was.left, was.nonce)
            continue
        if rejected.get(node) == version:
            continue
        renewed = renewal(node, was, md5, keyring, ahead) if was is not None else None
        if was is not None and renewed is not None:
            counter, left = renewed
            updated[node] = Known(  # attrs.evolve spelled out: every renewal of every lease
                version=version, left=left, nonce=was.nonce, counter=counter, others=was.others
            )
            listing[node] = (updated[node].record, left, was.nonce)
        else:
            waiting.append((node, version))
    keeper = attrs.evolve(
        keeper,
        known=tuple(sorted(updated.items())),
        listing=tuple(sorted(listing.items())),
        waiting=tuple(waiting),
    )
    if waiting:
        return keeper, [ReadLease(node=node) for node, _ in waiting]
    return _fold(keeper, now=now, lease_timeout=lease_timeout, fold=fold)


def read(
    keeper: Keeper,
    result: LeaseRead,
    *,
    now: float,
    lease_timeout: float,
    fold: Observe = observe,
) -> tuple[Keeper, list[Effect]]:
    """One lease read after a LIST; the view is folded once every read is back. A lease that
    does not verify, or that says no change (``judge``: a replay), is reported and its version
    never read again; one that is gone or names another node is left out of this listing (what
    was last seen of it stays)."""
    waiting = dict(keeper.waiting)
    if result.node not in waiting:
        return keeper, []
    version = waiting.pop(result.node)
    effects: list[Effect] = []
    lease = result.lease
    was = dict(keeper.known).get(result.node)
    reason = result.rejected
    if reason is None and lease is not None and lease.node == result.node:
        reason = judge(result.node, was, lease)
    if reason is not None:
        rejected = dict(keeper.rejected)
        rejected[result.node] = version
        keeper = attrs.evolve(keeper, rejected=tuple(sorted(rejected.items())))
        effects.append(Rejected(key=keys.lease(result.node), reason=reason))
    elif (
        lease is not None
        and lease.node == result.node
        and was is not None
        and (lease.nonce, lease.counter) == (was.nonce, was.counter)
    ):
        # The record already judged, under a new listing version: no change.
        known = dict(keeper.known)
        known[result.node] = attrs.evolve(was, version=version)
        listing = dict(keeper.listing or ())
        listing[result.node] = (was.record, was.left, was.nonce)
        keeper = attrs.evolve(
            keeper, known=tuple(sorted(known.items())), listing=tuple(sorted(listing.items()))
        )
    elif lease is not None and lease.node == result.node:
        others = dict(was.others) if was is not None else {}
        if was is not None and was.nonce != lease.nonce:
            others.pop(lease.nonce, None)
            others[was.nonce] = max(was.counter, others.get(was.nonce, was.counter))
        now_known = Known(
            version=version,
            left=lease.left,
            nonce=lease.nonce,
            counter=lease.counter,
            others=tuple(others.items())[-OTHERS_KEPT:],
        )
        known = dict(keeper.known)
        known[result.node] = now_known
        listing = dict(keeper.listing or ())
        listing[result.node] = (now_known.record, lease.left, lease.nonce)
        keeper = attrs.evolve(
            keeper, known=tuple(sorted(known.items())), listing=tuple(sorted(listing.items()))
        )
    keeper = attrs.evolve(keeper, waiting=tuple(waiting.items()))
    if waiting:
        return keeper, effects
    keeper, folded = _fold(keeper, now=now, lease_timeout=lease_timeout, fold=fold)
    return keeper, effects + folded


def _fold(
    keeper: Keeper, *, now: float, lease_timeout: float, fold: Observe
) -> tuple[Keeper, list[Effect]]:
    """Fold the LIST just read into the view (``fold``) and report new expiries."""
    view = fold(keeper.view, dict(keeper.listing or ()), now=now)
    live = view.live(now=now, lease_timeout=lease_timeout)
    known = {node for node, _ in keeper.known}
    reports: list[Effect] = [Expired(node=node) for node in sorted(known - live - keeper.expired)]
    keeper = attrs.evolve(
        keeper, view=view, listing=None, waiting=(), expired=frozenset(known - live)
    )
    return keeper, reports
