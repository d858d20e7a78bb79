"""The learner's rules: the staggered schedule, samples and steps reported, the overlap bound,
merging commits (included, missed, older, jumps), deferral, and closing."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gradientmail.core import learner as rules
from gradientmail.core.algorithm import DiLoCo
from gradientmail.core.errors import ProtocolError
from gradientmail.core.learner import Effect, LearnerState, Leave, Merge, Publish, Rebased


def algo(h: int = 12, k: int = 3, overlap: int | None = None, alpha: float | None = None) -> DiLoCo:
    return DiLoCo(inner_steps=h, fragments=k, overlap_steps=overlap, alpha=alpha)


def fresh(a: DiLoCo) -> LearnerState:
    return rules.join(a, (-1,) * a.fragments)


def run(
    state: LearnerState, a: DiLoCo, steps: int, samples: int = 1
) -> tuple[LearnerState, list[tuple[int, Effect]]]:
    """Take ``steps`` steps; every effect with the step count it came at."""
    seen: list[tuple[int, Effect]] = []
    for _ in range(steps):
        state, effects = rules.step(state, a, samples)
        seen += [(state.step, e) for e in effects]
    return state, seen


def publishes(effects: Sequence[Effect]) -> list[Publish]:
    return [e for e in effects if isinstance(e, Publish)]


def test_join_holds_the_given_commits() -> None:
    state = rules.join(algo(), (3, -1, 5))
    assert [f.merged for f in state.fragments] == [3, -1, 5]
    assert all(f.free and f.samples == 0 for f in state.fragments)
    assert (state.step, state.slot, state.deferred, state.closing) == (0, 1, 0, False)


@pytest.mark.parametrize(
    ("merged", "message"),
    [
        ((-1, -1), "one merged round per fragment"),
        ((-1, -1, -1, -1), "one merged round per fragment"),
        ((1, -1, -1), "round 1 is not a round of fragment 0"),
        ((-1, 4, 3), "round 3 is not a round of fragment 2"),
        ((-3, -1, -1), "round -3"),
    ],
)
def test_join_refuses_rounds_of_the_wrong_fragment(merged: tuple[int, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rules.join(algo(), merged)


@given(st.integers(1, 500), st.integers(1, 16), st.integers(0, 100))
def test_slot_j_ends_at_floor_j_h_over_k(h: int, k: int, j: int) -> None:
    if k > h:
        return
    a = DiLoCo(inner_steps=h, fragments=k, overlap_steps=None)
    assert rules.slot_end(a, j) == j * h // k
    assert rules.slot_end(a, j + k) - rules.slot_end(a, j) == h


def test_a_fresh_run_publishes_round_k_for_fragment_k_staggered_by_h_over_k() -> None:
    a = algo(h=12, k=3)
    _, seen = run(fresh(a), a, 12, samples=2)
    assert seen == [
        (4, Publish(fragment=0, round=0, base_round=-1, samples=8, steps=4)),
        (8, Publish(fragment=1, round=1, base_round=-1, samples=16, steps=8)),
        (12, Publish(fragment=2, round=2, base_round=-1, samples=24, steps=12)),
    ]


def test_uneven_slots_end_at_the_floor() -> None:
    a = algo(h=10, k=3)
    _, seen = run(fresh(a), a, 10)
    assert [(at, e.round) for at, e in seen if isinstance(e, Publish)] == [(3, 0), (6, 1), (10, 2)]


@given(
    st.integers(1, 40).flatmap(lambda h: st.tuples(st.just(h), st.integers(1, min(h, 6)))),
    st.lists(st.integers(1, 50), min_size=1, max_size=80),
    st.sampled_from([None, 0.5]),
)
def test_with_prompt_commits_each_fragment_syncs_every_h_steps(
    hk: tuple[int, int], samples: list[int], alpha: float | None
) -> None:
    h, k = hk
    a = DiLoCo(inner_steps=h, fragments=k, overlap_steps=None, alpha=alpha)
    state = fresh(a)
    last = [0] * k
    expected_round = 0
    for count, s in enumerate(samples, start=1):
        state, effects = rules.step(state, a, s)
        for p in publishes(effects):
            assert p.round == expected_round and p.fragment == p.round % k
            assert count == rules.slot_end(a, p.round + 1)
            assert p.base_round == (p.round - k if p.round >= k else -1)
            assert (p.steps, p.samples) == (
                count - last[p.fragment],
                sum(samples[last[p.fragment] : count]),
            )
            last[p.fragment] = count
            expected_round += 1
            state, merged = rules.on_commit(state, a, round=p.round, included=True)
            assert merged == [
                Merge(fragment=p.fragment, round=p.round, since="snapshot", alpha=alpha)
            ]
        assert rules.waiting_on(state, a) is None
    assert expected_round == sum(
        1 for j in range(1, len(samples) + 1) if rules.slot_end(a, j) <= len(samples)
    )


@st.composite
def schedules(draw: st.DrawFn) -> tuple[DiLoCo, list[tuple[str, int, bool]]]:
    h = draw(st.integers(1, 24))
    k = draw(st.integers(1, min(h, 4)))
    overlap = draw(st.none() | st.integers(0, h // k - 1))
    a = DiLoCo(inner_steps=h, fragments=k, overlap_steps=overlap)
    actions = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["step", "step", "deliver", "foreign"]),
                st.integers(0, 30),
                st.booleans(),
            ),
            max_size=80,
        )
    )
    return a, actions


class Ledger:
    """Tracks what a learner published and which commits counted it, to check conservation."""

    def __init__(self, a: DiLoCo) -> None:
        self.a = a
        self.trained = 0
        self.counted = [0] * a.fragments
        self.pending: dict[int, Publish] = {}
        self.order: list[int] = []

    def take(self, state: LearnerState, effects: Sequence[Effect]) -> None:
        for p in publishes(effects):
            f = state.fragments[p.fragment]
            assert p.samples > 0 and p.steps > 0
            assert f.outstanding == p.round and p.round not in self.pending
            assert p.round == rules.next_round(self.a, p.fragment, p.base_round)
            self.pending[p.round] = p
            self.order.append(p.round)

    def commit(self, state: LearnerState, r: int, included: bool) -> LearnerState:
        p = self.pending.pop(r)
        state, effects = rules.on_commit(state, self.a, round=r, included=included)
        assert isinstance(effects[0], Merge) and effects[0].round == r
        if included:
            self.counted[p.fragment] += p.samples
            assert effects[0].since == "snapshot"
        else:
            assert effects[0].since == "base" and effects[0].alpha is None
            assert Rebased(fragment=p.fragment, missed=r, samples=p.samples) in effects
        self.take(state, effects)
        return state

    def check(self, state: LearnerState) -> None:
        for k, f in enumerate(state.fragments):
            in_flight = f.in_flight_samples if f.outstanding is not None else 0
            assert self.trained == self.counted[k] + in_flight + f.samples


@given(schedules())
def test_samples_are_each_counted_once_whatever_the_commits_do(
    case: tuple[DiLoCo, list[tuple[str, int, bool]]],
) -> None:
    a, actions = case
    state, ledger = fresh(a), Ledger(a)
    for action, value, flag in actions:
        if action == "step" and rules.waiting_on(state, a) is None:
            state, effects = rules.step(state, a, value)
            ledger.trained += value
            ledger.take(state, effects)
        elif action == "deliver" and ledger.pending:
            r = sorted(ledger.pending)[value % len(ledger.pending)]
            state = ledger.commit(state, r, flag)
        elif action == "foreign":
            # A commit this node did not report to, for a fragment with nothing in flight.
            k = value % a.fragments
            f = state.fragments[k]
            if f.free:
                r = rules.next_round(a, k, f.merged)
                state, effects = rules.on_commit(state, a, round=r, included=flag)
                assert effects[0] == Merge(fragment=k, round=r, since="base", alpha=None)
                ledger.take(state, effects)
        ledger.check(state)
    state, effects = rules.close(state, a)
    ledger.take(state, effects)
    while ledger.pending:
        state = ledger.commit(state, min(ledger.pending), True)
    assert rules.done(state)
    assert ledger.counted == [ledger.trained] * a.fragments


def played(
    ledger: Ledger, actions: Sequence[tuple[str, int, bool]], *, in_order: bool
) -> Iterator[LearnerState]:
    """The learner after each action, kept in ``ledger``: a step of ``value + 1`` samples (none
    while held), or the delivery of a pending commit: the oldest, counted, with ``in_order``;
    else the ``value``-th, counted as ``flag`` says."""
    a = ledger.a
    state = fresh(a)
    for action, value, flag in actions:
        if action == "step" and rules.waiting_on(state, a) is None:
            state, effects = rules.step(state, a, value + 1)
            ledger.take(state, effects)
        elif action == "deliver" and ledger.pending:
            pending = sorted(ledger.pending)
            r, counted = (pending[0], True) if in_order else (pending[value % len(pending)], flag)
            state = ledger.commit(state, r, counted)
        yield state


@given(schedules())
def test_with_commits_in_round_order_rounds_are_published_in_increasing_order(
    case: tuple[DiLoCo, list[tuple[str, int, bool]]],
) -> None:
    a, actions = case
    ledger = Ledger(a)
    for state in played(ledger, actions, in_order=True):
        # In round order no owed round lacks samples: a held node never steps past the bound.
        holding = rules._holding(state, a)
        assert not holding or rules.waiting_on(state, a) is not None
    assert ledger.order == sorted(ledger.order)
    assert len(set(ledger.order)) == len(ledger.order)


@st.composite
def bounded_schedules(draw: st.DrawFn) -> tuple[DiLoCo, list[tuple[str, int, bool]]]:
    """Short slots with an overlap bound, several fragments, and commits in any order."""
    k = draw(st.integers(2, 3))
    h = k * draw(st.integers(1, 3))
    a = DiLoCo(inner_steps=h, fragments=k, overlap_steps=draw(st.integers(0, h // k - 1)))
    actions = draw(
        st.lists(
            st.tuples(st.sampled_from(["step", "deliver"]), st.integers(0, 3), st.booleans()),
            max_size=40,
        )
    )
    return a, actions


_STEP, _MISS, _COUNT = ("step", 0, False), ("deliver", 0, False), ("deliver", 0, True)


@settings(max_examples=400)
@given(bounded_schedules())
@example(  # the sequence of the test above (simulator seed 140)
    (
        algo(h=4, k=2, overlap=0),
        [
            *(_STEP, _STEP, _MISS, _STEP, _STEP, _MISS, _STEP, ("deliver", 1, False), _STEP),
            *(_MISS, _COUNT, _COUNT),
        ],
    )
)
def test_a_held_node_owes_no_round_below_the_rounds_holding_it(
    case: tuple[DiLoCo, list[tuple[str, int, bool]]],
) -> None:
    # The liveness argument of docs/protocol.md ("Held"): whatever the order of commits and
    # whether they count the node, a node that step() holds has published every round it owes
    # below the newest round holding it, so no round waits for a node that waits for it.
    a, actions = case
    for state in played(Ledger(a), actions, in_order=False):
        if rules.waiting_on(state, a) is not None:
            newest = max(r for _, r, _ in rules._holding(state, a))
            owed = [
                rules.next_round(a, k, f.merged)
                for k, f in enumerate(state.fragments)
                if f.free and rules.next_round(a, k, f.merged) < newest
            ]
            assert owed == [], f"held by round {newest}, owes rounds {owed}"


def test_zero_sample_steps_publish_nothing_and_count_their_steps() -> None:
    a = algo(h=4, k=1)
    state, seen = run(fresh(a), a, 4, samples=0)
    assert seen == [] and state.deferred == 0
    state, seen = run(state, a, 3, samples=1)
    assert seen == []
    state, seen = run(state, a, 1, samples=1)
    assert seen == [(8, Publish(fragment=0, round=0, base_round=-1, samples=4, steps=8))]


def test_a_fragment_with_zero_samples_is_skipped_in_favour_of_one_with_samples() -> None:
    a = algo(h=4, k=2)
    state, seen = run(fresh(a), a, 2, samples=0)
    assert seen == []
    state, seen = run(state, a, 2, samples=5)
    assert publishes([e for _, e in seen]) == [
        Publish(fragment=0, round=0, base_round=-1, samples=10, steps=4)
    ]


def test_close_publishes_nothing_for_a_fragment_with_no_samples() -> None:
    a = algo(h=4, k=2)
    state, _ = run(fresh(a), a, 3, samples=0)
    state, effects = rules.close(state, a)
    assert effects == [Leave(after=())] and rules.done(state)


def test_overlap_zero_blocks_right_after_publishing() -> None:
    a = algo(h=4, k=1, overlap=0)
    state, _ = run(fresh(a), a, 3)
    assert rules.waiting_on(state, a) is None
    state, _ = run(state, a, 1)
    blocked = rules.waiting_on(state, a)
    assert blocked is not None and (blocked.fragment, blocked.round) == (0, 0)
    assert "overlap_steps=0" in blocked.reason and "round 0" in blocked.reason
    state, _ = rules.on_commit(state, a, round=0, included=True)
    assert rules.waiting_on(state, a) is None


def test_overlap_one_allows_exactly_one_more_step() -> None:
    a = algo(h=8, k=2, overlap=1)
    state, _ = run(fresh(a), a, 4)
    assert state.fragments[0].outstanding == 0 and rules.waiting_on(state, a) is None
    state, _ = run(state, a, 1)
    blocked = rules.waiting_on(state, a)
    assert blocked is not None and blocked.round == 0


def test_unbounded_overlap_never_blocks() -> None:
    a = algo(h=4, k=2, overlap=None)
    state, seen = run(fresh(a), a, 40)
    assert [p.round for p in publishes([e for _, e in seen])] == [0, 1]
    assert rules.waiting_on(state, a) is None


def test_included_commit_merges_since_the_snapshot_with_alpha() -> None:
    a = algo(h=4, k=2, alpha=0.5)
    state, _ = run(fresh(a), a, 3)
    state, effects = rules.on_commit(state, a, round=0, included=True)
    assert effects == [Merge(fragment=0, round=0, since="snapshot", alpha=0.5)]
    f = state.fragments[0]
    assert (f.merged, f.outstanding, f.in_flight_samples, f.samples) == (0, None, 0, 1)


def test_a_commit_the_node_did_not_report_to_merges_since_the_base_without_alpha() -> None:
    a = algo(h=4, k=2, alpha=0.5)
    state, _ = run(fresh(a), a, 1)
    state, effects = rules.on_commit(state, a, round=1, included=False)
    assert effects == [Merge(fragment=1, round=1, since="base", alpha=None)]
    assert state.fragments[1].merged == 1 and state.fragments[1].samples == 1


def test_a_missed_round_rebases_and_publishes_into_the_next_round_at_once() -> None:
    a = algo(h=4, k=2, overlap=0, alpha=0.5)
    state, _ = run(fresh(a), a, 2, samples=3)
    blocked = rules.waiting_on(state, a)
    assert blocked is not None and blocked.round == 0
    state, effects = rules.on_commit(state, a, round=0, included=False)
    assert effects == [
        Merge(fragment=0, round=0, since="base", alpha=None),
        Rebased(fragment=0, missed=0, samples=6),
        Publish(fragment=0, round=2, base_round=0, samples=6, steps=2),
    ]
    f = state.fragments[0]
    assert (f.outstanding, f.published_at, f.in_flight_samples, f.samples) == (2, None, 6, 0)
    assert rules.waiting_on(state, a) is None


def test_a_missed_round_carries_samples_trained_after_the_snapshot() -> None:
    a = algo(h=4, k=2, overlap=None)
    state, _ = run(fresh(a), a, 3, samples=2)
    state, effects = rules.on_commit(state, a, round=0, included=False)
    assert effects[-1] == Publish(fragment=0, round=2, base_round=0, samples=6, steps=3)


def test_a_repeated_commit_is_ignored_whatever_its_flag() -> None:
    a = algo(h=4, k=2)
    state, _ = run(fresh(a), a, 2)
    state, first = rules.on_commit(state, a, round=0, included=True)
    assert first == [Merge(fragment=0, round=0, since="snapshot", alpha=None)]
    again, repeat = rules.on_commit(state, a, round=0, included=False)
    assert repeat == [] and again == state


@pytest.mark.parametrize("included", [True, False])
def test_older_and_duplicate_commits_change_nothing(included: bool) -> None:
    a = algo(h=4, k=2)
    state = rules.join(a, (4, 3))
    state, _ = run(state, a, 2)
    for r in (-1, 0, 2, 4):
        assert rules.on_commit(state, a, round=r, included=included) == (state, [])


def test_a_jump_to_a_newer_commit_merges_since_the_base() -> None:
    a = algo(h=4, k=2)
    state, _ = run(fresh(a), a, 1)
    state, effects = rules.on_commit(state, a, round=6, included=False)
    assert effects == [Merge(fragment=0, round=6, since="base", alpha=None)]
    assert state.fragments[0].merged == 6 and state.fragments[0].samples == 1
    state, seen = run(state, a, 3)
    assert publishes([e for _, e in seen]) == [
        Publish(fragment=1, round=1, base_round=-1, samples=2, steps=2),
        Publish(fragment=0, round=8, base_round=6, samples=4, steps=4),
    ]


def test_a_commit_skipping_the_outstanding_round_uses_what_the_skipped_commits_counted() -> None:
    a = algo(h=4, k=2)
    state, _ = run(fresh(a), a, 2)
    assert state.fragments[0].outstanding == 0
    # The skipped commit of round 0 counted the snapshot: progress since it is kept.
    counted, effects = rules.on_commit(state, a, round=2, included=True)
    assert effects == [Merge(fragment=0, round=2, since="snapshot", alpha=None)]
    assert counted.fragments[0].samples == 0 and counted.fragments[0].free
    # It did not: the snapshot's samples are rebased and published at once, never twice.
    _, effects = rules.on_commit(state, a, round=2, included=False)
    assert effects[0] == Merge(fragment=0, round=2, since="base", alpha=None)
    assert publishes(effects) == [Publish(fragment=0, round=4, base_round=2, samples=2, steps=2)]


def test_slots_with_no_free_fragment_are_deferred_until_a_merge() -> None:
    a = algo(h=4, k=2, overlap=None)
    state, seen = run(fresh(a), a, 8)
    assert [(at, e.round) for at, e in seen if isinstance(e, Publish)] == [(2, 0), (4, 1)]
    assert len(seen) == 2
    assert state.deferred == 2
    state, _ = run(state, a, 8)
    assert state.deferred == 2, "at most one deferred slot per fragment"
    state, effects = rules.on_commit(state, a, round=0, included=True)
    assert effects == [
        Merge(fragment=0, round=0, since="snapshot", alpha=None),
        Publish(fragment=0, round=2, base_round=0, samples=14, steps=14),
    ]
    assert state.deferred == 1
    state, effects = rules.on_commit(state, a, round=1, included=True)
    assert publishes(effects) == [Publish(fragment=1, round=3, base_round=1, samples=12, steps=12)]
    assert state.deferred == 0


def test_a_deferred_publish_is_bounded_from_the_step_it_is_taken() -> None:
    a = algo(h=4, k=1, overlap=0)
    state, _ = run(fresh(a), a, 4)
    state, effects = rules.on_commit(state, a, round=0, included=False)
    assert publishes(effects)[0].round == 1 and rules.waiting_on(state, a) is None
    state, seen = run(state, a, 5)
    assert seen == [] and state.deferred == 1
    state, effects = rules.on_commit(state, a, round=1, included=True)
    assert publishes(effects) == [Publish(fragment=0, round=2, base_round=1, samples=5, steps=5)]
    assert state.fragments[0].published_at == 9
    blocked = rules.waiting_on(state, a)
    assert blocked is not None and blocked.round == 2


def test_a_node_held_at_the_bound_publishes_the_rounds_it_owes_before_the_holding_one() -> None:
    # Fragment 1 is rebased into round 3 (unbounded) while fragment 0 is at commit 4, so the
    # next slot publishes round 6 first. Held by 6, the node must publish round 5 as soon as
    # commit 3 frees fragment 1: another node held by round 5 may be what round 6 waits for
    # (the simulator's seed 107 stalled for good on exactly that).
    a = algo(h=4, k=2, overlap=1)
    state, seen = run(rules.join(a, (4, -1)), a, 2)
    assert [e.round for _, e in seen if isinstance(e, Publish)] == [1]
    state, effects = rules.on_commit(state, a, round=1, included=False)
    assert [p.round for p in publishes(effects)] == [3]
    state, seen = run(state, a, 3)
    assert [e.round for _, e in seen if isinstance(e, Publish)] == [6]
    blocked = rules.waiting_on(state, a)
    assert blocked is not None and blocked.round == 6
    state, effects = rules.on_commit(state, a, round=3, included=True)
    assert publishes(effects) == [Publish(fragment=1, round=5, base_round=3, samples=3, steps=3)]
    assert state.fragments[1].published_at == 5
    blocked = rules.waiting_on(state, a)
    assert blocked is not None and blocked.round == 6


def test_a_held_node_that_owes_a_round_it_has_not_trained_for_takes_one_step() -> None:
    # Missed rounds and commits out of round order leave fragment 0 at commit 4 with no step
    # since its snapshot, while the slot after commit 5 publishes round 7, bounded. Held by 7,
    # the node owes round 6 but has no samples for it (Decision 6); held, it would never get
    # any, and round 6 would wait for it (the simulator's seed 140 stalled so with a quorum of
    # every node). It takes one step, which publishes round 6, and is held again.
    a = algo(h=4, k=2, overlap=0)
    state = fresh(a)
    for action in ("step", "step", 0, "step", "step", 1, "step", 3, "step", 2):
        if action == "step":
            state, _ = rules.step(state, a, 1)
        else:
            state, _ = rules.on_commit(state, a, round=int(action), included=False)
    state, _ = rules.on_commit(state, a, round=4, included=True)
    state, effects = rules.on_commit(state, a, round=5, included=True)
    assert publishes(effects) == [Publish(fragment=1, round=7, base_round=5, samples=1, steps=1)]
    f = state.fragments[0]
    assert (f.merged, f.free, f.steps, state.fragments[1].published_at) == (4, True, 0, 6)
    assert rules.waiting_on(state, a) is None, "owes round 6 and has nothing to publish to it"
    state, effects = rules.step(state, a, 5)
    assert publishes(effects) == [Publish(fragment=0, round=6, base_round=4, samples=5, steps=1)]
    blocked = rules.waiting_on(state, a)
    assert blocked is not None and blocked.round == 6


def test_a_held_node_publishes_nothing_owed_after_the_holding_round() -> None:
    a = algo(h=4, k=2, overlap=1)
    state, _ = run(fresh(a), a, 3)
    blocked = rules.waiting_on(state, a)
    assert blocked is not None and blocked.round == 0
    assert state.fragments[1].free and state.fragments[1].samples == 3
    state, effects = rules.on_commit(state, a, round=1, included=False)
    assert publishes(effects) == [], "round 3 comes after round 0: it waits for its slot"


def test_close_publishes_free_fragments_and_waits_for_those_in_flight() -> None:
    """Decision 11: ``Leave`` comes once, when the last of the node's training is published
    (here at the merge after which the fragment in flight publishes what it trained since its
    snapshot), naming the rounds of its snapshots in flight."""
    a = algo(h=4, k=2, overlap=None)
    state, _ = run(fresh(a), a, 3)
    state, effects = rules.close(state, a)
    assert effects == [Publish(fragment=1, round=1, base_round=-1, samples=3, steps=3)]
    assert state.closing and not rules.done(state)
    assert rules.waiting_on(state, a) is None
    state, effects = rules.on_commit(state, a, round=0, included=True)
    assert effects == [
        Merge(fragment=0, round=0, since="snapshot", alpha=None),
        Publish(fragment=0, round=2, base_round=0, samples=1, steps=1),
        Leave(after=(1, 2)),
    ]
    state, effects = rules.on_commit(state, a, round=1, included=True)
    assert effects == [Merge(fragment=1, round=1, since="snapshot", alpha=None)]
    assert not rules.done(state)
    state, effects = rules.on_commit(state, a, round=2, included=True)
    assert effects == [Merge(fragment=0, round=2, since="snapshot", alpha=None)]
    assert rules.done(state)


def test_a_missed_round_while_closing_republishes_everything() -> None:
    a = algo(h=4, k=1, overlap=None)
    state, _ = run(fresh(a), a, 5)
    state, effects = rules.close(state, a)
    assert effects == []
    state, effects = rules.on_commit(state, a, round=0, included=False)
    assert effects[1:] == [
        Rebased(fragment=0, missed=0, samples=4),
        Publish(fragment=0, round=1, base_round=0, samples=5, steps=5),
        Leave(after=(1,)),
    ]
    assert not rules.done(state)
    state, _ = rules.on_commit(state, a, round=1, included=True)
    assert rules.done(state)


def test_a_round_missed_after_the_leave_names_the_round_that_replaces_it() -> None:
    """Its progress goes into the next round (Decision 5), and the lease waits for that
    snapshot instead of the missed one (Decision 11)."""
    a = algo(h=4, k=1, overlap=None)
    state, _ = run(fresh(a), a, 4)
    state, effects = rules.close(state, a)
    assert effects == [Leave(after=(0,))]
    state, effects = rules.on_commit(state, a, round=0, included=False)
    assert effects[1:] == [
        Rebased(fragment=0, missed=0, samples=4),
        Publish(fragment=0, round=1, base_round=0, samples=4, steps=4),
        Leave(after=(1,), replaces=(0,)),
    ]
    state, effects = rules.on_commit(state, a, round=1, included=True)
    assert effects == [Merge(fragment=0, round=1, since="snapshot", alpha=None)]
    assert rules.done(state)


def test_close_with_nothing_trained_is_done_at_once_and_idempotent() -> None:
    a = algo()
    state, effects = rules.close(fresh(a), a)
    assert effects == [Leave(after=())] and rules.done(state)
    again, effects = rules.close(state, a)
    assert effects == [] and again == state


def test_a_learner_not_closing_is_never_done() -> None:
    assert not rules.done(fresh(algo()))


def test_step_after_close_is_a_protocol_error() -> None:
    a = algo()
    state, _ = rules.close(fresh(a), a)
    with pytest.raises(ProtocolError, match=r"step\(\) after close\(\)"):
        rules.step(state, a, 1)


@pytest.mark.parametrize("samples", [-1, -1000])
def test_negative_samples_are_refused(samples: int) -> None:
    a = algo()
    with pytest.raises(
        ValueError, match=f"samples must be an integer >= 0 \\(tokens\\), got {samples}"
    ):
        rules.step(fresh(a), a, samples)


@pytest.mark.parametrize("samples", [1.5, True])
def test_non_integer_samples_are_refused_at_once(samples: Any) -> None:
    a = algo()
    with pytest.raises((TypeError, ValueError), match="samples"):
        rules.step(fresh(a), a, samples)


@given(schedules())
def test_the_forecast_names_the_step_and_fragment_a_slot_publishes_unless_a_merge_comes_first(
    case: tuple[DiLoCo, list[tuple[str, int, bool]]],
) -> None:
    a, actions = case
    state, ledger = fresh(a), Ledger(a)
    for action, value, flag in actions:
        if action == "step" and rules.waiting_on(state, a) is None:
            forecast = rules.next_publish(state, a)
            state, effects = rules.step(state, a, value + 1)
            ledger.take(state, effects)
            if forecast is not None:
                at, k = forecast
                assert at > state.step - 1
                if at == state.step:
                    # The slot's publication comes first; owed ones (held) after it.
                    assert publishes(effects)[0].fragment == k
        elif action == "deliver" and ledger.pending:
            pending = sorted(ledger.pending)
            state = ledger.commit(state, pending[value % len(pending)], flag)
    if all(f.free for f in state.fragments):
        assert rules.next_publish(state, a) is not None
    state, _ = rules.close(state, a)
    assert rules.next_publish(state, a) is None


def test_the_forecast_of_a_fresh_run_is_fragment_0_at_the_first_slot() -> None:
    a = algo(h=12, k=3)
    state = fresh(a)
    assert rules.next_publish(state, a) == (4, 0)
    state, seen = run(state, a, 4)
    assert [(at, p.fragment) for at, p in seen] == [(4, 0)]
    assert rules.next_publish(state, a) == (8, 1)
    state, _ = run(state, a, 4)
    state, _ = run(state, a, 4)
    # Every fragment in flight: the next slot waits for a merge, so nothing can be told.
    assert rules.next_publish(state, a) is None
