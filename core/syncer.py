"""The syncer's loop as one rule: keep the node's lease, watch the others', close the rounds the
closing rules assign this node, take over abandoned ones, and collect old rounds.

``step(view, state, *, now, settings)`` takes what the loop gathered since its last call (the
results of the effects it returned, and messages from the node's other loops: ``Watch`` a
round this node published to, ``Seen`` a commit, ``Gather``, ``Leave``, ``Stop``) and returns
the next state, the effects to carry out and why. Requests (Decision 8): one LIST of
``leases/`` every ``lease_every / 2`` seconds while the view decides something
(``lease_cadence``: while the node waits to see the others, and while it is attentive to a
round), else none, and a GET only for a lease that changed beyond the renewals it expects
(``leases``); for each round this node published to, one LIST of its snapshots per poll,
and of its claims too once it may close, only while it is ``attentive`` (``closing``: the
closer it predicts or the next candidate, or ``takeover`` seconds on); commits are learned
from the learner's polls (``Seen``), never polled twice. At most one close runs at a time,
so a closer holds one fragment's deltas and outer state at once (Decision 16).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from gradientmail.core import closing, gc, keys, leases, robust
from gradientmail.core.closing import Context, RoundState
from gradientmail.core.effects import (
    ClaimRead,
    ClaimsRead,
    CommitRead,
    Committed,
    Created,
    Delete,
    Done,
    Effect,
    Forget,
    Gather,
    Hurry,
    LeaseRead,
    LeasesListed,
    Leave,
    ListRound,
    RenewLease,
    Result,
    RoundListed,
    Seen,
    SnapshotRead,
    SnapshotsListed,
    Stop,
    Wait,
    Watch,
)
from gradientmail.core.identity import derived
from gradientmail.core.leases import Keeper, covers
from gradientmail.core.records import Commit, Lease, Manifest
from gradientmail.core.rules import RULES, Rules
from gradientmail.core.signing import Keyring

__all__ = ["COMMIT_WINDOW", "Settings", "SyncerState", "step"]

COMMIT_WINDOW = 64
"""Rounds of commits a syncer remembers behind the newest it knows *of the same fragment* (it
consults only each fragment's previous commit; one fragment may run far ahead of another whose
round is stuck, and that round's base must not be forgotten)."""


@attrs.frozen(kw_only=True)
class Settings:
    """A syncer's node, run and settings (seconds)."""

    node: str
    process: str
    manifest: Manifest
    poll_interval: float
    lease_every: float
    lease_timeout: float
    takeover: float
    keep: int | None = gc.DEFAULT_KEEP
    horizon: float = gc.DEFAULT_HORIZON
    outlier_factor: float | None = robust.DEFAULT_OUTLIER_FACTOR
    rules: Rules = RULES
    keyring: Keyring | None = None  # a signed run's: the leases it expects are signed with it
    lease_idle: float | None = None  # seconds between LISTs of leases when idle; None: never
    renewals_ahead: int = leases.RENEWALS_AHEAD  # recognized from a listed MD5 without a GET


@attrs.frozen(kw_only=True)
class SyncerState:
    """The syncer's lease keeper, the rounds it watches (ascending), the commits it knows
    (a window), the peers those commits included, the rounds it will collect
    and when (``collect``: ``(round, due)``), whether it is stopping, and whether the node
    waits to see the run's nodes (``gathering``: from ``Gather`` to its first snapshot, and
    ``awaiting``, how many it waits to see), the rounds whose snapshots the node's ``left``
    lease waits for (``departing``: from ``Leave`` until this process's snapshot of each is
    uploaded or counted by a commit), and the watched rounds whose snapshot key holds another
    incarnation's snapshot, not this one's (``foreign``: until a commit settles them)."""

    keeper: Keeper = attrs.Factory(Keeper)
    rounds: tuple[RoundState, ...] = ()
    commits: tuple[tuple[int, Commit], ...] = ()
    peers: frozenset[str] = frozenset()
    collect: tuple[tuple[int, float], ...] = ()
    stopping: bool = False
    gathering: bool = False
    awaiting: int = 0
    hurried: frozenset[int] = frozenset()  # rounds this node's training waits for (Hurry)
    departing: frozenset[int] | None = None
    foreign: frozenset[int] = frozenset()

    def commit(self, r: int) -> Commit | None:
        return dict(self.commits).get(r)

    @property
    def closing(self) -> RoundState | None:
        return next((s for s in self.rounds if s.closing is not None), None)

    def active(self, *, now: float, lease_timeout: float) -> int:
        """Live nodes that have not left, as this syncer last saw them."""
        return len(self.keeper.view.active(now=now, lease_timeout=lease_timeout))


def step(
    view: Sequence[Result], state: SyncerState, *, now: float, settings: Settings
) -> tuple[SyncerState, list[Effect], str]:
    """The syncer after ``view``: its next effects and why."""
    effects: list[Effect] = []
    routed: dict[int, list[Result]] = {}
    for item in view:
        state, more = _take(state, item, routed, now, settings)
        effects += more
    if state.departing == frozenset():
        # Decided on the whole view: a ``Leave`` in it that names a round the progress of a
        # missed one went to keeps the lease waiting.
        keeper = attrs.evolve(state.keeper, leaving=True, next_renewal=-math.inf)
        state = attrs.evolve(state, keeper=keeper, departing=None)
    # The renewal goes first, so no round's work delays it; the rounds decide on the lease view
    # folded last, before the next LIST of leases is made (Decision 3: a takeover judges
    # expiry by the newest LIST it has read).
    keeper, more = leases.renew(
        state.keeper,
        node=settings.node,
        nonce=settings.process,
        now=now,
        lease_every=settings.lease_every,
    )
    if keeper is not state.keeper:
        state = attrs.evolve(state, keeper=keeper)
    effects += more
    state, more, until, reasons = _rounds(state, routed, now, settings)
    effects += more
    state, more = _collect(state, now, settings)
    effects += more
    every = lease_cadence(state, settings, now=now)
    keeper, more = leases.watch(state.keeper, now=now, every=every)
    if keeper is not state.keeper:
        state = attrs.evolve(state, keeper=keeper)
    effects += more
    if state.stopping and state.closing is None:
        final = Lease(
            node=settings.node, nonce=settings.process, counter=state.keeper.counter + 1, left=True
        )
        return state, [*effects, RenewLease(lease=final), Done(reason="stopped")], "stopped"
    until = min(until, state.keeper.deadline, *(due for _, due in state.collect))
    reason = "; ".join(reasons) or "no round to watch"
    return state, [*effects, Wait(until=until, reason=reason)], reason


def lease_cadence(state: SyncerState, settings: Settings, *, now: float) -> float:
    """Seconds between this node's LISTs of ``leases/`` at ``now`` (Decision 8).

    ``poll_interval`` (when shorter) while the node waits at the start barrier
    (``wait_for_nodes``: ``Gather``) and its view holds fewer active nodes than it waits for:
    every node leaves the barrier within about a poll of the last one's join, so the first
    round does not wait on a node that saw the others up to ``lease_every / 2`` late.

    ``lease_every / 2`` while its view decides something: while the node waits to see the
    run's nodes before training (``Gather``; until its first snapshot), while it is attentive
    to a round (``closing.attentive``: it may close or take over, by the nodes it sees live),
    and while it is leaving (from its ``Leave`` on) with rounds in flight (its last rounds have
    no later round to correct a stale prediction: without a LIST, the last node of a run that
    closed would leave its final rounds to nodes long gone, for ``takeover`` seconds).
    Otherwise never (``Settings.lease_idle`` sets a cadence): the view then only predicts who
    closes a round, which the closer it predicts, the understudy and a takeover correct, and a
    node that becomes attentive lists at once when its last LIST is older than
    ``lease_every / 2``.
    Expiry is judged the same at any cadence (a version unchanged ``lease_timeout`` after it
    was first seen, at the observer's last LIST), only noticed later.
    """
    leaving = (state.keeper.leaving or state.departing is not None) and bool(state.rounds)
    view, timeout = state.keeper.view, settings.lease_timeout
    if state.gathering and (
        leases.gathered(view, now=now, lease_timeout=timeout, count=state.awaiting) is None
    ):  # the barrier's own test (``Node.wait_for_nodes``): not open yet
        return min(settings.poll_interval, settings.lease_every / 2)
    if state.gathering or leaving or any(s.attentive for s in state.rounds):
        return settings.lease_every / 2
    return math.inf if settings.lease_idle is None else settings.lease_idle


def _take(
    state: SyncerState,
    item: Result,
    routed: dict[int, list[Result]],
    now: float,
    settings: Settings,
) -> tuple[SyncerState, list[Effect]]:
    """One item of the view: a message, or a result routed to the leases, a round or GC."""
    algorithm = settings.manifest.algorithm
    if isinstance(item, Watch):
        state = _watch(state, item.round, settings)
        if not item.ours:
            # Watched, but not uploaded: a leaving node's lease still waits for the round.
            if any(covers(c, item.round, algorithm.fragments) for c, _ in state.commits):
                return state, []
            return attrs.evolve(state, foreign=state.foreign | {item.round}), []
        if state.departing is not None:
            state = _depart(state, state.departing - {item.round})
        return state, []
    if isinstance(item, Seen):
        return _counted(_learn(state, item.commit, settings), item.commit, settings), []
    if isinstance(item, Gather):
        return attrs.evolve(state, gathering=True, awaiting=max(state.awaiting, item.count)), []
    if isinstance(item, Hurry):
        return _hurry(state, item.round, settings), []
    if isinstance(item, Leave):
        return _leave(state, item, settings), []
    if isinstance(item, Stop):
        return attrs.evolve(state, stopping=True), []
    if isinstance(item, LeasesListed):
        keeper, effects = leases.listed(
            state.keeper,
            item,
            now=now,
            lease_timeout=settings.lease_timeout,
            keyring=settings.keyring,
            ahead=settings.renewals_ahead,
            fold=settings.rules.observe,
        )
        return attrs.evolve(state, keeper=keeper), effects
    if isinstance(item, LeaseRead):
        keeper, effects = leases.read(
            state.keeper,
            item,
            now=now,
            lease_timeout=settings.lease_timeout,
            fold=settings.rules.observe,
        )
        return attrs.evolve(state, keeper=keeper), effects
    if isinstance(item, RoundListed):
        return state, [Delete(keys=gc.in_round(item.keys))] if item.keys else []
    if isinstance(item, CommitRead) and item.commit is not None and item.rejected is None:
        state = _counted(_learn(state, item.commit, settings), item.commit, settings)
    r = _round_of(item, state, algorithm.fragments)
    if r is not None:
        routed.setdefault(r, []).append(item)
    return state, []


def _round_of(item: Result, state: SyncerState, fragments: int) -> int | None:
    """The watched round a result belongs to: the one it names, or for the reads a close
    makes of other keys (a base commit, its own commit), the round being closed."""
    if isinstance(item, SnapshotsListed | ClaimsRead | ClaimRead | SnapshotRead):
        return item.round
    if isinstance(item, Created):
        return keys.parse(item.key).round
    current = state.closing
    if isinstance(item, CommitRead):
        return current.round if current is not None else None
    r = getattr(item, "round", None)
    return r if isinstance(r, int) else None


def _watch(state: SyncerState, r: int, settings: Settings) -> SyncerState:
    """This node has a snapshot in round ``r``: look at it now (unless it is committed)."""
    K = settings.manifest.algorithm.fragments
    if state.gathering:
        state = attrs.evolve(state, gathering=False)
    if any(covers(c, r, K) for c, _ in state.commits):
        return state
    found = [s for s in state.rounds if s.round == r]
    if found:
        rounds = tuple(closing.poke(s) if s.round == r else s for s in state.rounds)
        return attrs.evolve(state, rounds=rounds)
    rounds = tuple(sorted((*state.rounds, RoundState.new(r)), key=lambda s: s.round))
    return attrs.evolve(state, rounds=rounds)


def _leave(state: SyncerState, leave: Leave, settings: Settings) -> SyncerState:
    """``Leave``: the rounds the ``left`` lease waits for (Decision 11, ``leases.awaited``):
    until this process's snapshot of each is under its key (a ``Watch`` with ``ours``) or a
    commit counts it, or a later ``Leave`` replaces a round whose commit missed it with the
    round its progress went to. Once the lease says ``left`` it stays so: progress published
    after the syncer decided is not waited for."""
    if state.keeper.leaving:
        return state
    waits = settings.rules.awaited(
        leave.after,
        uploaded=[s.round for s in state.rounds if s.round not in state.foreign],
        counted=[c.round for _, c in state.commits if _ours(c, settings)],
        fragments=settings.manifest.algorithm.fragments,
    )
    return _depart(state, ((state.departing or frozenset()) - set(leave.replaces)) | waits)


def _counted(state: SyncerState, commit: Commit, settings: Settings) -> SyncerState:
    """``commit`` counts this node's snapshots of the rounds it covers: the lease waits for
    them no more. (A commit without them leaves them to the ``Leave`` that replaces them.)"""
    if state.departing is None or not _ours(commit, settings):
        return state
    K = settings.manifest.algorithm.fragments
    return _depart(state, frozenset(r for r in state.departing if not covers(commit.round, r, K)))


def _ours(commit: Commit, settings: Settings) -> bool:
    """``commit`` counts this process's snapshot (of its round: a snapshot's nonce is derived
    from the round it is published in), not only one under this node's name: a snapshot an
    earlier incarnation left under the key settles nothing this process trained."""
    return commit.includes(settings.node, derived(settings.process, "snapshot", commit.round))


def _depart(state: SyncerState, departing: frozenset[int]) -> SyncerState:
    """The rounds the ``left`` lease still waits for; none: ``step`` marks it ``left`` (renewed
    at once) once it has taken in the whole view."""
    return state if departing == state.departing else attrs.evolve(state, departing=departing)


def _hurry(state: SyncerState, r: int, settings: Settings) -> SyncerState:
    """This node's training waits for round ``r``'s commit: while the node reads the round's
    view at every poll (it is the closer it predicts, or a candidate), it reads it at once and
    then ``polling.HURRY_POLLS`` times per interval (``closing.Context.hurried``), so its close
    begins soon after the round's last snapshot, not up to an interval later."""
    K = settings.manifest.algorithm.fragments
    if any(covers(c, r, K) for c, _ in state.commits):
        return state
    rounds = tuple(closing.poke(s) if s.round == r else s for s in state.rounds)
    return attrs.evolve(state, rounds=rounds, hurried=state.hurried | {r})


def _learn(state: SyncerState, commit: Commit, settings: Settings) -> SyncerState:
    """``commit`` exists: remember it (a window), its peers, and that every watched round of
    its fragment up to it is committed (each commit's base is the one before)."""
    K = settings.manifest.algorithm.fragments
    known = dict(state.commits)
    known[commit.round] = commit
    newest: dict[int, int] = {}
    for r in known:
        newest[r % K] = max(newest.get(r % K, r), r)
    commits = tuple(sorted((r, c) for r, c in known.items() if r >= newest[r % K] - COMMIT_WINDOW))
    rounds = tuple(
        attrs.evolve(s, committed=True) if covers(commit.round, s.round, K) else s
        for s in state.rounds
    )
    peers = state.peers | {i.node for i in commit.included}
    hurried = frozenset(h for h in state.hurried if not covers(commit.round, h, K))
    foreign = frozenset(r for r in state.foreign if not covers(commit.round, r, K))
    return attrs.evolve(
        state, commits=commits, rounds=rounds, peers=peers, hurried=hurried, foreign=foreign
    )


def _rounds(
    state: SyncerState, routed: dict[int, list[Result]], now: float, settings: Settings
) -> tuple[SyncerState, list[Effect], float, list[str]]:
    """Each watched round's step, in order; rounds that are over are forgotten."""
    keeper = state.keeper
    members = frozenset(n for n, _ in keeper.known) if settings.manifest.signed else None
    context = Context(
        me=settings.node,
        process=settings.process,
        manifest=settings.manifest,
        leases=keeper.view,
        commits=dict(state.commits),
        peers=state.peers,
        members=members,
        lease_timeout=settings.lease_timeout,
        takeover=settings.takeover,
        poll_interval=settings.poll_interval,
        hurried=state.hurried,
        outlier_factor=settings.outlier_factor,
        busy=False,
        settling=keeper.listing is not None,
        rules=settings.rules,
    )
    effects: list[Effect] = []
    kept: list[RoundState] = []
    reasons: list[str] = []
    until = math.inf
    for i, s in enumerate(state.rounds):
        # One close at a time: another round's, earlier or later in the order, holds this one
        # (the results of a close's reads of other keys are routed to the close in flight).
        busy = any(k.closing is not None for k in kept) or any(
            k.closing is not None for k in state.rounds[i + 1 :]
        )
        if busy != context.busy:
            context = attrs.evolve(context, busy=busy)
        s, more, wake, reason = closing.step(s, routed.get(s.round, ()), context, now=now)
        effects += more
        if any(isinstance(e, Committed) for e in more):
            state = _learn(state, _committed(more), settings)
            state = _schedule(state, s.round, now, settings)
            context = attrs.evolve(context, commits=dict(state.commits), peers=state.peers)
        if s.over:
            effects.append(Forget(keys=(keys.snapshot(s.round, settings.node),)))
            continue
        kept.append(s)
        reasons.append(reason)
        if wake is not None:
            until = min(until, wake)
    if tuple(kept) != state.rounds:  # identical members compare by identity: cheap
        state = attrs.evolve(state, rounds=tuple(kept))
    return state, effects, until, reasons


def _committed(effects: list[Effect]) -> Commit:
    return next(e.commit for e in effects if isinstance(e, Committed))


def _schedule(state: SyncerState, r: int, now: float, settings: Settings) -> SyncerState:
    """After this node committed ``r``: collect the fragment's round ``keep`` rounds back once
    the horizon has passed (Decision 7)."""
    if settings.keep is None:
        return state
    old = settings.rules.collectable(settings.manifest.algorithm, r, keep=settings.keep)
    if old is None:
        return state
    return attrs.evolve(state, collect=(*state.collect, (old, now + settings.horizon)))


def _collect(
    state: SyncerState, now: float, settings: Settings
) -> tuple[SyncerState, list[Effect]]:
    due = [r for r, at in state.collect if at <= now]
    if not due:
        return state, []
    left = tuple((r, at) for r, at in state.collect if at > now)
    return attrs.evolve(state, collect=left), [ListRound(round=r) for r in due]
