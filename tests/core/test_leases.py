"""Liveness from leases on the observer's own clock: expiry after ``lease_timeout`` unchanged,
a change resets it, expiry is judged at the last poll so a pause ages nobody (Decision 3), slow
polls still expire dead nodes (F2), left nodes stay live but inactive, and a lease missing from
a listing is kept as last seen (F1)."""

from __future__ import annotations

from collections.abc import Mapping

from hypothesis import given
from hypothesis import strategies as st

from gradientmail.core.leases import Leases, Observed, observe

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
