"""The learner's rules: when a node publishes, what it reports, when ``step`` blocks, and how a
commit is merged. Pure transitions ``(state, input) -> (state, effects)``; the shell applies the
effects on the training thread (``Merge``, ``Publish``: both touch the model) and in the
communication loop (uploading what ``Publish`` captured).

Schedule. A node publishes one round every ``H/K`` of its own steps (a *slot*; slot ``j`` ends at
step ``floor(j*H/K)``), choosing the smallest round it may publish: for each fragment with no
snapshot in flight, the round after its newest merged commit (``merged + K``). Rounds are numbered
for the whole run and round ``r`` syncs fragment ``r mod K``, so on a fresh run fragment ``k``
syncs at steps ``(k+1)H/K + jH``: every H steps, staggered by H/K (Streaming DiLoCo). Publishing
in round order, never by per-fragment local clocks, is what keeps nodes that joined at different
times from waiting on each other in a cycle (see docs/protocol.md).

A fragment publishes nothing while its previous snapshot is in flight (Decision 5): a slot with
no free fragment is deferred and taken as soon as a merge frees one. A fragment with no samples
publishes nothing (Decision 6).

Held. A node held at the overlap bound by round ``R`` publishes at once every free fragment
whose next round is below ``R``: those rounds are owed before ``R`` in round order, and another
node held by one of them may be what ``R`` waits for. A fragment that was in flight when its
slot came lets the node publish a later round first; without this rule two nodes in opposite
phases could each hold the round the other needs (docs/protocol.md, "Held"). An owed fragment
that has not trained since its last snapshot has nothing to publish, so it does not hold the
node: one more step, and that round is published.
"""

from __future__ import annotations

import attrs

from gradientmail.core.algorithm import DiLoCo
from gradientmail.core.effects import Leave, Merge, Publish, Rebased
from gradientmail.core.errors import ProtocolError
from gradientmail.core.identity import derived

__all__ = [
    "Blocked",
    "FragmentState",
    "LearnerState",
    "Leave",
    "Merge",
    "Publish",
    "Rebased",
    "close",
    "counted",
    "done",
    "join",
    "next_publish",
    "on_commit",
    "step",
    "waiting_on",
]


@attrs.frozen(kw_only=True)
class FragmentState:
    """One fragment as a learner sees it.

    ``merged`` is the newest commit round the model holds (-1: the initial parameters).
    ``outstanding`` is the round of the snapshot in flight, with its ``nonce``, the samples and
    steps it reported (``in_flight_*``) and the step it was taken at (``published_at``; None
    when the overlap bound does not apply to it). ``samples`` and ``steps`` count training
    since the last snapshot.
    """

    merged: int = -1
    outstanding: int | None = None
    nonce: str | None = None
    published_at: int | None = None
    in_flight_samples: int = 0
    in_flight_steps: int = 0
    samples: int = 0
    steps: int = 0

    @property
    def free(self) -> bool:
        return self.outstanding is None

    def trained(self, samples: int) -> FragmentState:
        """This fragment after one more inner step of ``samples`` tokens (``attrs.evolve``
        spelled out: it runs for every fragment at every step, on the training thread)."""
        return FragmentState(
            merged=self.merged,
            outstanding=self.outstanding,
            nonce=self.nonce,
            published_at=self.published_at,
            in_flight_samples=self.in_flight_samples,
            in_flight_steps=self.in_flight_steps,
            samples=self.samples + samples,
            steps=self.steps + 1,
        )


@attrs.frozen(kw_only=True)
class LearnerState:
    """A learner's training side: each fragment's state, the steps taken, the next slot, the
    slots deferred until a fragment is free, whether it is closing (and has told the syncer to
    leave: ``leaving``), and its ``process`` nonce (which marks every snapshot it publishes:
    ``identity.derived``)."""

    fragments: tuple[FragmentState, ...]
    step: int = 0
    slot: int = 1
    deferred: int = 0
    closing: bool = False
    leaving: bool = False
    process: str = ""


@attrs.frozen(kw_only=True)
class Blocked:
    """``step`` must wait for the commit of ``round`` (the overlap bound)."""

    fragment: int
    round: int
    reason: str


Effect = Publish | Merge | Rebased | Leave


def join(algorithm: DiLoCo, merged: tuple[int, ...], *, process: str = "") -> LearnerState:
    """The state of a node (process nonce ``process``) that holds commit ``merged[k]`` of
    every fragment ``k``."""
    if len(merged) != algorithm.fragments:
        raise ValueError(f"join needs one merged round per fragment, got {len(merged)}")
    for k, r in enumerate(merged):
        if r != -1 and (r < 0 or r % algorithm.fragments != k):
            raise ValueError(f"round {r} is not a round of fragment {k}")
    return LearnerState(fragments=tuple(FragmentState(merged=r) for r in merged), process=process)


def slot_end(algorithm: DiLoCo, slot: int) -> int:
    """The step at which slot ``slot`` (1-based) ends: floor(slot * H / K)."""
    return slot * algorithm.inner_steps // algorithm.fragments


def step(state: LearnerState, algorithm: DiLoCo, samples: int) -> tuple[LearnerState, list[Effect]]:
    """One inner step of ``samples`` tokens has been taken."""
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 0:
        raise ValueError(f"samples must be an integer >= 0 (tokens), got {samples!r}")
    if state.closing:
        raise ProtocolError("step() after close()")
    state = LearnerState(
        fragments=tuple(f.trained(samples) for f in state.fragments),
        step=state.step + 1,
        slot=state.slot,
        deferred=state.deferred,
        closing=state.closing,
        leaving=state.leaving,
        process=state.process,
    )
    effects: list[Effect] = []
    while state.step >= slot_end(algorithm, state.slot):
        # A slot that finds no free fragment waits for a merge; at most one per fragment.
        deferred = min(state.deferred + 1, algorithm.fragments)
        state = attrs.evolve(state, slot=state.slot + 1, deferred=deferred)
    return _settle(state, algorithm, effects)


def next_publish(state: LearnerState, algorithm: DiLoCo) -> tuple[int, int] | None:
    """A forecast: ``(step, fragment)`` of the next slot's publication if no commit is merged
    before it, or None when it cannot be told (closing, a slot deferred until a merge frees a
    fragment, no fragment free). ``step`` is the step count at which ``step`` publishes it;
    the fragment is the free one with the smallest next round, as ``_take_deferred`` picks.
    Nothing depends on it being right: the shell uses it to prepare a capture's memory."""
    if state.closing or state.deferred > 0:
        return None
    candidates = [
        (next_round(algorithm, k, f.merged), k) for k, f in enumerate(state.fragments) if f.free
    ]
    if not candidates:
        return None
    return slot_end(algorithm, state.slot), min(candidates)[1]


def waiting_on(state: LearnerState, algorithm: DiLoCo) -> Blocked | None:
    """Why ``step`` must not return yet, or None: a snapshot taken ``overlap_steps`` or more
    steps ago whose commit has not been merged, unless the node owes a round below it that it
    has not trained for yet (``_owes_untrained``: one more step lets it publish that round)."""
    holding = _holding(state, algorithm)
    newest = _newest(holding)
    if newest is not None and _owes_untrained(state, algorithm, newest):
        return None
    for k, r, at in holding:
        return Blocked(
            fragment=k,
            round=r,
            reason=(
                f"round {r} published at step {at} is not committed and "
                f"overlap_steps={algorithm.overlap_steps}"
            ),
        )
    return None


def _owes_untrained(state: LearnerState, algorithm: DiLoCo, newest: int) -> bool:
    """Whether a free fragment whose next round is below ``newest`` (a round holding the node)
    has taken no step since its last snapshot. Such a round is owed before ``newest`` (the
    "Held" rule publishes it), but with no samples there is nothing to publish (Decision 6),
    and while held the node never gets any: the round would wait for it, and ``newest`` may
    wait for a node held by that round. One step gives the fragment samples, and ``step``
    publishes the owed round at once (bounded from that step, so the node is held again).
    With commits merged in round order this never happens: rounds are then published in
    increasing order, so a fragment's next round is above every round in flight."""
    return any(
        f.free and f.steps == 0 and next_round(algorithm, k, f.merged) < newest
        for k, f in enumerate(state.fragments)
    )


def _holding(state: LearnerState, algorithm: DiLoCo) -> list[tuple[int, int, int]]:
    """``(fragment, round, step published at)`` of each snapshot in flight that holds ``step``
    at the overlap bound, in fragment order: taken at a slot ``overlap_steps`` or more steps
    ago and not merged."""
    bound = algorithm.overlap_steps
    if bound is None:
        return []
    return [
        (k, f.outstanding, f.published_at)
        for k, f in enumerate(state.fragments)
        if f.outstanding is not None
        and f.published_at is not None
        and state.step - f.published_at >= bound
    ]


def _newest(holding: list[tuple[int, int, int]]) -> int | None:
    """The newest round among ``_holding``'s, or None when none holds the node."""
    return max((r for _, r, _ in holding), default=None)


def on_commit(
    state: LearnerState, algorithm: DiLoCo, *, round: int, included: bool
) -> tuple[LearnerState, list[Effect]]:
    """The commit of ``round`` is ready to merge. ``included`` says whether this node's
    snapshot in flight was counted by it, or by a commit between it and this one that the node
    skipped (it jumped ahead because older parameters were collected). Older or already merged
    commits change nothing."""
    k = round % algorithm.fragments
    f = state.fragments[k]
    if round <= f.merged:
        return state, []
    mine = f.outstanding is not None and f.outstanding <= round and included
    effects: list[Effect] = [
        Merge(
            fragment=k,
            round=round,
            since="snapshot" if mine else "base",
            # A closing node trains no more: a plain merge leaves it holding the commit itself.
            alpha=algorithm.alpha if mine and not state.closing else None,
        )
    ]
    missed = f.outstanding is not None and not mine
    outstanding = f.outstanding or 0
    if missed:
        effects.append(Rebased(fragment=k, missed=outstanding, samples=f.in_flight_samples))
        f = attrs.evolve(
            f, samples=f.samples + f.in_flight_samples, steps=f.steps + f.in_flight_steps
        )
    f = attrs.evolve(
        f,
        merged=round,
        outstanding=None,
        nonce=None,
        published_at=None,
        in_flight_samples=0,
        in_flight_steps=0,
    )
    state = _replace(state, k, f)
    if missed and f.samples > 0:
        # Decision 5: the missed progress goes into the fragment's next round at once. It is
        # not a scheduled slot, so the overlap bound does not apply to it.
        state, publish = _publish(state, k, algorithm, bounded=False)
        effects.append(publish)
        if state.leaving:  # the lease waits for this snapshot instead (Decision 11)
            effects.append(Leave(after=(publish.round,), replaces=(outstanding,)))
        return _leave(*_publish_owed(state, algorithm, effects))
    if state.closing:
        return _publish_remaining(state, algorithm, effects)
    return _settle(state, algorithm, effects)


def _leave(state: LearnerState, effects: list[Effect]) -> tuple[LearnerState, list[Effect]]:
    """Decision 11: a closing node leaves once nothing it trained is left to publish (a
    fragment in flight publishes the rest of its training when its commit is merged), with the
    rounds its snapshots in flight went to: its lease says ``left`` only once they are uploaded
    (``Leave``), so a closer that sees it left finds its last snapshots too."""
    if not state.closing or state.leaving or any(f.samples > 0 for f in state.fragments):
        return state, effects
    after = tuple(sorted(f.outstanding for f in state.fragments if f.outstanding is not None))
    return attrs.evolve(state, leaving=True), [*effects, Leave(after=after)]


def counted(
    state: LearnerState,
    algorithm: DiLoCo,
    *,
    round: int,
    me: str,
    counted: frozenset[tuple[str, str]],
) -> bool:
    """Whether this node's snapshot in flight for the fragment of ``round`` was counted by the
    commit of ``round``, or by a commit skipped to reach it: ``counted`` holds every ``(node,
    nonce)`` those commits included, and the snapshot is ours by its nonce (Decision 9)."""
    f = state.fragments[round % algorithm.fragments]
    if f.outstanding is None or f.outstanding > round or f.nonce is None:
        return False
    return (me, f.nonce) in counted


def close(state: LearnerState, algorithm: DiLoCo) -> tuple[LearnerState, list[Effect]]:
    """Training has ended: publish what every free fragment trained since its last snapshot;
    fragments in flight publish theirs once merged. ``Leave`` goes to the syncer once nothing
    is left to publish (at once, or at the merge that publishes the last of it)."""
    state = attrs.evolve(state, closing=True, deferred=0)
    return _publish_remaining(state, algorithm, [])


def done(state: LearnerState) -> bool:
    """A closing learner is done when nothing is in flight and nothing is left to publish."""
    return state.closing and all(f.free and f.samples == 0 for f in state.fragments)


def _publish_remaining(
    state: LearnerState, algorithm: DiLoCo, effects: list[Effect]
) -> tuple[LearnerState, list[Effect]]:
    for k, f in enumerate(state.fragments):
        if f.free and f.samples > 0:
            state, publish = _publish(state, k, algorithm, bounded=False)
            effects.append(publish)
    return _leave(state, effects)


def _take_deferred(
    state: LearnerState, algorithm: DiLoCo, effects: list[Effect]
) -> tuple[LearnerState, list[Effect]]:
    while state.deferred > 0:
        candidates = [
            (next_round(algorithm, k, f.merged), k)
            for k, f in enumerate(state.fragments)
            if f.free and f.samples > 0
        ]
        if not candidates:
            if all(f.free for f in state.fragments):
                # Nothing trained since the last snapshots: the slot has nothing to publish.
                state = attrs.evolve(state, deferred=0)
            break
        _, k = min(candidates)
        state, publish = _publish(state, k, algorithm, bounded=True)
        state = attrs.evolve(state, deferred=state.deferred - 1)
        effects.append(publish)
    return state, effects


def _settle(
    state: LearnerState, algorithm: DiLoCo, effects: list[Effect]
) -> tuple[LearnerState, list[Effect]]:
    state, effects = _take_deferred(state, algorithm, effects)
    return _publish_owed(state, algorithm, effects)


def _publish_owed(
    state: LearnerState, algorithm: DiLoCo, effects: list[Effect]
) -> tuple[LearnerState, list[Effect]]:
    """While held at the overlap bound, publish each free fragment (with samples) whose next
    round comes before the newest round holding the node, smallest round first. Such a
    publication is bounded like a slot's: the node is held anyway, and it keeps every snapshot
    in flight within the bound."""
    newest = _newest(_holding(state, algorithm))
    if state.closing or newest is None:
        return state, effects
    owed = sorted(
        (next_round(algorithm, k, f.merged), k)
        for k, f in enumerate(state.fragments)
        if f.free and f.samples > 0
    )
    for target, k in owed:
        if target >= newest:
            break
        state, publish = _publish(state, k, algorithm, bounded=True)
        effects.append(publish)
    return state, effects


def _publish(
    state: LearnerState, k: int, algorithm: DiLoCo, *, bounded: bool
) -> tuple[LearnerState, Publish]:
    f = state.fragments[k]
    target = next_round(algorithm, k, f.merged)
    nonce = derived(state.process, "snapshot", target)
    publish = Publish(
        fragment=k, round=target, base_round=f.merged, samples=f.samples, steps=f.steps
    )
    f = attrs.evolve(
        f,
        outstanding=target,
        nonce=nonce,
        published_at=state.step if bounded else None,
        in_flight_samples=f.samples,
        in_flight_steps=f.steps,
        samples=0,
        steps=0,
    )
    return _replace(state, k, f), publish


def next_round(algorithm: DiLoCo, fragment: int, merged: int) -> int:
    """The round after commit ``merged`` of ``fragment`` (its first round when -1)."""
    return fragment if merged < 0 else merged + algorithm.fragments


def _replace(state: LearnerState, k: int, f: FragmentState) -> LearnerState:
    fragments = list(state.fragments)
    fragments[k] = f
    return attrs.evolve(state, fragments=tuple(fragments))
