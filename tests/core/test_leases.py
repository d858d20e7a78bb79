"""Liveness from leases on the observer's own clock: expiry after ``lease_timeout`` unchanged,
a change resets it, expiry is judged at the last poll so a pause ages nobody (Decision 3), slow
polls still expire dead nodes (F2), left nodes stay live but inactive, and a lease missing from
a listing is kept as last seen (F1); and a keeper counts a change only when the record says so
(a later counter of the process, or a new process), recognizing renewals from a listed MD5."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from hypothesis import given
from hypothesis import strategies as st

from gradientmail.core import leases
from gradientmail.core.effects import Expired, LeaseRead, LeasesListed, ReadLease, Rejected
from gradientmail.core.envelope import seal
from gradientmail.core.leases import Keeper, Leases, Observed, observe
from gradientmail.core.records import Lease, to_bytes
from gradientmail.core.signing import Keyring

EVERY = 10.0
TIMEOUT = 25.0
NA = "0123456789abcdef"
NB = "fedcba9876543210"

Listing = Mapping[str, tuple[str, bool, str]]


def poll(leases: Leases, listing: Listing, now: float) -> Leases:
    return observe(leases, listing, now=now)


def poll_until(leases: Leases, listing: Listing, start: float, end: float) -> Leases:
    """Poll the same listing every ``EVERY`` seconds from ``start`` to ``end`` inclusive."""
    t = start
    while t <= end:
        leases = poll(leases, listing, t)
        t += EVERY
    return leases


def test_nothing_observed_means_every_node_is_expired() -> None:
    empty = Leases()
    assert empty.expired("a", now=0.0, lease_timeout=TIMEOUT)
    assert empty.live(now=0.0, lease_timeout=TIMEOUT) == frozenset()
    assert empty.active(now=0.0, lease_timeout=TIMEOUT) == frozenset()
    assert empty.left() == frozenset()


def test_first_sight_counts_as_a_change_now() -> None:
    leases = poll(Leases(), {"b": ("v1", False, NB), "a": ("v1", False, NA)}, 5.0)
    assert leases.seen == (
        ("a", Observed(version="v1", left=False, nonce=NA, changed_at=5.0)),
        ("b", Observed(version="v1", left=False, nonce=NB, changed_at=5.0)),
    )
    assert leases.polled_at == 5.0
    assert leases.live(now=5.0, lease_timeout=TIMEOUT) == {"a", "b"}


def test_a_lease_unchanged_for_lease_timeout_expires() -> None:
    listing = {"a": ("v1", False, NA)}
    leases = poll_until(Leases(), listing, 0.0, 20.0)
    assert not leases.expired("a", now=24.9, lease_timeout=TIMEOUT)
    assert "a" in leases.live(now=24.9, lease_timeout=TIMEOUT)
    leases = poll(leases, listing, 25.0)
    assert leases.expired("a", now=25.0, lease_timeout=TIMEOUT)
    assert leases.live(now=25.0, lease_timeout=TIMEOUT) == frozenset()


def test_a_version_change_resets_the_timer() -> None:
    leases = poll_until(Leases(), {"a": ("v1", False, NA), "b": ("v1", False, NB)}, 0.0, 10.0)
    leases = poll(leases, {"a": ("v2", False, NA), "b": ("v1", False, NB)}, 20.0)
    assert leases.by_node["a"].changed_at == 20.0 and leases.by_node["b"].changed_at == 0.0
    leases = poll(leases, {"a": ("v2", False, NA), "b": ("v1", False, NB)}, 30.0)
    assert leases.live(now=30.0, lease_timeout=TIMEOUT) == {"a"}
    listing = {"a": ("v2", False, NA), "b": ("v1", False, NB)}
    assert not poll(leases, listing, 44.9).expired("a", now=44.9, lease_timeout=TIMEOUT)
    assert poll(leases, listing, 45.0).expired("a", now=45.0, lease_timeout=TIMEOUT)


def test_a_pause_ages_nobody_until_the_next_poll() -> None:
    leases = Leases()
    for t, version in ((0.0, "v1"), (10.0, "v2"), (20.0, "v3")):
        leases = poll(leases, {"a": (version, False, NA), "b": ("v1", False, NB)}, t)
    # Paused from 20 to 200: judged at its last poll, b (unchanged for 20 s) is still live.
    assert leases.live(now=200.0, lease_timeout=TIMEOUT) == {"a", "b"}
    assert not leases.expired("b", now=200.0, lease_timeout=TIMEOUT)
    # Its next poll shows a renewed meanwhile and b not: only b is expired.
    leases = poll(leases, {"a": ("v9", False, NA), "b": ("v1", False, NB)}, 200.0)
    assert leases.live(now=200.0, lease_timeout=TIMEOUT) == {"a"}
    assert leases.expired("b", now=200.0, lease_timeout=TIMEOUT)


def test_a_dead_node_expires_however_slowly_the_observer_polls() -> None:
    # F2 of the simulator: polls further apart than lease_every used to restart every timer.
    listing = {"a": ("v1", False, NA)}
    leases = poll(Leases(), listing, 0.0)
    leases = poll(leases, listing, 3 * EVERY)
    assert leases.by_node["a"].changed_at == 0.0
    assert leases.expired("a", now=3 * EVERY, lease_timeout=TIMEOUT)


def test_left_nodes_are_live_but_not_active() -> None:
    leases = poll(Leases(), {"a": ("v1", False, NA), "b": ("v2", True, NB)}, 0.0)
    assert leases.left() == {"b"}
    assert leases.live(now=1.0, lease_timeout=TIMEOUT) == {"a", "b"}
    assert leases.active(now=1.0, lease_timeout=TIMEOUT) == {"a"}
    assert not leases.expired("b", now=1.0, lease_timeout=TIMEOUT)


def test_an_expired_left_node_is_neither_live_nor_active_but_still_left() -> None:
    leases = poll(Leases(), {"b": ("v2", True, NB)}, 0.0)
    leases = poll(leases, {"b": ("v2", True, NB)}, TIMEOUT)
    assert leases.live(now=TIMEOUT, lease_timeout=TIMEOUT) == frozenset()
    assert leases.active(now=TIMEOUT, lease_timeout=TIMEOUT) == frozenset()
    assert leases.left() == {"b"}


def test_the_start_barrier_counts_active_nodes_only() -> None:
    view = poll(Leases(), {"a": ("v1", False, NA), "b": ("v2", True, NB)}, 0.0)
    assert leases.gathered(view, now=1.0, lease_timeout=TIMEOUT, count=2) is None, "b left"
    assert leases.gathered(view, now=1.0, lease_timeout=TIMEOUT, count=1) == {"a"}
    view = poll(view, {"a": ("v1", False, NA), "b": ("v2", True, NB), "c": ("v3", False, NB)}, 2.0)
    assert leases.gathered(view, now=2.0, lease_timeout=TIMEOUT, count=2) == {"a", "c"}
    # a unchanged since 0.0: expired at the timeout, so the barrier no longer holds
    view = poll(view, {"c": ("v4", False, NB)}, TIMEOUT)
    assert leases.gathered(view, now=TIMEOUT, lease_timeout=TIMEOUT, count=2) is None


def test_a_lease_missing_from_a_listing_is_kept_and_ages() -> None:
    # F1 of the simulator: a stale LIST without b used to expire b, a live claimant, at once.
    leases = poll(Leases(), {"a": ("v1", False, NA), "b": ("v1", False, NB)}, 0.0)
    leases = poll(leases, {"a": ("v1", False, NA)}, 5.0)
    assert leases.by_node["b"] == Observed(version="v1", left=False, nonce=NB, changed_at=0.0)
    assert not leases.expired("b", now=5.0, lease_timeout=TIMEOUT)
    leases = poll(leases, {"a": ("v1", False, NA), "b": ("v1", False, NB)}, 10.0)
    assert leases.by_node["b"].changed_at == 0.0
    leases = poll(leases, {}, TIMEOUT)
    assert leases.expired("b", now=TIMEOUT, lease_timeout=TIMEOUT)
    leases = poll(leases, {"b": ("v2", False, NB)}, TIMEOUT + 1)
    assert not leases.expired("b", now=TIMEOUT + 1, lease_timeout=TIMEOUT)


def test_a_restart_with_a_new_nonce_is_recorded() -> None:
    leases = poll(Leases(), {"a": ("v1", False, NA)}, 0.0)
    leases = poll(leases, {"a": ("v2", False, NB)}, 5.0)
    assert leases.by_node["a"] == Observed(version="v2", left=False, nonce=NB, changed_at=5.0)


def test_observe_returns_a_new_view_and_leaves_the_old_one_alone() -> None:
    before = poll(Leases(), {"a": ("v1", False, NA)}, 0.0)
    after = poll(before, {"a": ("v2", True, NA)}, 5.0)
    assert before.by_node["a"].version == "v1" and not before.by_node["a"].left
    assert after.by_node["a"].version == "v2" and after.left() == {"a"}


@given(
    st.lists(
        st.tuples(st.floats(0.5, 4 * EVERY), st.booleans(), st.booleans(), st.floats(0, 100)),
        min_size=1,
        max_size=40,
    )
)
def test_expiry_matches_a_reference_model(
    events: list[tuple[float, bool, bool, float]],
) -> None:
    """Node ``a`` renews (changes version) when told to, and is listed or not (a stale
    listing); the reference expiry is the time from the first sight of the version now listed
    to the last poll, whenever it is asked."""
    leases, now, version, first_seen = Leases(), 0.0, 0, 0.0
    leases = poll(leases, {"a": ("0", False, NA)}, now)
    seen_version = 0
    for delay, renews, listed, later in events:
        now += delay
        version += renews
        if listed:
            leases = poll(leases, {"a": (str(version), False, NA)}, now)
            if version != seen_version:
                seen_version, first_seen = version, now
        else:
            leases = poll(leases, {}, now)
        assert leases.by_node["a"].changed_at == first_seen
        expected = now - first_seen >= TIMEOUT
        assert leases.expired("a", now=now, lease_timeout=TIMEOUT) is expected
        assert leases.expired("a", now=now + later, lease_timeout=TIMEOUT) is expected
        assert ("a" in leases.active(now=now, lease_timeout=TIMEOUT)) is not expected


# -- the keeper judges changes by what the record says ---------------------------------------

KEYRING = Keyring.of(b"the run secret, at least 16 bytes")
WRONG = Keyring.of(b"a forger's guess at the secret..")


class Store:
    """What a LIST of one lease key shows: its version and the MD5 of its bytes."""

    def __init__(self) -> None:
        self.writes = 0
        self.entry: tuple[str, str, int, str | None] | None = None
        self.record: Lease | None = None

    def write(self, lease: Lease, signer: Keyring | None = KEYRING, *, md5: bool = True) -> None:
        self.writes += 1
        blob = seal(to_bytes(lease, signer))
        digest = hashlib.md5(blob, usedforsecurity=False).hexdigest() if md5 else None
        self.entry = (lease.node, f"v{self.writes}", len(blob), digest)
        self.record = lease if signer == KEYRING else None


def list_and_read(keeper: Keeper, store: Store, now: float) -> tuple[Keeper, list[object]]:
    """One LIST of the store, then the reads the keeper asks for (a forgery reads as
    rejected), as the syncer executes them."""
    assert store.entry is not None
    listing = LeasesListed(entries=(store.entry,))
    keeper, effects = leases.listed(
        keeper, listing, now=now, lease_timeout=TIMEOUT, keyring=KEYRING
    )
    reads = [e for e in effects if isinstance(e, ReadLease)]
    done: list[object] = [e for e in effects if not isinstance(e, ReadLease)]
    for read in reads:
        found = store.record
        rejected = None if found is not None else "bad signature"
        result = LeaseRead(node=read.node, lease=found, rejected=rejected)
        keeper, more = leases.read(keeper, result, now=now, lease_timeout=TIMEOUT)
        done += more
    return keeper, [*reads, *done]


def test_a_renewal_is_recognized_from_its_md5_without_a_read() -> None:
    store, keeper = Store(), Keeper()
    store.write(Lease(node="a", nonce=NA, counter=1))
    keeper, done = list_and_read(keeper, store, 0.0)
    assert [type(e) for e in done] == [ReadLease], "a new lease is read once"
    for counter in range(2, 6):
        store.write(Lease(node="a", nonce=NA, counter=counter))
        keeper, done = list_and_read(keeper, store, 10.0 * counter)
        assert done == [], "a renewal costs no GET"
    assert dict(keeper.known)["a"].counter == 5
    assert "a" in keeper.view.active(now=50.0, lease_timeout=TIMEOUT)
    # Leaving, and renewals skipped by a slow observer (within RENEWALS_AHEAD), too.
    store.write(Lease(node="a", nonce=NA, counter=9, left=True))
    keeper, done = list_and_read(keeper, store, 60.0)
    assert done == [] and keeper.view.left() == {"a"}


def test_a_forged_lease_of_any_size_keeps_no_dead_node_alive() -> None:
    """The node dies after its first renewal; a forger rewrites its lease every 10 s with
    records the same size as a genuine renewal. Each version is read once and rejected, the
    lease ages from the last genuine renewal and expires."""
    store, keeper = Store(), Keeper()
    store.write(Lease(node="a", nonce=NA, counter=1))
    keeper, _ = list_and_read(keeper, store, 0.0)
    reads = 0
    for i, t in enumerate(range(10, 60, 10)):
        store.write(Lease(node="a", nonce=NA, counter=2 + i), WRONG)
        keeper, done = list_and_read(keeper, store, float(t))
        reads += sum(isinstance(e, ReadLease) for e in done)
        assert any(isinstance(e, Rejected) for e in done)
        keeper, again = list_and_read(keeper, store, t + 5.0)
        assert again == [] or all(isinstance(e, Expired) for e in again), "read once"
    assert reads == 5
    assert keeper.view.expired("a", now=60.0, lease_timeout=TIMEOUT)
    assert keeper.expired == {"a"}


def test_a_replayed_genuine_lease_is_no_renewal() -> None:
    """A genuine older record of the same process written back, or one of a process since
    replaced (a restart), is read, reported as a replay and ages like no change."""
    store, keeper = Store(), Keeper()
    store.write(Lease(node="a", nonce=NA, counter=1))
    keeper, _ = list_and_read(keeper, store, 0.0)
    store.write(Lease(node="a", nonce=NA, counter=2))
    keeper, _ = list_and_read(keeper, store, 10.0)
    store.write(Lease(node="a", nonce=NA, counter=1))  # the old record, replayed
    keeper, done = list_and_read(keeper, store, 20.0)
    [rejected] = [e for e in done if isinstance(e, Rejected)]
    assert "replayed: counter 1, and 2 was seen" in rejected.reason
    keeper, again = list_and_read(keeper, store, 40.0)
    assert not any(isinstance(e, ReadLease) for e in again), "a replay is read once"
    assert keeper.view.expired("a", now=40.0, lease_timeout=TIMEOUT), "no change since 10 s"
    # A restart is a change; the replaced process's records are replays from then on.
    store.write(Lease(node="a", nonce=NB, counter=1))
    keeper, done = list_and_read(keeper, store, 50.0)
    assert not any(isinstance(e, Rejected) for e in done)
    assert dict(keeper.known)["a"].nonce == NB and "a" in keeper.view.live(
        now=50.0, lease_timeout=TIMEOUT
    )
    store.write(Lease(node="a", nonce=NA, counter=2))  # the old process's last, replayed
    keeper, done = list_and_read(keeper, store, 60.0)
    assert any(isinstance(e, Rejected) and f"{NA}, and 2 was seen" in e.reason for e in done)
    # The live process's renewals keep counting whatever is replayed between them.
    store.write(Lease(node="a", nonce=NB, counter=2))
    keeper, done = list_and_read(keeper, store, 70.0)
    assert not any(isinstance(e, Rejected) for e in done)
    assert keeper.view.by_node["a"].changed_at == 70.0


def test_a_replayed_record_of_a_process_never_seen_counts_once_and_no_more() -> None:
    """Processes are not ordered: an observer that never saw a node's earlier process takes
    its replayed record for a change once; the same record again is a replay, and the live
    process's next renewal counts (a replayer cannot make a live node look replaced for good,
    as the simulator's swarm found with a first version of this rule)."""
    store, keeper = Store(), Keeper()
    store.write(Lease(node="a", nonce=NB, counter=4))  # the live process
    keeper, _ = list_and_read(keeper, store, 0.0)
    store.write(Lease(node="a", nonce=NA, counter=9))  # a dead process's lease, replayed
    keeper, done = list_and_read(keeper, store, 1.0)
    assert not any(isinstance(e, Rejected) for e in done)
    store.write(Lease(node="a", nonce=NB, counter=5))
    keeper, done = list_and_read(keeper, store, 2.0)
    assert not any(isinstance(e, Rejected) for e in done)
    for t in (3.0, 5.0):
        store.write(Lease(node="a", nonce=NA, counter=9))
        keeper, done = list_and_read(keeper, store, t)
        assert any(isinstance(e, Rejected) and "and 9 was seen" in e.reason for e in done)
        store.write(Lease(node="a", nonce=NB, counter=int(t) + 3))
        keeper, done = list_and_read(keeper, store, t + 1)
        assert not any(isinstance(e, Rejected) for e in done), t
        assert keeper.view.by_node["a"].changed_at == t + 1


def test_without_an_md5_every_change_is_read() -> None:
    """Stores whose listing gives no MD5 (directories, Azure) cost one GET per renewal."""
    store, keeper = Store(), Keeper()
    reads = 0
    for counter in range(1, 5):
        store.write(Lease(node="a", nonce=NA, counter=counter), md5=False)
        keeper, done = list_and_read(keeper, store, 10.0 * counter)
        reads += sum(isinstance(e, ReadLease) for e in done)
    assert reads == 4 and dict(keeper.known)["a"].counter == 4


def test_the_md5_a_node_is_expected_to_write_is_that_of_its_sealed_record() -> None:
    lease = Lease(node="a", nonce=NA, counter=7, left=True)
    blob = seal(to_bytes(lease, KEYRING))
    assert leases.lease_md5(lease, KEYRING) == hashlib.md5(blob).hexdigest()
    assert leases.lease_md5(lease, None) != leases.lease_md5(lease, KEYRING)


def test_a_left_lease_awaits_rounds_neither_uploaded_nor_counted() -> None:
    """Decision 11 (``leases.awaited``): with four fragments, round 4 is uploaded, round 5 is
    settled by the commit of round 9 (same fragment, later) that counts the node, round 6 by
    nothing (that commit is of another fragment), round 7 by nothing (a commit of round 3 is
    earlier)."""
    waits = leases.awaited((4, 5, 6, 7), uploaded=(4,), counted=(9, 3), fragments=4)
    assert waits == frozenset({6, 7})
    assert leases.awaited((), uploaded=(), counted=(), fragments=4) == frozenset()
    assert leases.covers(9, 5, 4) and leases.covers(5, 5, 4)
    assert not leases.covers(3, 7, 4) and not leases.covers(9, 6, 4)
