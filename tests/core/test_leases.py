"""Liveness from leases on the observer's own clock: expiry after ``lease_timeout`` unchanged,
a change resets it, a gap in the observer's polling restarts every timer (Decision 3), left
nodes stay live but inactive, and unlisted leases are forgotten."""

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
    return observe(leases, listing, now=now, lease_every=EVERY)


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
    assert not leases.expired("a", now=44.9, lease_timeout=TIMEOUT)
    assert leases.expired("a", now=45.0, lease_timeout=TIMEOUT)


def test_a_gap_in_the_observers_polling_restarts_every_timer() -> None:
    listing = {"a": ("v1", False, NA), "b": ("v1", False, NB)}
    leases = poll_until(Leases(), listing, 0.0, 20.0)
    # The observer was paused from 20 to 200: nobody is expired on its return.
    leases = poll(leases, listing, 200.0)
    assert leases.live(now=200.0, lease_timeout=TIMEOUT) == {"a", "b"}
    assert all(o.changed_at == 200.0 for _, o in leases.seen)
    assert leases.expired("a", now=225.0, lease_timeout=TIMEOUT)


def test_a_poll_exactly_lease_every_after_the_last_is_not_a_gap() -> None:
    listing = {"a": ("v1", False, NA)}
    leases = poll(poll(Leases(), listing, 0.0), listing, EVERY)
    assert leases.by_node["a"].changed_at == 0.0
    leases = poll(leases, listing, 2 * EVERY + 0.001)
    assert leases.by_node["a"].changed_at == 2 * EVERY + 0.001


def test_left_nodes_are_live_but_not_active() -> None:
    leases = poll(Leases(), {"a": ("v1", False, NA), "b": ("v2", True, NB)}, 0.0)
    assert leases.left() == {"b"}
    assert leases.live(now=1.0, lease_timeout=TIMEOUT) == {"a", "b"}
    assert leases.active(now=1.0, lease_timeout=TIMEOUT) == {"a"}
    assert not leases.expired("b", now=1.0, lease_timeout=TIMEOUT)


def test_an_expired_left_node_is_neither_live_nor_active_but_still_left() -> None:
    leases = poll(Leases(), {"b": ("v2", True, NB)}, 0.0)
    assert leases.live(now=TIMEOUT, lease_timeout=TIMEOUT) == frozenset()
    assert leases.active(now=TIMEOUT, lease_timeout=TIMEOUT) == frozenset()
    assert leases.left() == {"b"}


def test_an_unlisted_lease_is_forgotten() -> None:
    leases = poll(Leases(), {"a": ("v1", False, NA), "b": ("v1", False, NB)}, 0.0)
    leases = poll(leases, {"a": ("v1", False, NA)}, 5.0)
    assert set(leases.by_node) == {"a"}
    assert leases.expired("b", now=5.0, lease_timeout=TIMEOUT)
    leases = poll(leases, {"a": ("v1", False, NA), "b": ("v1", False, NB)}, 10.0)
    assert leases.by_node["b"].changed_at == 10.0


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
        st.tuples(st.floats(0.5, 2 * EVERY), st.booleans(), st.booleans()),
        min_size=1,
        max_size=40,
    )
)
def test_expiry_matches_a_reference_model(events: list[tuple[float, bool, bool]]) -> None:
    """Node ``a`` renews (changes version) when told to; the reference expiry is the time since
    the last change or polling gap, measured at every poll."""
    leases, now, version, last_change = Leases(), 0.0, 0, 0.0
    leases = poll(leases, {"a": ("0", False, NA)}, now)
    for delay, renews, listed in events:
        previous, now = now, now + delay
        version += renews
        if not listed:
            leases = poll(leases, {}, now)
            assert leases.expired("a", now=now, lease_timeout=TIMEOUT)
            last_change = now
            continue
        was_listed = "a" in leases.by_node
        leases = poll(leases, {"a": (str(version), False, NA)}, now)
        if renews or not was_listed or now - previous > EVERY:
            last_change = now
        assert leases.by_node["a"].changed_at == last_change
        expected = now - last_change >= TIMEOUT
        assert leases.expired("a", now=now, lease_timeout=TIMEOUT) is expected
        assert ("a" in leases.active(now=now, lease_timeout=TIMEOUT)) is not expected
