"""How often a syncer LISTs ``leases/`` (``syncer.lease_cadence``, Decision 8): every
``lease_every / 2`` seconds while its view decides something (it waits to see the run's nodes,
it is attentive to a round, or it is leaving with rounds in flight), else never; and one close
at a time, whichever round's."""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from gradientmail.core import closing, keys, syncer
from gradientmail.core.algorithm import DiLoCo
from gradientmail.core.effects import (
    ClaimsRead,
    CreateClaim,
    Gather,
    Hurry,
    LeaseRead,
    LeasesListed,
    Leave,
    ListClaims,
    ListLeases,
    ListSnapshots,
    RenewLease,
    Result,
    Seen,
    SnapshotsListed,
    Watch,
)
from gradientmail.core.fragments import partition
from gradientmail.core.identity import derived
from gradientmail.core.records import Commit, Included, Lease, Manifest, PayloadRef
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

EVERY, TIMEOUT = 10.0, 30.0
SETTINGS = syncer.Settings(
    node="node-a",
    process=NONCE,
    manifest=MANIFEST,
    poll_interval=1.0,
    lease_every=EVERY,
    lease_timeout=TIMEOUT,
    takeover=TIMEOUT,
)


def others(r: int, me_first: bool) -> tuple[str, ...]:
    """Two more nodes, named so that ``node-a`` is (or is not) round ``r``'s first candidate."""
    names = [f"node-{c}" for c in "bcdefghijklmnop"]
    mine = closing.rank(r, "node-a")
    if me_first:
        return tuple(n for n in names if closing.rank(r, n) > mine)[:2]
    return tuple(n for n in names if closing.rank(r, n) < mine)[:2]


def run(
    state: syncer.SyncerState,
    start: float,
    until: float,
    messages: Sequence[Result] = (),
    nodes: Sequence[str] = (),
    *,
    every: float = 0.5,
    views: list[float] | None = None,
    settings: syncer.Settings = SETTINGS,
) -> tuple[syncer.SyncerState, list[float]]:
    """Step the syncer every ``every`` s from ``start`` to ``until`` (``messages`` at the first
    step), answering each LIST of leases at once with ``nodes``' leases (and ``node-a``'s),
    each renewed since the last LIST: when it listed. With ``views``, each LIST of a round's
    snapshots is answered too (``node-a``'s alone; no claims), and its time kept there."""
    listed: list[float] = []
    view: list[Result] = list(messages)
    now = start
    while now <= until + 1e-9:
        state, effects, _ = syncer.step(view, state, now=now, settings=settings)
        view = []
        for effect in effects if views is not None else ():
            if isinstance(effect, ListSnapshots):
                views.append(round(now, 2))
                view.append(SnapshotsListed(round=effect.round, sizes=(("node-a", 0, 100),)))
            elif isinstance(effect, ListClaims):
                view.append(ClaimsRead(round=effect.round, claims=()))
        if any(isinstance(e, ListLeases) for e in effects):
            listed.append(now)
            counter = len(listed)
            leases = [Lease(node=n, nonce=NONCE, counter=counter) for n in ("node-a", *nodes)]
            entries = tuple((x.node, f"v{counter}", 100, None) for x in leases)
            state, effects, _ = syncer.step(
                [LeasesListed(entries=entries)], state, now=now, settings=settings
            )
            reads = [LeaseRead(node=x.node, lease=x) for x in leases]
            state, _, _ = syncer.step(reads, state, now=now, settings=settings)
        now = round(now + every, 2)
    return state, listed


def test_a_node_that_decides_nothing_lists_only_when_it_starts() -> None:
    state, listed = run(syncer.SyncerState(), 0.0, 300.0)
    assert listed == [0.0]
    assert syncer.lease_cadence(state, SETTINGS, now=0.0) == math.inf


def test_the_idle_cadence_can_be_set() -> None:
    settings = attrs.evolve(SETTINGS, lease_idle=TIMEOUT)
    assert syncer.lease_cadence(syncer.SyncerState(), settings, now=0.0) == TIMEOUT


def test_a_gathering_node_lists_every_half_renewal_until_it_publishes() -> None:
    nodes = others(0, me_first=False)
    state, listed = run(syncer.SyncerState(), 0.0, 20.0, [Gather()], nodes)
    assert listed == [0.0, 5.0, 10.0, 15.0, 20.0]
    assert state.gathering
    state, listed = run(state, 20.5, 50.0, [Watch(round=0, ours=True)], nodes)
    assert not state.gathering
    # Another node is round 0's predicted closer: this one leaves the round to that closer
    # and lists nothing until its takeover timer (30 s) makes it attentive.
    assert state.rounds and not any(s.attentive for s in state.rounds)
    assert listed == []
    state, listed = run(state, 50.5, 60.0, (), nodes)
    assert all(s.attentive for s in state.rounds)
    assert listed == [50.5, 55.5]


def test_a_node_at_the_start_barrier_lists_every_poll_until_it_sees_them_all() -> None:
    """``wait_for_nodes(3)``: until the view holds three active nodes the leases are listed
    every ``poll_interval`` (1 s), so the barrier opens about a poll after the last join, not
    up to ``lease_every / 2`` (5 s) after; then every half renewal until the first snapshot."""
    state, listed = run(syncer.SyncerState(), 0.0, 5.0, [Gather(count=3)], ("node-b",))
    assert state.awaiting == 3
    assert listed == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    state, listed = run(state, 5.5, 20.0, (), ("node-b", "node-c"))
    assert listed == [6.0, 11.0, 16.0]
    assert syncer.lease_cadence(state, SETTINGS, now=20.0) == EVERY / 2


def test_a_reporter_reads_a_round_that_waits_for_stragglers_once_per_takeover() -> None:
    """Decision 8: a reporter that left the round to the closer it predicts reads it once the
    takeover timer runs out; a read that finds it still waiting for reporters (nothing for a
    takeover to do) leaves it again for ``takeover`` seconds, rather than every poll on."""
    algorithm = attrs.evolve(MANIFEST.algorithm, quorum_size=3)  # every node: no grace
    settings = attrs.evolve(SETTINGS, manifest=attrs.evolve(MANIFEST, algorithm=algorithm))
    nodes = others(0, me_first=False)
    views: list[float] = []
    start = [Watch(round=0, ours=True)]
    state, listed = run(
        syncer.SyncerState(), 0.0, 120.0, start, nodes, views=views, settings=settings
    )
    # Once when its snapshot is out, then once per takeover: 30 s counted from the step after
    # the one that folded each read's answer (steps are 0.5 s apart); leases only then too.
    assert views == [0.0, 30.5, 61.5, 92.5]
    assert listed == [0.0, 30.5, 61.5, 92.5]
    assert state.rounds and not state.rounds[0].attentive


def test_a_leaving_node_lists_every_half_renewal_until_its_rounds_are_done() -> None:
    """A leaving node's last rounds have no later round to correct its view: the nodes it
    predicts to close them may have left and gone. It lists while they are in flight, and
    stops once nothing is left to watch."""
    nodes = others(0, me_first=False)
    state, listed = run(syncer.SyncerState(), 0.0, 1.0, (), nodes)
    assert listed == [0.0]
    state, listed = run(state, 1.5, 20.0, [Watch(round=0, ours=True)], nodes)
    assert state.rounds and not any(s.attentive for s in state.rounds)
    assert listed == []  # another node closes round 0: nothing to list for
    state, listed = run(state, 20.5, 40.0, [Leave()], nodes)
    assert state.keeper.leaving and state.rounds
    assert listed == [20.5, 25.5, 30.5, 35.5]
    assert syncer.lease_cadence(state, SETTINGS, now=0.0) == EVERY / 2
    done = attrs.evolve(state, rounds=())
    assert syncer.lease_cadence(done, SETTINGS, now=0.0) == math.inf


def commit_of(r: int, *nodes: str, earlier: bool = False) -> Commit:
    """A commit of round ``r`` (one fragment) that counts ``nodes``' snapshots: this process's
    own (its nonce derived for the round) under "node-a", or with ``earlier`` an earlier
    incarnation's."""
    return Commit(
        round=r,
        fragment=0,
        base_round=r - 1,
        closer=nodes[0],
        attempt=0,
        nonce=NONCE,
        included=tuple(
            Included(
                node=n,
                nonce=derived(NONCE, "snapshot", r) if n == "node-a" and not earlier else NONCE,
                samples=1,
                steps=10,
                base_round=r - 1,
                digest="cd" * 32,
            )
            for n in sorted(nodes)
        ),
        params=PayloadRef(key=keys.params(r, NONCE), digest="cd" * 32, size=16),
        state=PayloadRef(key=keys.state(r, NONCE), digest="cd" * 32, size=16),
    )


def test_the_lease_says_left_only_once_the_last_snapshots_are_uploaded() -> None:
    """Decision 11 (``Leave``): a closing node's ``left`` lease is written once each snapshot
    its close published is uploaded under its key (``Watch`` with ``ours``) or counted by a
    commit, never before: a closer that sees it left then finds its last snapshot there."""
    nodes = others(2, me_first=False)
    state, _ = run(syncer.SyncerState(), 0.0, 1.0, (), nodes)
    state, _ = run(state, 1.5, 3.0, [Leave(after=(2, 3, 4))], nodes)
    assert not state.keeper.leaving and state.departing == {2, 3, 4}
    # Another incarnation's snapshot holds round 2's key: this one's is not there.
    state, _ = run(state, 3.5, 4.0, [Watch(round=2, ours=False), Watch(round=3, ours=True)], nodes)
    assert not state.keeper.leaving and state.departing == {2, 4}
    # Round 2 committed without it: its progress goes to round 5, which the learner says.
    state, _, _ = syncer.step(
        [Seen(commit=commit_of(2, "node-b"))], state, now=4.5, settings=SETTINGS
    )
    assert not state.keeper.leaving and state.departing == {2, 4}
    state, _ = run(state, 5.0, 5.5, [Leave(after=(5,), replaces=(2,))], nodes)
    assert not state.keeper.leaving and state.departing == {4, 5}
    # A commit counting its snapshot, learned before its upload was reported: round 4 is done.
    state, _, _ = syncer.step(
        [Seen(commit=commit_of(4, "node-a", "node-b"))], state, now=6.0, settings=SETTINGS
    )
    assert not state.keeper.leaving and state.departing == {5}
    state, effects, _ = syncer.step([Watch(round=5, ours=True)], state, now=6.5, settings=SETTINGS)
    assert state.keeper.leaving and state.departing is None
    renewals = [e.lease for e in effects if isinstance(e, RenewLease)]
    assert [(x.node, x.left) for x in renewals] == [("node-a", True)]


def test_a_key_holding_another_incarnations_snapshot_is_waited_for_after_the_leave() -> None:
    """A restarted node whose snapshot key of round 0 holds its earlier incarnation's snapshot
    (``Watch`` without ``ours``, before the ``Leave``) has not uploaded it: the lease waits
    for round 0, and a commit that counts only the earlier incarnation's snapshot under its
    name (not this process's: a snapshot's nonce is derived from its process and round) does
    not settle it; the learner's next ``Leave`` names the round its progress went to."""
    state, _, _ = syncer.step(
        [Watch(round=0, ours=False)], syncer.SyncerState(), now=0.0, settings=SETTINGS
    )
    state, effects, _ = syncer.step([Leave(after=(0,))], state, now=0.5, settings=SETTINGS)
    assert not state.keeper.leaving and state.departing == {0}
    assert not [e for e in effects if isinstance(e, RenewLease) and e.lease.left]
    earlier = commit_of(0, "node-a", "node-b", earlier=True)
    state, _, _ = syncer.step([Seen(commit=earlier)], state, now=1.0, settings=SETTINGS)
    assert not state.keeper.leaving and state.departing == {0}
    assert state.foreign == frozenset()  # settled by a commit: not watched any more
    state, _, _ = syncer.step([Leave(after=(1,), replaces=(0,))], state, now=1.5, settings=SETTINGS)
    assert not state.keeper.leaving and state.departing == {1}
    state, effects, _ = syncer.step([Watch(round=1, ours=True)], state, now=2.0, settings=SETTINGS)
    assert state.keeper.leaving
    assert [e.lease.left for e in effects if isinstance(e, RenewLease)] == [True]


def test_an_upload_settles_its_round_even_after_a_newer_commit_is_known() -> None:
    """A reader whose round 3 parameters were collected skips to the newer commit of round 5
    and tells the syncer of that one only (the learner counts round 3 from the skipped
    commits, so no ``Leave`` replaces it): the upload of round 3 settles it, and the lease
    goes ``left`` instead of waiting until ``Stop``."""
    state, _, _ = syncer.step(
        [Leave(after=(3,)), Seen(commit=commit_of(5, "node-b"))],
        syncer.SyncerState(),
        now=0.0,
        settings=SETTINGS,
    )
    assert not state.keeper.leaving and state.departing == {3}
    state, effects, _ = syncer.step([Watch(round=3, ours=True)], state, now=0.5, settings=SETTINGS)
    assert state.keeper.leaving
    assert [e.lease.left for e in effects if isinstance(e, RenewLease)] == [True]


def test_a_leave_behind_the_last_upload_in_one_view_keeps_the_lease_waiting() -> None:
    """The syncer decides ``left`` on its whole view: the ``Watch`` of round 3's upload and,
    behind it, the ``Leave`` saying round 3's commit missed it and its progress went to round
    5 (the snapshot landed after round 3 closed) leave the lease waiting for round 5."""
    state, _, _ = syncer.step([Leave(after=(3,))], syncer.SyncerState(), now=0.0, settings=SETTINGS)
    assert state.departing == {3}
    view = [Watch(round=3, ours=True), Leave(after=(5,), replaces=(3,))]
    state, effects, _ = syncer.step(view, state, now=0.5, settings=SETTINGS)
    assert not state.keeper.leaving and state.departing == {5}
    assert not [e for e in effects if isinstance(e, RenewLease) and e.lease.left]


def test_a_round_a_known_commit_counts_is_not_waited_for() -> None:
    state, _, _ = syncer.step(
        [Seen(commit=commit_of(0, "node-a"))], syncer.SyncerState(), now=0.0, settings=SETTINGS
    )
    state, effects, _ = syncer.step([Leave(after=(0,))], state, now=0.5, settings=SETTINGS)
    assert state.keeper.leaving
    assert [e.lease.left for e in effects if isinstance(e, RenewLease)] == [True]


def test_a_snapshot_uploaded_before_the_leave_is_not_waited_for() -> None:
    state, _, _ = syncer.step(
        [Watch(round=0, ours=True)], syncer.SyncerState(), now=0.0, settings=SETTINGS
    )
    state, effects, _ = syncer.step([Leave(after=(0,))], state, now=0.5, settings=SETTINGS)
    assert state.keeper.leaving
    assert [e.lease.left for e in effects if isinstance(e, RenewLease)] == [True]


def test_a_node_with_nothing_in_flight_leaves_at_once() -> None:
    state, effects, _ = syncer.step([Leave()], syncer.SyncerState(), now=0.0, settings=SETTINGS)
    assert state.keeper.leaving
    assert [e.lease.left for e in effects if isinstance(e, RenewLease)] == [True]


def test_a_closer_whose_training_waits_reads_the_round_four_times_an_interval() -> None:
    """``Hurry``: the predicted closer reads the round's view at every poll; while its own
    training waits for the commit, at once and then ``HURRY_POLLS`` times per interval, so its
    close begins soon after the last snapshot. Once the commit is known, that ends."""
    nodes = others(1, me_first=True)  # round 1: two more nodes, node-a its closer
    state, _ = run(syncer.SyncerState(), 0.0, 1.0, (), nodes)
    views: list[float] = []
    state, _ = run(state, 1.1, 3.0, [Watch(round=1, ours=True)], nodes, every=0.05, views=views)
    # Once per interval from each LIST's answer, a step (0.05 s) later (the others have not
    # reported: the round stays open).
    assert views == [1.1, 2.15]
    views.clear()
    state, _ = run(state, 3.05, 4.0, [Hurry(round=1)], nodes, every=0.05, views=views)
    assert views == [3.05, 3.35, 3.65, 3.95]
    assert state.hurried == {1}
    committed = Commit(
        round=1,
        fragment=0,
        base_round=0,
        closer="node-b",
        attempt=0,
        nonce=NONCE,
        included=(
            Included(
                node="node-a", nonce=NONCE, samples=1, steps=10, base_round=0, digest="cd" * 32
            ),
        ),
        params=PayloadRef(key=keys.params(1, NONCE), digest="cd" * 32, size=16),
        state=PayloadRef(key=keys.state(1, NONCE), digest="cd" * 32, size=16),
    )
    state, _, _ = syncer.step([Seen(commit=committed)], state, now=4.05, settings=SETTINGS)
    assert state.hurried == frozenset()


def test_the_predicted_closer_lists_every_half_renewal() -> None:
    nodes = others(0, me_first=True)
    state, listed = run(syncer.SyncerState(), 0.0, 12.0, (), nodes)
    assert listed == [0.0]
    state, listed = run(state, 12.5, 30.0, [Watch(round=0, ours=True)], nodes)
    # Its last LIST is 12.5 s old, more than lease_every / 2: it lists at once, then every
    # lease_every / 2 while it is attentive to the round.
    assert state.rounds and all(s.attentive for s in state.rounds)
    assert listed == [12.5, 17.5, 22.5, 27.5]


def test_a_round_waits_for_a_close_of_a_later_round_in_flight() -> None:
    """One close at a time, whichever round's: the results of a close's reads of other keys
    (a base commit, the winner's commit) go to the close in flight, so a second close, begun by
    an earlier round while a later one's was running, took them and the later close waited for
    good (the simulator's swarm seed 307: a node stuck "closing")."""
    state, _ = run(syncer.SyncerState(), 0.0, 1.0)
    in_flight = closing.Closing(attempt=0, nonce=NONCE, started=0.0, phase="lost")
    rounds = (
        attrs.evolve(closing.RoundState.new(0), reporters=("node-a",), poked=False, due=100.0),
        attrs.evolve(closing.RoundState.new(1), closing=in_flight),
    )
    state = attrs.evolve(state, rounds=rounds)
    state, effects, reason = syncer.step([], state, now=2.0, settings=SETTINGS)
    assert not any(isinstance(e, CreateClaim) for e in effects), effects
    assert "waits for this node's other close" in reason


def test_a_fragment_far_behind_another_keeps_its_newest_commit() -> None:
    """The syncer remembers commits ``COMMIT_WINDOW`` rounds behind the newest *of the same
    fragment*: one fragment may run far ahead while another's round is stuck, and when that
    round commits, the commit is the base of the fragment's next close (the 64-node swarm's
    seed 39 stepped from the initial parameters when the window was run-wide)."""
    schema = Schema.of([ParameterSpec(name=n, dtype="F32", shape=(4,)) for n in "vw"])
    two = attrs.evolve(
        MANIFEST,
        schema=schema,
        algorithm=DiLoCo(inner_steps=10, fragments=2),
        fragments=partition(schema, 2),
        init=tuple(PayloadRef(key=keys.init(k, NONCE), digest="cd" * 32, size=16) for k in (0, 1)),
    )
    settings = attrs.evolve(SETTINGS, manifest=two)

    def commit(r: int) -> Commit:
        base = r - 2 if r >= 2 else -1
        return Commit(
            round=r,
            fragment=r % 2,
            base_round=base,
            closer="node-b",
            attempt=0,
            nonce=NONCE,
            included=(
                Included(
                    node="node-b",
                    nonce=NONCE,
                    samples=1,
                    steps=10,
                    base_round=base,
                    digest="cd" * 32,
                ),
            ),
            params=PayloadRef(key=keys.params(r, NONCE), digest="cd" * 32, size=16),
            state=PayloadRef(key=keys.state(r, NONCE), digest="cd" * 32, size=16),
        )

    ahead = 2 * syncer.COMMIT_WINDOW + 1  # fragment 1's newest, far past fragment 0's
    state, _, _ = syncer.step(
        [Seen(commit=commit(ahead))], syncer.SyncerState(), now=0.0, settings=settings
    )
    state, _, _ = syncer.step([Seen(commit=commit(0))], state, now=1.0, settings=settings)
    assert state.commit(0) == commit(0) and state.commit(ahead) == commit(ahead)
    # Each fragment forgets only what lies COMMIT_WINDOW behind its own newest commit.
    old = ahead - syncer.COMMIT_WINDOW - 2
    state, _, _ = syncer.step([Seen(commit=commit(old))], state, now=2.0, settings=settings)
    assert state.commit(old) is None and state.commit(0) is not None
