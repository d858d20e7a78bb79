"""The syncer's rules: when a round closes (everyone in, or quorum plus grace), who closes it and
when another node takes over, what a commit includes and how it weighs deltas, and what may be
garbage-collected."""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterable

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradientmail.core import chain, gc
from gradientmail.core import closing as rules
from gradientmail.core.algorithm import DiLoCo
from gradientmail.core.closing import ClaimRound, Done, RoundView, RoundWatch, Wait
from gradientmail.core.leases import Leases, Observed
from gradientmail.core.records import Claim, Included, Snapshot

NONCE = "0123456789abcdef"
DIGEST = "cd" * 32
TIMEOUT = 100.0
TAKEOVER = 120.0
T0 = 1000.0


def algo(quorum: int = 1, grace: float = 30.0, k: int = 1) -> DiLoCo:
    return DiLoCo(inner_steps=12, fragments=k, quorum_size=quorum, grace=grace)


def leases(
    live: Iterable[str] = (),
    *,
    expired: Iterable[str] = (),
    left: Iterable[str] = (),
    now: float = T0,
) -> Leases:
    """Leases as an observer polling regularly sees them at ``now``: ``live`` nodes changed
    just now, ``expired`` ones last changed ``TIMEOUT`` ago; ``left`` ones say they left."""
    gone = set(left)
    seen = [(n, Observed(version="v", left=n in gone, nonce=NONCE, changed_at=now)) for n in live]
    seen += [
        (n, Observed(version="v", left=n in gone, nonce=NONCE, changed_at=now - TIMEOUT))
        for n in expired
    ]
    return Leases(seen=tuple(sorted(seen)), polled_at=now)


def view(
    r: int,
    reporters: Iterable[str],
    previous: Iterable[str] | None = None,
    claims: Iterable[Claim] = (),
    committed: bool = False,
) -> RoundView:
    return RoundView(
        round=r,
        reporters=tuple(sorted(reporters)),
        previous_reporters=None if previous is None else tuple(sorted(previous)),
        claims=tuple(claims),
        committed=committed,
    )


def decide(
    v: RoundView, watch: RoundWatch, ls: Leases, me: str, now: float, a: DiLoCo | None = None
) -> tuple[RoundWatch, rules.Decision]:
    return rules.decide(
        v,
        watch,
        ls,
        me=me,
        algorithm=a or algo(),
        now=now,
        lease_timeout=TIMEOUT,
        takeover=TAKEOVER,
    )


def claim(node: str, r: int = 0, attempt: int = 0) -> Claim:
    return Claim(node=node, nonce=NONCE, round=r, attempt=attempt)


def first(v: RoundView, ls: Leases, attempt: int = 0, now: float = T0) -> str:
    return rules.designated(v.reporters, v.round, attempt, ls, now=now, timeout=TIMEOUT)[0]


@pytest.mark.parametrize(
    ("r", "k", "previous"), [(0, 1, -1), (5, 1, 4), (2, 3, -1), (3, 3, 0), (10, 4, 6)]
)
def test_previous_round_is_r_minus_k_or_the_manifest(r: int, k: int, previous: int) -> None:
    assert chain.previous_round(DiLoCo(inner_steps=12, fragments=k), r) == previous


def test_a_committed_round_is_done() -> None:
    _, decision = decide(
        view(3, ["a"], committed=True), RoundWatch(round=3), leases(["a"]), "a", T0
    )
    assert isinstance(decision, Done) and "committed" in decision.reason


def test_a_round_without_snapshots_waits_for_the_view_to_change() -> None:
    _, decision = decide(view(0, []), RoundWatch(round=0), leases(["a"]), "a", T0)
    assert decision == Wait(until=None, reason="round 0 has no snapshot yet")


def test_a_first_round_closes_once_every_active_node_reported_even_below_quorum() -> None:
    ls = leases(["a", "b", "c"])
    v = view(0, ["a", "b", "c"])
    closer = first(v, ls)
    watch, decision = decide(v, RoundWatch(round=0), ls, closer, T0, algo(quorum=5))
    assert decision == ClaimRound(
        round=0, attempt=0, reason=f"{closer} is candidate 0 of attempt 0"
    )
    assert watch.open_since == T0 and watch.quorum_since is None


def test_a_first_round_waits_for_every_active_node() -> None:
    ls = leases(["a", "b", "c"])
    _, decision = decide(view(0, ["a", "b"]), RoundWatch(round=0), ls, "a", T0, algo(quorum=3))
    assert isinstance(decision, Wait) and decision.until is None
    assert "2 of quorum 3" in decision.reason and "['c']" in decision.reason


def test_a_later_round_expects_only_the_previous_rounds_reporters() -> None:
    # c joined after round 0: round 1 does not wait for it.
    ls = leases(["a", "b", "c"])
    v = view(1, ["a", "b"], previous=["a", "b"])
    _, decision = decide(v, RoundWatch(round=1), ls, first(v, ls), T0, algo(quorum=3))
    assert isinstance(decision, ClaimRound)


def test_expired_and_left_nodes_are_not_waited_for() -> None:
    ls = leases(["a", "d"], expired=["b"], left=["d"])
    v = view(1, ["a"], previous=["a", "b", "d"])
    _, decision = decide(v, RoundWatch(round=1), ls, "a", T0, algo(quorum=3))
    assert isinstance(decision, ClaimRound)


def test_quorum_waits_grace_for_expected_nodes_then_closes() -> None:
    a = algo(quorum=2, grace=30.0)
    ls = leases(["a", "b", "c"])
    v = view(1, ["a", "b"], previous=["a", "b", "c"])
    me = first(v, ls)
    watch, decision = decide(v, RoundWatch(round=1), ls, me, T0, a)
    assert decision == Wait(until=T0 + 30.0, reason="round 1: grace for ['c']")
    assert watch.quorum_since == T0 and watch.open_since is None
    watch, decision = decide(v, watch, ls, me, T0 + 29.9, a)
    assert isinstance(decision, Wait) and decision.until == T0 + 30.0
    watch, decision = decide(v, watch, ls, me, T0 + 30.0, a)
    assert isinstance(decision, ClaimRound) and decision.attempt == 0
    assert watch.quorum_since == T0 and watch.open_since == T0 + 30.0


def test_the_straggler_arriving_within_grace_closes_the_round_at_once() -> None:
    a = algo(quorum=2, grace=30.0)
    ls = leases(["a", "b", "c"])
    watch, _ = decide(view(1, ["a", "b"], ["a", "b", "c"]), RoundWatch(round=1), ls, "a", T0, a)
    v = view(1, ["a", "b", "c"], ["a", "b", "c"])
    _, decision = decide(v, watch, ls, first(v, ls), T0 + 1, a)
    assert isinstance(decision, ClaimRound)


def test_below_quorum_waits_without_a_deadline() -> None:
    ls = leases(["a", "b", "c"])
    _, decision = decide(
        view(1, ["a"], ["a", "b", "c"]), RoundWatch(round=1), ls, "a", T0 + 10_000, algo(quorum=2)
    )
    assert isinstance(decision, Wait) and decision.until is None


def test_grace_runs_out_when_the_quorum_was_first_seen_at_time_zero() -> None:
    a = algo(quorum=1, grace=5.0)
    ls = leases(["a", "b"], now=0.0)
    v = view(0, ["a"])
    watch, decision = decide(v, RoundWatch(round=0), ls, "a", 0.0, a)
    assert decision == Wait(until=5.0, reason="round 0: grace for ['b']")
    ls = leases(["a", "b"], now=5.0)
    _, decision = decide(v, watch, ls, "a", 5.0, a)
    assert isinstance(decision, ClaimRound)


def test_rank_is_a_stable_blake2b_of_the_round_and_node() -> None:
    for r, node in ((0, "a"), (1, "n001"), (12345, "x"), (10**19, "host-12")):
        digest = hashlib.blake2b(f"{r}/{node}".encode(), digest_size=8).digest()
        assert rules.rank(r, node) == int.from_bytes(digest, "big")
    assert rules.rank(0, "a") == 13225716355254514689


@given(
    st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=8, unique=True),
    st.integers(0, 10**6),
    st.integers(0, 20),
    st.randoms(use_true_random=False),
)
def test_designated_orders_the_reporters_by_rank_turned_by_the_attempt(
    reporters: list[str],
    r: int,
    attempt: int,
    rng: random.Random,
) -> None:
    ls = leases(reporters)
    ordered = sorted(reporters, key=lambda n: rules.rank(r, n))
    start = attempt % len(ordered)
    expected = tuple(ordered[start:] + ordered[:start])
    shuffled = list(reporters)
    rng.shuffle(shuffled)
    got = rules.designated(shuffled, r, attempt, ls, now=T0, timeout=TIMEOUT)
    assert got == expected
    following = rules.designated(reporters, r, attempt + 1, ls, now=T0, timeout=TIMEOUT)
    assert following == got[1:] + got[:1]
    # A node's place does not depend on who else reported: leaving one out keeps the order.
    for gone in reporters:
        rest = [n for n in reporters if n != gone]
        order = rules.designated(rest, r, 0, leases(rest), now=T0, timeout=TIMEOUT)
        assert order == tuple(n for n in ordered if n != gone)


def test_designated_skips_expired_nodes_and_keeps_left_ones_in_rank_order() -> None:
    """Observers learn of a leave at different LISTs, so whether a reporter has left must not
    change the order: when it put leaving nodes last, nodes that closed at once each saw the
    others still staying and themselves leaving, each waited for another, and every
    ``close()`` waited out ``takeover`` (the simulator, 4 nodes closing together)."""
    live = ["a", "c", "d"]
    order = sorted(live, key=lambda n: rules.rank(7, n))
    for attempt in range(4):
        start = attempt % len(order)
        expected = tuple(order[start:] + order[:start])
        for left in ([], ["a"], ["c", "d"], live):
            ls = leases(live, expired=["b"], left=left)
            got = rules.designated(["a", "b", "c", "d"], 7, attempt, ls, now=T0, timeout=TIMEOUT)
            assert got == expected, (left, got)


def test_designated_ignores_reporters_with_no_lease_and_handles_no_reporters() -> None:
    ls = leases(["a"])
    assert rules.designated(["a", "z"], 3, 0, ls, now=T0, timeout=TIMEOUT) == ("a",)
    assert rules.designated([], 3, 0, ls, now=T0, timeout=TIMEOUT) == ()


def test_consecutive_attempts_designate_different_live_nodes() -> None:
    reporters = ["a", "b", "c"]
    rotation = sorted(reporters, key=lambda n: rules.rank(0, n))
    ls = leases(rotation[1:], expired=rotation[:1])
    firsts = [rules.designated(reporters, 0, a, ls, now=T0, timeout=TIMEOUT)[0] for a in (0, 1)]
    assert firsts == [rotation[1], rotation[2]]


def test_candidate_i_claims_only_after_i_takeover_periods() -> None:
    ls = leases(["a", "b", "c"])
    v = view(0, ["a", "b", "c"])
    candidates = rules.designated(v.reporters, 0, 0, ls, now=T0, timeout=TIMEOUT)
    for i, me in enumerate(candidates):
        watch, decision = decide(v, RoundWatch(round=0), ls, me, T0)
        if i == 0:
            assert isinstance(decision, ClaimRound)
            continue
        assert decision == Wait(
            until=T0 + i * TAKEOVER,
            reason=f"{candidates[0]} closes attempt 0 unless it stays silent",
        )
        t = T0 + i * TAKEOVER
        _, decision = decide(v, watch, leases(["a", "b", "c"], now=t), me, t)
        assert decision == ClaimRound(
            round=0, attempt=0, reason=f"{me} is candidate {i} of attempt 0"
        )


def test_a_node_that_is_not_a_candidate_waits_for_the_view_to_change() -> None:
    ls = leases(["a", "b", "z"])
    _, decision = decide(view(0, ["a", "b"], previous=["a", "b"]), RoundWatch(round=0), ls, "z", T0)
    assert decision == Wait(until=None, reason="z is not a candidate closer of attempt 0")


def test_the_next_attempt_opens_at_once_when_the_claimant_expired() -> None:
    ls = leases(["a", "b", "c"], expired=["x"])
    v = view(0, ["a", "b", "c", "x"], claims=[claim("x")])
    me = first(v, ls, attempt=1)
    watch, decision = decide(v, RoundWatch(round=0), ls, me, T0)
    assert decision == ClaimRound(round=0, attempt=1, reason=f"{me} is candidate 0 of attempt 1")
    assert watch.seen(0) == T0


def test_a_claimant_whose_lease_this_node_has_not_listed_is_taken_over_only_by_the_timer() -> None:
    # No lease of the claimant in this node's view: a view older than the claim (the explorer
    # found a node that read the claims before its next LIST of leases, and took over a live
    # closer at once), not evidence of death. The claim's timer still ends it.
    ls = leases(["a"])
    v = view(0, ["a"], claims=[claim("unlisted")])
    watch, decision = decide(v, RoundWatch(round=0), ls, "a", T0)
    assert isinstance(decision, Wait) and decision.until == T0 + TAKEOVER
    assert watch.expired(0) is None
    deadline = T0 + TAKEOVER
    _, decision = decide(v, watch, leases(["a"], now=deadline), "a", deadline)
    assert isinstance(decision, ClaimRound) and decision.attempt == 1


@pytest.mark.parametrize("attempt", [0, 1, 3])
def test_a_live_silent_claimant_is_taken_over_after_takeover_times_two_to_the_attempt(
    attempt: int,
) -> None:
    ls = leases(["a", "b", "c"])
    claims = [claim(n, attempt=i) for i, n in enumerate(["a", "b", "c", "a"][: attempt + 1])]
    v = view(0, ["a", "b", "c"], claims=claims)
    me = first(v, ls, attempt=attempt + 1)
    deadline = T0 + TAKEOVER * 2**attempt
    watch, decision = decide(v, RoundWatch(round=0), ls, me, T0)
    assert isinstance(decision, Wait) and decision.until == deadline
    assert f"attempt {attempt} of round 0 is {claims[-1].node}'s" == decision.reason
    t = deadline - 0.001
    watch, decision = decide(v, watch, leases(["a", "b", "c"], now=t), me, t)
    assert isinstance(decision, Wait)
    _, decision = decide(v, watch, leases(["a", "b", "c"], now=deadline), me, deadline)
    assert decision == ClaimRound(
        round=0, attempt=attempt + 1, reason=f"{me} is candidate 0 of attempt {attempt + 1}"
    )


def test_the_claim_timer_starts_when_this_node_first_saw_the_claim() -> None:
    ls = leases(["a", "b"])
    v = view(0, ["a", "b"], claims=[claim("a")])
    watch, _ = decide(v, RoundWatch(round=0), ls, "b", T0)
    watch, _ = decide(v, watch, ls, "b", T0 + 50)
    assert watch.claim_seen == ((0, T0),)


def test_a_fallback_candidate_takes_over_when_the_expired_claimants_successor_is_silent() -> None:
    ls = leases(["a", "b", "c"], expired=["x"])
    v = view(0, ["a", "b", "c", "x"], claims=[claim("x")])
    second = rules.designated(v.reporters, 0, 1, ls, now=T0, timeout=TIMEOUT)[1]
    watch = RoundWatch(round=0)
    decision: rules.Decision = Wait(until=None, reason="")
    for t in (T0, T0 + TAKEOVER, T0 + 10 * TAKEOVER):
        # x's lease stopped changing once, at T0 - TIMEOUT; a, b and c keep renewing.
        fresh = leases(["a", "b", "c"], now=t).seen
        stale = leases(expired=["x"], now=T0).seen
        current = Leases(seen=tuple(sorted(fresh + stale)), polled_at=t)
        watch, decision = decide(v, watch, current, second, t)
    assert isinstance(decision, ClaimRound)


def snap(node: str, r: int = 8, base: int = 4, samples: int = 10, steps: int = 12) -> Snapshot:
    return Snapshot(
        node=node,
        nonce=NONCE,
        round=r,
        base_round=base,
        samples=samples,
        steps=steps,
        digest=DIGEST,
    )


def test_include_keeps_matching_snapshots_sorted_and_explains_exclusions() -> None:
    a = DiLoCo(inner_steps=12, fragments=4)
    read = [
        ("c", snap("c")),
        ("a", snap("a", samples=3)),
        ("d", snap("x")),
        ("e", snap("e", r=12, base=8)),
        ("f", snap("f", base=0)),
        ("b", snap("b", steps=24)),
    ]
    chosen, excluded = rules.include(a, 8, read)
    assert [i.node for i in chosen] == ["a", "b", "c"]
    assert chosen[0] == Included.of(snap("a", samples=3))
    assert excluded == [
        ("d", "record names x round 8"),
        ("e", "record names e round 12"),
        ("f", "based on round 0, not 4"),
    ]


def test_a_fragments_first_round_includes_snapshots_based_on_the_manifest() -> None:
    a = DiLoCo(inner_steps=12, fragments=4)
    chosen, excluded = rules.include(a, 2, [("a", snap("a", r=2, base=-1))])
    assert [i.node for i in chosen] == ["a"] and excluded == []
    chosen, excluded = rules.include(a, 6, [("a", snap("a", r=6, base=-1))])
    assert chosen == [] and excluded == [("a", "based on round -1, not 2")]


def included(samples: int, steps: int, node: str = "a") -> Included:
    return Included(
        node=node, nonce=NONCE, samples=samples, steps=steps, base_round=-1, digest=DIGEST
    )


def test_outer_weights_follow_decision_five() -> None:
    a = DiLoCo(inner_steps=100)
    weights = rules.outer_weights(a, [included(30, 100, "a"), included(10, 200, "b")])
    # sum(s_i * H / steps_i) / sum(s): 30*1/40 and 10*0.5/40.
    assert weights == pytest.approx([0.75, 0.125])


@given(
    st.lists(st.tuples(st.integers(1, 10**6), st.integers(1, 10**4)), min_size=1, max_size=8),
    st.integers(1, 1000),
)
def test_outer_weights_are_samples_weighted_and_normalized_to_h_steps(
    parts: list[tuple[int, int]], h: int
) -> None:
    a = DiLoCo(inner_steps=h)
    inc = [included(s, n, f"n{i}") for i, (s, n) in enumerate(parts)]
    weights = rules.outer_weights(a, inc)
    total = sum(s for s, _ in parts)
    for w, (s, n) in zip(weights, parts, strict=True):
        assert math.isclose(w, s * h / n / total)
    # Scaled back by steps_i / H, the weights are a convex combination: no amplification.
    assert math.isclose(sum(w * n / h for w, (_, n) in zip(weights, parts, strict=True)), 1.0)
    if all(n == h for _, n in parts):
        assert math.isclose(sum(weights), 1.0)


def test_outer_weights_refuse_an_empty_commit() -> None:
    with pytest.raises(ValueError, match="at least one snapshot"):
        rules.outer_weights(DiLoCo(), [])


@pytest.mark.parametrize(
    ("k", "committed", "keep", "old"),
    [
        (1, 0, 2, None),
        (1, 1, 2, None),
        (1, 2, 2, 0),
        (1, 9, 2, 7),
        (4, 7, 2, None),
        (4, 8, 2, 0),
        (4, 13, 2, 5),
        (4, 13, 1, 9),
        (3, 20, 3, 11),
    ],
)
def test_collectable_keeps_the_fragments_last_rounds(
    k: int, committed: int, keep: int, old: int | None
) -> None:
    a = DiLoCo(inner_steps=12, fragments=k)
    got = gc.collectable(a, committed, keep=keep)
    assert got == old
    if got is not None:
        assert (committed - got) % k == 0 and got < committed


@pytest.mark.parametrize("keep", [0, -1])
def test_collectable_refuses_to_keep_nothing(keep: int) -> None:
    with pytest.raises(ValueError, match="keep"):
        gc.collectable(DiLoCo(inner_steps=12, fragments=2), 10, keep=keep)


@given(st.integers(1, 8), st.integers(0, 7), st.integers(0, 50))
def test_every_fragment_writes_its_head_at_its_first_commit_and_every_fourth(
    fragments: int, k: int, start: int
) -> None:
    a = DiLoCo(inner_steps=16, fragments=fragments)
    k %= fragments
    assert rules.writes_head(a, k)  # the fragment's first commit
    run = [k + fragments * (start + i) for i in range(rules.HEAD_EVERY)]
    assert sum(rules.writes_head(a, r) for r in run) == 1  # any HEAD_EVERY in a row: one


def test_a_watch_of_another_round_is_refused() -> None:
    ls = leases(["a", "b"])
    with pytest.raises(ValueError, match="round"):
        decide(view(1, ["a"], previous=["a", "b"]), RoundWatch(round=0), ls, "a", T0)


def test_a_first_round_also_expects_peers_its_lease_view_has_not_listed_yet() -> None:
    # b and c trained in earlier rounds (peers) but this observer's last lease LIST predates
    # their joins: the fragment's first round waits for them as for active nodes...
    ls = leases(["a"])
    v = attrs.evolve(view(1, ["a"]), peers=("b", "c"))
    _, decision = decide(v, RoundWatch(round=1), ls, "a", T0, algo(quorum=2))
    assert isinstance(decision, Wait) and "['b', 'c']" in decision.reason
    v = attrs.evolve(view(1, ["a", "b", "c"]), peers=("b", "c"))
    _, decision = decide(v, RoundWatch(round=1), ls, first(v, ls), T0, algo(quorum=5))
    assert isinstance(decision, ClaimRound)


def test_peers_whose_leases_say_they_left_or_expired_are_not_waited_for() -> None:
    ls = leases(["a", "d"], expired=["b"], left=["d"])
    v = attrs.evolve(view(1, ["a"]), peers=("b", "d"))
    _, decision = decide(v, RoundWatch(round=1), ls, "a", T0, algo(quorum=3))
    assert isinstance(decision, ClaimRound)


def test_peers_do_not_matter_once_the_fragment_has_a_previous_round() -> None:
    ls = leases(["a"])
    v = attrs.evolve(view(5, ["a"], previous=["a"]), peers=("b",))
    _, decision = decide(v, RoundWatch(round=5), ls, "a", T0, algo(quorum=3))
    assert isinstance(decision, ClaimRound)


def _listed_close(quorum: int, now: float) -> tuple[rules.RoundState, list[object]]:
    """Round 0 of nodes a and b, closed by a: its view counted b, whose only snapshot key a
    close of a's has refused (a squatter's object under b's name); the close's LIST now shows
    the keys of both."""
    from gradientmail.core import keys
    from gradientmail.core.effects import SnapshotsListed
    from gradientmail.core.fragments import partition
    from gradientmail.core.records import Manifest, PayloadRef
    from gradientmail.core.rules import RULES
    from gradientmail.core.tensors import ParameterSpec, Schema

    schema = Schema.of([ParameterSpec(name="w", dtype="F32", shape=(4,))])
    manifest = Manifest(
        nonce=NONCE,
        creator="a",
        schema=schema,
        algorithm=algo(quorum=quorum, grace=30.0),
        fragments=partition(schema, 1),
        init=(PayloadRef(key=keys.init(0, NONCE), digest=DIGEST, size=16),),
    )
    ctx = rules.Context(
        me="a",
        process=NONCE,
        manifest=manifest,
        leases=leases(["a", "b"], now=now),
        commits={},
        peers=frozenset(),
        members=None,
        lease_timeout=TIMEOUT,
        takeover=TAKEOVER,
        poll_interval=1.0,
        outlier_factor=None,
        rules=RULES,
    )
    state = attrs.evolve(
        rules.RoundState.new(0),
        reporters=("a", "b"),
        refused=frozenset({("b", 0)}),
        watch=RoundWatch(round=0, quorum_since=T0, open_since=T0),
        closing=rules.Closing(attempt=0, nonce=NONCE, started=T0, phase="list"),
    )
    listed = SnapshotsListed(round=0, sizes=(("a", 0, 100), ("b", 0, 100)))
    state, effects, _, _ = rules.step(state, [listed], ctx, now=now)
    return state, list(effects)


def test_a_reporter_with_only_refused_keys_ends_a_close_the_view_would_not_allow() -> None:
    """Without b, round 0 has one reporter of quorum 2: the close ends before reading any
    snapshot, the view drops b, and a takes its own claim up again when it decides."""
    from gradientmail.core.effects import Drop, ReadSnapshot

    state, effects = _listed_close(quorum=2, now=T0 + 1)
    assert state.closing is None and state.retake and state.reporters == ("a",)
    assert any(isinstance(e, Drop) for e in effects)
    assert not any(isinstance(e, ReadSnapshot) for e in effects)


def test_a_reporter_with_only_refused_keys_is_left_out_once_the_grace_ran_out() -> None:
    """With the quorum met without b and its grace over, the close goes on without b: planted
    keys under a node's name delay a round by at most its grace."""
    from gradientmail.core.effects import ReadSnapshot

    state, effects = _listed_close(quorum=1, now=T0 + 31)
    assert state.closing is not None and state.reporters == ("a",)
    assert [e for e in effects if isinstance(e, ReadSnapshot)] == [
        ReadSnapshot(round=0, node="a", slot=0)
    ]
