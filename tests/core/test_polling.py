"""How often the learner loop GETs a fragment's next commit (``polling.step``, Decision 8):
once per poll interval while this node has a snapshot in the round, and, while the training
thread waits for that commit (``Hurry``), at once and then ``HURRY_POLLS`` times per interval
until it is delivered."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from gradientmail.core import keys, polling
from gradientmail.core.algorithm import DiLoCo
from gradientmail.core.effects import (
    CommitRead,
    Deliver,
    Hurry,
    ParamsRead,
    PollCommit,
    ReadParams,
    Result,
)
from gradientmail.core.fragments import partition
from gradientmail.core.records import Commit, Included, Manifest, PayloadRef
from gradientmail.core.tensors import ParameterSpec, Schema

NONCE = "0123456789abcdef"
SCHEMA = Schema.of([ParameterSpec(name="w", dtype="F32", shape=(4,))])
MANIFEST = Manifest(
    nonce=NONCE,
    creator="node-a",
    schema=SCHEMA,
    algorithm=DiLoCo(inner_steps=10, fragments=1),
    fragments=partition(SCHEMA, 1),
    init=(PayloadRef(key=keys.init(0, NONCE), digest="cd" * 32, size=16),),
)
SETTINGS = polling.Settings(node="node-a", manifest=MANIFEST, poll_interval=1.0)


def commit(r: int) -> Commit:
    return Commit(
        round=r,
        fragment=0,
        base_round=r - 1,
        closer="node-b",
        attempt=0,
        nonce=NONCE,
        included=(
            Included(
                node="node-a", nonce=NONCE, samples=1, steps=10, base_round=r - 1, digest="cd" * 32
            ),
        ),
        params=PayloadRef(key=keys.params(r, NONCE), digest="cd" * 32, size=16),
        state=PayloadRef(key=keys.state(r, NONCE), digest="cd" * 32, size=16),
    )


def polls(
    state: polling.PollState, start: float, until: float, messages: Sequence[Result] = ()
) -> tuple[polling.PollState, list[float]]:
    """Step the loop every 0.05 s from ``start`` to ``until`` (``messages`` at the first step),
    each commit GET answered "absent": the times it polled."""
    polled: list[float] = []
    view: list[Result] = list(messages)
    t = start
    while t <= until + 1e-9:
        state, effects, _ = polling.step(view, state, now=round(t, 2), settings=SETTINGS)
        view = []
        for effect in effects:
            if isinstance(effect, PollCommit):
                polled.append(round(t, 2))
                view.append(CommitRead(round=effect.round, commit=None))
        t += 0.05
    return state, polled


def test_a_commit_the_training_waits_for_is_polled_at_once_then_four_times_an_interval() -> None:
    published = attrs.evolve(polling.start(MANIFEST, [-1]), published=(0,), due=(0.0,))
    state, polled = polls(published, 0.0, 2.3)
    assert polled == [0.0, 1.0, 2.0]  # its snapshot is in the round: once per interval
    state, polled = polls(state, 2.35, 3.0, [Hurry(round=0)])
    assert polled == [2.35, 2.6, 2.85]
    assert state.hurried == (0,)
    # The commit comes: read, delivered, and the next round is polled as before.
    state, effects, _ = polling.step(
        [CommitRead(round=0, commit=commit(0))], state, now=3.05, settings=SETTINGS
    )
    assert ReadParams(fragment=0, commit=commit(0)) in effects
    state, effects, _ = polling.step(
        [ParamsRead(fragment=0, commit=commit(0), present=True)], state, now=3.1, settings=SETTINGS
    )
    assert any(isinstance(e, Deliver) for e in effects)
    assert state.hurried == () and state.next == (1,)
    # Found in the store: the next commit is read at once; this node has no snapshot in round 1
    # yet, so it is polled only every IDLE_POLLS intervals after that, hurried no more.
    assert PollCommit(round=1) in effects
    _, polled = polls(state, 3.15, 3.1 + polling.IDLE_POLLS - 0.1)
    assert polled == []


def test_a_hurry_for_a_delivered_round_changes_nothing() -> None:
    state = attrs.evolve(polling.start(MANIFEST, [0]), published=(1,), due=(0.5,))
    assert state.next == (1,)
    after, effects, _ = polling.step([Hurry(round=0)], state, now=0.0, settings=SETTINGS)
    assert after == state and not any(isinstance(e, PollCommit) for e in effects)
