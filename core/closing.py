"""Closing a round: when it may close, who closes it, when another node takes over, and every
step of the close from the claim to the commit. What happens when a round closes is all here.

Closable. Round ``r`` may close once it has a snapshot and either every *expected* node has
reported, or ``quorum_size`` snapshots exist and ``grace`` seconds have passed since this
observer first saw them. Expected nodes are the active (live, not left) nodes that reported in
the fragment's previous round, or for a fragment's first round every active node (with those
seen reporting elsewhere whose leases this observer has not listed yet). So a synchronous run
closes as soon as everyone is in; a straggler costs at most ``grace``; a newcomer is not waited
for until it has reported once; and once ``quorum_size`` snapshots exist no cycle of waiting
nodes can stall the run, since the grace timer always runs out. Below that (``quorum_size``
equal to the node count) every expected node must report, which the learner's "Held" rules
ensure: a node held at the overlap bound publishes every round it owes below the holding one,
taking one step first when it has nothing to publish to it (core/learner.py).

Closer. Attempt ``a``'s candidates are the round's live reporters ordered by a stable hash of
``r`` and each node (``rank``) and turned by ``a``, whether or not they have left (a leaving
node waits for its rounds anyway, and every reporter must compute the same order). A node's
rank does not depend on who else reported, so each reporter predicts the closer from the nodes
the round expects, and only that one and the next read the round's view at every poll
(``attentive``; Decision 8); the others read it only once it has stayed open ``takeover``
seconds. Candidate ``i`` may claim ``claims/<a>`` once the
attempt has been open for ``i * takeover`` seconds: the first at once, the others only if it
stays silent. Attempt ``a+1`` opens when attempt ``a``'s claimant is seen expired, or
``takeover * 2**a`` seconds after its claim was first seen without a commit (Decision 2).

The close (``Closing``), one step per result:

1. create ``claims/<a>``; when the key holds another object, read it: a valid claim is another
   closer's (stop), garbage or a forgery only spares duplicate work, so the close goes on;
2. list the round's snapshots; skip those larger than a genuine snapshot can be, and read the
   rest one at a time, in node order (each read names itself and the keys after it,
   ``READ_AHEAD`` in all and up to ``READ_AHEAD_BYTES`` of listed objects, which the shell may
   fetch together with it and keep until their turn: a round of many snapshots waits on a few
   round trips, not one per snapshot; the order of the sum is unchanged). A node's snapshot is
   the one at the first of its snapshot keys that verifies (``core.slots``): a key whose object
   does not verify (a squatter's) is reported and the node's next listed key read. A snapshot
   whose record names its key's node and round and whose base is the fragment's previous commit
   (``include``) is decoded and added to the round's F32 sum with its weight (``outer_sum``),
   and dropped, so a close holds one delta whatever the number of snapshots; norms are measured
   only where a rule reads them;
3. exclude outliers and clip (``robust``). When that changes a weight, the sum is taken again
   over the snapshots that stay, with their final weights (a second pass of reads, which only
   a round with an outlier or a clipped delta pays); nothing left means no commit;
4. load the outer state the step starts from: the previous commit's (its record read first
   when this node does not know it), or the initial parameters for a fragment's first round;
5. take the outer step from the scaled sum, write ``params`` and ``state``;
6. create the commit record, last: the round commits exactly once. If it is ours, hand it to
   the learner, update the ``heads/`` hint at every ``HEAD_EVERY``-th commit, and schedule the
   collection of the fragment's round ``keep`` rounds back (``gc``); if another attempt won,
   delete our payloads and read the winner's record.

Any read that fails (a corrupt base, a payload key taken) reports the object, reads whether
another closer committed meanwhile, and leaves the round to be looked at again.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import attrs

from gradientmail.core import keys, robust
from gradientmail.core.algorithm import DiLoCo
from gradientmail.core.chain import previous_round
from gradientmail.core.effects import (
    HURRY_POLLS,
    Accumulate,
    Accumulated,
    BaseRead,
    Claimed,
    ClaimRead,
    ClaimsRead,
    Clipped,
    CommitRead,
    Committed,
    CreateClaim,
    Created,
    Delete,
    Drop,
    Effect,
    Excluded,
    Forget,
    ListClaims,
    ListSnapshots,
    OuterStep,
    PutHead,
    ReadClaim,
    ReadCommit,
    ReadOuterState,
    ReadSnapshot,
    Rejected,
    Result,
    SnapshotRead,
    SnapshotsListed,
    Wait,
    Written,
)
from gradientmail.core.identity import derived
from gradientmail.core.leases import Leases
from gradientmail.core.records import Claim, Commit, Included, Manifest, Snapshot

if TYPE_CHECKING:
    from gradientmail.core.rules import Rules

__all__ = [
    "HEAD_EVERY",
    "READ_AHEAD",
    "READ_AHEAD_BYTES",
    "ClaimRound",
    "Closing",
    "Context",
    "Decision",
    "Done",
    "RoundState",
    "RoundView",
    "RoundWatch",
    "Wait",
    "attentive",
    "decide",
    "designated",
    "expected",
    "include",
    "outer_sum",
    "outer_weights",
    "rank",
    "step",
    "writes_head",
]

HEAD_EVERY = 4
"""A closer updates a fragment's ``heads/`` hint at every ``HEAD_EVERY``-th commit of it, so a
reader usually walks fewer than ``HEAD_EVERY`` commits past the hint (one GET each), and three
rounds in four cost one PUT less (S3 prices a PUT like about twelve GETs)."""

READ_AHEAD = 8
"""A close's snapshot reads name at most this many keys at once (the one read and the next):
the shell fetches them together and keeps each until its turn, so a round of ``n`` snapshots
waits on about ``n / READ_AHEAD`` round trips (64 snapshots read one at a time under a 0.3 s
latency took two minutes in the simulator)."""

READ_AHEAD_BYTES = 64 << 20
"""...and at most this many bytes of listed snapshot objects (the largest listed size times the
keys named): what a close may hold besides its sum. Snapshots larger than half of it are read
one at a time."""


# -- when a round may close, and who closes it ------------------------------------------------


@attrs.frozen(kw_only=True)
class RoundView:
    """What a node has read of round ``round``: the reporters listed under its snapshots
    (sorted), the reporters of the fragment's previous round (None for a fragment's first
    round), the claims read, whether its commit exists, and ``peers``: the nodes it has seen
    report in any round (sorted), which a fragment's first round also expects while the
    observer's lease view does not list them yet."""

    round: int
    reporters: tuple[str, ...]
    previous_reporters: tuple[str, ...] | None
    claims: tuple[Claim, ...] = ()
    committed: bool = False
    peers: tuple[str, ...] = ()


@attrs.frozen(kw_only=True)
class RoundWatch:
    """A node's timers for one round, on its own clock (seconds): since when it has seen a
    quorum, the round open, each attempt's claim (``claim_seen``), and each attempt's claimant
    expired (``expired_seen``)."""

    round: int
    quorum_since: float | None = None
    open_since: float | None = None
    claim_seen: tuple[tuple[int, float], ...] = ()
    expired_seen: tuple[tuple[int, float], ...] = ()

    def seen(self, attempt: int) -> float | None:
        return dict(self.claim_seen).get(attempt)

    def expired(self, attempt: int) -> float | None:
        return dict(self.expired_seen).get(attempt)


@attrs.frozen(kw_only=True)
class ClaimRound:
    """Create ``claims/<attempt>`` and, if that wins, close the round."""

    round: int
    attempt: int
    reason: str


@attrs.frozen(kw_only=True)
class Done:
    reason: str


Decision = ClaimRound | Wait | Done


@functools.lru_cache(maxsize=65536)
def rank(r: int, node: str) -> int:
    """Where ``node`` stands among round ``r``'s candidate closers: a stable hash of both
    (blake2b, never Python's salted ``hash``), lowest first. Memoized: every observer of a
    round asks it of every reporter at each step."""
    digest = hashlib.blake2b(f"{r}/{node}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def designated(
    reporters: Sequence[str], r: int, attempt: int, leases: Leases, *, now: float, timeout: float
) -> tuple[str, ...]:
    """Attempt ``attempt``'s candidate closers of round ``r``, in order: the live reporters by
    ``rank``, turned by the attempt. A node's place does not depend on who else reported, so
    a node can predict the closer from the nodes the round expects (Decision 8); nor on
    whether a reporter has left: a leaving node waits for the rounds it reported in anyway
    (Decision 11), and observers learn of a leave at different LISTs, so an order that put
    leaving nodes last had each node of a run that closed at once wait for another
    (docs/decisions.md, "Closers: staggered fallbacks")."""
    ordered = _ordered(r, tuple(reporters))
    if not ordered:
        return ()
    live = leases.live(now=now, lease_timeout=timeout)
    # Attempt a is led by the a-th live node of the order (Decision 2).
    return tuple(_rotate([n for n in ordered if n in live], attempt))


@functools.lru_cache(maxsize=4096)
def _ordered(r: int, reporters: tuple[str, ...]) -> tuple[str, ...]:
    """``reporters`` by ``rank`` in round ``r`` (memoized: the same few sets are asked at
    every step of a round)."""
    return tuple(sorted(reporters, key=lambda node: (rank(r, node), node)))


def _rotate(nodes: list[str], by: int) -> list[str]:
    if not nodes:
        return nodes
    shift = by % len(nodes)
    return nodes[shift:] + nodes[:shift]


def decide(
    view: RoundView,
    watch: RoundWatch,
    leases: Leases,
    *,
    me: str,
    algorithm: DiLoCo,
    now: float,
    lease_timeout: float,
    takeover: float,
) -> tuple[RoundWatch, Decision]:
    """What ``me`` should do about round ``view.round`` now (``me`` may be an observer that
    is no candidate, as ``gradientmail status`` is: the reason says why the round waits)."""
    if watch.round != view.round:
        raise ValueError(f"watch of round {watch.round} used for round {view.round}")
    if view.committed:
        return watch, Done(reason=f"round {view.round} is committed")
    watch, closable = _closable(view, watch, leases, algorithm, now, lease_timeout)
    if isinstance(closable, Wait):
        return watch, closable
    for claim in view.claims:
        if watch.seen(claim.attempt) is None:
            watch = attrs.evolve(watch, claim_seen=(*watch.claim_seen, (claim.attempt, now)))
    if view.claims:
        last = max(view.claims, key=lambda c: c.attempt)
        # Seen expired: a lease this node has listed and watched go stale. A claimant whose
        # lease it has not listed yet (a view older than the claim) is no evidence of death;
        # its attempt is taken over ``takeover * 2**a`` after the claim was seen instead.
        if (
            watch.expired(last.attempt) is None
            and last.node in leases.by_node
            and leases.expired(last.node, now=now, lease_timeout=lease_timeout)
        ):
            watch = attrs.evolve(watch, expired_seen=(*watch.expired_seen, (last.attempt, now)))
    attempt, opened = _open_attempt(view, watch, leases, now, lease_timeout, takeover)
    if isinstance(opened, Wait):
        return watch, opened
    candidates = designated(
        view.reporters, view.round, attempt, leases, now=now, timeout=lease_timeout
    )
    if me not in candidates:
        return watch, Wait(
            until=None, reason=f"{me} is not a candidate closer of attempt {attempt}"
        )
    turn = opened + candidates.index(me) * takeover
    if now < turn:
        return watch, Wait(
            until=turn, reason=f"{candidates[0]} closes attempt {attempt} unless it stays silent"
        )
    return watch, ClaimRound(
        round=view.round,
        attempt=attempt,
        reason=f"{me} is candidate {candidates.index(me)} of attempt {attempt}",
    )


def expected(
    previous_reporters: Sequence[str] | None,
    peers: Sequence[str],
    leases: Leases,
    *,
    now: float,
    lease_timeout: float,
) -> frozenset[str]:
    """The nodes round closing waits for: the active ones that reported in the fragment's
    previous round, or for a fragment's first round every active node and every node seen
    reporting that the lease view does not list yet."""
    active = leases.active(now=now, lease_timeout=lease_timeout)
    if previous_reporters is None:
        return active | (set(peers) - set(leases.by_node))
    return active & frozenset(previous_reporters)


def attentive(state: RoundState, ctx: Context, *, now: float) -> float | None:
    """None when this node reads round ``state.round``'s view every poll (Decision 8), else
    when it will (node's clock: ``takeover`` seconds after it first left the round).

    It reads every poll when it is the closer it predicts (attempt 0's first candidate among
    the nodes the round expects, itself included), or the next candidate until it sees that
    one's snapshot; when it cannot predict one (the fragment's previous commit is unknown to
    it); while it closes; and once the round has stayed uncommitted ``takeover`` seconds since
    it left it to that closer (a takeover candidate past its timeout), until a read finds the
    round not yet closable (``step`` then starts ``since`` over): a round that waits for
    stragglers costs each other reporter one read per ``takeover`` seconds, not one per poll.
    Any other reporter leaves the round to that closer and learns of the commit from the
    learner's poll, so a healthy round costs one or two nodes their LISTs, not every node."""
    if state.closing is not None or state.stale or state.watch.open_since is not None:
        return None
    late = (now if state.since is None else state.since) + ctx.takeover
    if now >= late:
        return None
    r = state.round
    previous = previous_round(ctx.algorithm, r)
    if previous < 0:
        before: tuple[str, ...] | None = None
    else:
        commit = ctx.commits.get(previous)
        if commit is None:
            return None
        before = tuple(i.node for i in commit.included)
    waited = expected(
        before, sorted(ctx.peers), ctx.leases, now=now, lease_timeout=ctx.lease_timeout
    )
    reporters = sorted(waited | {ctx.me})
    candidates = designated(reporters, r, 0, ctx.leases, now=now, timeout=ctx.lease_timeout)
    if not candidates or candidates[0] == ctx.me:
        return None
    # The understudy: the closer should that one not report (a node's rank does not depend on
    # the others'), so it reads the round until it sees the predicted closer's snapshot.
    if candidates[1:2] == (ctx.me,) and candidates[0] not in (state.reporters or ()):
        return None
    return late


def _closable(
    view: RoundView,
    watch: RoundWatch,
    leases: Leases,
    algorithm: DiLoCo,
    now: float,
    lease_timeout: float,
) -> tuple[RoundWatch, Wait | None]:
    reporters = set(view.reporters)
    if not reporters:
        return watch, Wait(until=None, reason=f"round {view.round} has no snapshot yet")
    waited = expected(
        view.previous_reporters, view.peers, leases, now=now, lease_timeout=lease_timeout
    )
    if not waited <= reporters:
        if len(reporters) < algorithm.quorum_size:
            return watch, Wait(
                until=None,
                reason=(
                    f"round {view.round}: {len(reporters)} of quorum {algorithm.quorum_size}, "
                    f"waiting for {sorted(waited - reporters)}"
                ),
            )
        if watch.quorum_since is None:
            watch = attrs.evolve(watch, quorum_since=now)
        assert watch.quorum_since is not None
        deadline = watch.quorum_since + algorithm.grace
        if now < deadline:
            return watch, Wait(
                until=deadline,
                reason=f"round {view.round}: grace for {sorted(waited - reporters)}",
            )
    if watch.open_since is None:
        watch = attrs.evolve(watch, open_since=now)
    return watch, None


def _open_attempt(
    view: RoundView,
    watch: RoundWatch,
    leases: Leases,
    now: float,
    lease_timeout: float,
    takeover: float,
) -> tuple[int, float | Wait]:
    """The attempt that may be claimed next and since when, or why none may be yet."""
    if not view.claims:
        return 0, watch.open_since if watch.open_since is not None else now
    last = max(view.claims, key=lambda c: c.attempt)
    seen = watch.seen(last.attempt)
    seen = now if seen is None else seen
    expired = watch.expired(last.attempt)
    if expired is not None and leases.expired(last.node, now=now, lease_timeout=lease_timeout):
        # A fixed opening time, so the fallback candidates' turns (i * takeover later) arrive:
        # when this node first judged the claimant expired (or saw the claim, if later). Not
        # the lease's own age: a time of this node's, so what the view keeps of a lease's
        # age stops mattering once it is past ``lease_timeout`` (specs/README.md).
        return last.attempt + 1, max(seen, expired)
    deadline = seen + takeover * 2**last.attempt
    if now >= deadline:
        return last.attempt + 1, deadline
    return last.attempt + 1, Wait(
        until=deadline,
        reason=f"attempt {last.attempt} of round {view.round} is {last.node}'s",
    )


# -- what a commit includes and how it weighs it ----------------------------------------------


def include(
    algorithm: DiLoCo, r: int, snapshots: Sequence[tuple[str, Snapshot]]
) -> tuple[list[Included], list[tuple[str, str]]]:
    """Which of the read snapshots (``(key_node, record)``) a commit of ``r`` includes, sorted
    by node, and the excluded ones with the reason. A snapshot counts only when its record
    names the node and round of its key and is based on the fragment's previous commit."""
    base = previous_round(algorithm, r)
    chosen: list[Included] = []
    excluded: list[tuple[str, str]] = []
    for node, record in sorted(snapshots, key=lambda item: item[0]):
        if record.node != node or record.round != r:
            excluded.append((node, f"record names {record.node} round {record.round}"))
        elif record.base_round != base:
            excluded.append((node, f"based on round {record.base_round}, not {base}"))
        else:
            chosen.append(Included.of(record))
    return chosen, excluded


def outer_weights(
    algorithm: DiLoCo,
    included: Sequence[Included],
    norms: Mapping[str, float] | None = None,
) -> list[float]:
    """Weights of the outer gradient ``sum(w_i * delta_i)``: samples-weighted and normalized to
    H steps, ``w_i = s_i * H / steps_i / sum(s)`` (Decision 5), so a delta that spans more
    steps (a slow or rebased node) counts by its samples without amplifying the outer step.

    With ``algorithm.clip`` set, each weight also carries its delta's clip factor
    (``robust.clip_scales``; ``norms`` maps each included node to its delta's L2 norm and is
    then required). The closer computes the same gradient as ``outer_sum`` states it."""
    weights, scale = outer_sum(algorithm, included, norms)
    return [w * scale for w in weights]


def outer_sum(
    algorithm: DiLoCo,
    included: Sequence[Included],
    norms: Mapping[str, float] | None = None,
) -> tuple[list[float], float]:
    """How a closer computes the outer gradient, in F32: ``scale * sum(w_i * delta_i)``, the
    products and sums rounded in ``included``'s order (a backend's ``weighted_sum``).

    ``w_i = s_i * H / steps_i / s_0`` (times the clip factor when ``algorithm.clip`` is set)
    and ``scale = s_0 / sum(s)``: ``outer_weights`` factored so that a closer can add each
    delta to the sum as it reads it, before it knows the other snapshots' samples (only the
    first one's, ``s_0``). Everyone who recomputes a commit (the audit, the simulator) takes
    these numbers."""
    total = sum(i.samples for i in included)
    if total <= 0:
        raise ValueError("a commit needs at least one snapshot with samples")
    first = included[0].samples
    weights = [_sum_weight(algorithm, i.samples, i.steps, first) for i in included]
    scale = first / total
    if algorithm.clip is None:
        return weights, scale
    if norms is None:
        raise ValueError("algorithm.clip is set: outer_sum needs the deltas' norms")
    scales = robust.clip_scales(
        included, norms, inner_steps=algorithm.inner_steps, clip=algorithm.clip
    )
    return [w * scales[i.node] for w, i in zip(weights, included, strict=True)], scale


def _sum_weight(algorithm: DiLoCo, samples: int, steps: int, first: int) -> float:
    """A delta's weight in the closer's sum before the clip (``outer_sum``)."""
    return samples * algorithm.inner_steps / steps / first


def writes_head(algorithm: DiLoCo, committed: int) -> bool:
    """Whether the closer of round ``committed`` updates its fragment's ``heads/`` hint: at
    the fragment's first commit and every ``HEAD_EVERY``-th after it."""
    return (committed // algorithm.fragments) % HEAD_EVERY == 0


# -- one watched round, and its close -----------------------------------------------------


@attrs.frozen(kw_only=True)
class Context:
    """What a round's rule reads besides the round itself: the node, the run, its settings and
    the syncer's other knowledge (leases, known commits, peers)."""

    me: str
    process: str
    manifest: Manifest
    leases: Leases
    commits: Mapping[int, Commit]
    peers: frozenset[str]
    members: frozenset[str] | None  # signed runs: the reporters that count (verified leases)
    lease_timeout: float
    takeover: float
    poll_interval: float
    outlier_factor: float | None
    rules: Rules
    hurried: frozenset[int] = frozenset()  # rounds this node's training waits for (Hurry)
    busy: bool = False  # another round's close is running: this one may not begin its own
    settling: bool = False  # a lease LIST is being read: decide on the view it makes

    @property
    def algorithm(self) -> DiLoCo:
        return self.manifest.algorithm


Phase = Literal["claim", "check", "list", "read", "sum", "base", "load", "write", "commit", "lost"]


@attrs.frozen(kw_only=True)
class Closing:
    """A close in progress: its attempt, the claim's nonce, when it began (node's clock), the
    step it waits on, and what it has gathered. ``reading``: the nodes whose snapshots are
    still to read and sum, in order, each with the snapshot keys (slots) still to try, the
    first one in hand; ``waiting``: its record, once read; ``chosen``: the snapshots in the
    sum, and ``slots`` the key each was read at; ``measure``: whether their norms are
    measured; ``final``: on the second pass, the snapshots that stay after outliers and the
    clip; ``ahead``: how many keys each read names (``READ_AHEAD``)."""

    attempt: int
    nonce: str
    started: float
    phase: Phase
    reading: tuple[tuple[str, tuple[int, ...]], ...] = ()
    waiting: Snapshot | None = None
    chosen: tuple[Included, ...] = ()
    slots: tuple[tuple[str, int], ...] = ()
    measure: bool = False
    norms: tuple[tuple[str, float], ...] = ()
    final: tuple[Included, ...] | None = None
    commit: Commit | None = None
    ahead: int = 1


@attrs.frozen(kw_only=True)
class RoundState:
    """One round this node watches (it has a snapshot in it): its timers, the view last read
    (``reporters``, ``claims``), the close this node is making of it, if any, and whether it
    is committed. The view is read again at ``due`` (node's clock): a poll interval after the
    last read, or sooner when a timer of the round runs out before it opens (the round opens
    on a view read then, so its candidates agree on who closes it); at once when ``poked`` (a
    bell: this node's snapshot is out). ``stale``: it must be read again before the rules
    decide on it (a close of this node's ended without a commit); ``listing``: LISTs in
    flight. ``since``: when this node last left the round to the closer it predicts;
    ``attentive``: whether it reads the round's view every poll (``attentive``), or leaves
    that to that closer until ``takeover`` seconds after ``since`` (Decision 8); a read then
    that finds the round not yet closable leaves it again (``since`` starts over).
    ``refused``: the snapshot keys (node, slot) a close of this node's found holding no
    snapshot it can use (a squatter's object, a corrupt one, or too large): they never
    change, so they are not read again, and a node whose listed keys are all refused is not a
    reporter. ``retake``: a close of this node's ended to decide again on such a view, so its
    own claim does not hold the round: the rules decide as if it were absent, and a close takes
    it up again."""

    round: int
    watch: RoundWatch
    reporters: tuple[str, ...] | None = None
    refused: frozenset[tuple[str, int]] = frozenset()
    retake: bool = False
    claims: tuple[Claim, ...] = ()
    due: float = -math.inf
    stale: bool = False
    poked: bool = True
    listing: int = 0
    closing: Closing | None = None
    committed: bool = False
    since: float | None = None
    attentive: bool = True

    @classmethod
    def new(cls, r: int) -> RoundState:
        return cls(round=r, watch=RoundWatch(round=r))

    @property
    def over(self) -> bool:
        """Committed (by anyone) and no close of this node's still running."""
        return self.committed and self.closing is None


Outcome = tuple[RoundState, list[Effect], float | None, str]


def step(state: RoundState, results: Sequence[Result], ctx: Context, *, now: float) -> Outcome:
    """Round ``state.round`` after ``results`` (of the effects it asked for): its next effects,
    the time (node's clock) it next wants to be looked at (None: only when a result arrives),
    and why. A close in progress goes on; otherwise the view is read when ``stale`` and the
    rules decide (``ctx.rules.decide``)."""
    effects: list[Effect] = []
    for result in results:
        state, more = _fold(state, result, ctx, now)
        effects += more
    if state.closing is not None or state.over:
        return state, effects, None, _doing(state)

    if state.listing:
        return state, effects, None, f"round {state.round}: reading its view"
    if state.committed:
        return state, effects, None, f"round {state.round} is committed"
    late = ctx.rules.attentive(state, ctx, now=now)
    attentive = late is None
    if attentive != state.attentive:
        # A node that begins to read the round reads it at once.
        state = attrs.evolve(state, attentive=attentive, poked=attentive or state.poked)
    if late is not None:
        # Another node is the closer this node predicts: the learner's commit poll will show
        # the commit, and the round's view is read only if it is still open at ``late``
        # (Decision 8: only the designated closer and late candidates LIST).
        if state.since is None:
            state = attrs.evolve(state, since=now)
        state = attrs.evolve(state, poked=False, due=max(state.due, late))
        return state, effects, late, f"round {state.round}: left to the closer it predicts"
    refresh = state.due
    if state.poked or now >= refresh:
        return _list(state, effects)
    if state.stale or state.reporters is None:
        return state, effects, refresh, f"round {state.round}: its view is read at the next poll"
    if ctx.settling:  # decide on the newest lease view, as a takeover must (Decision 3)
        return state, effects, None, f"round {state.round}: reading the leases"
    r = state.round
    previous = previous_round(ctx.algorithm, r)
    before = ctx.commits.get(previous) if previous >= 0 else None
    claims = state.claims
    if state.retake:
        claims = tuple(c for c in claims if c.nonce != derived(ctx.process, "claim", r, c.attempt))
    view = RoundView(
        round=r,
        reporters=state.reporters,
        previous_reporters=tuple(i.node for i in before.included) if before is not None else None,
        claims=claims,
        # From commits, which are verified in a signed run: a listing could name anyone.
        peers=tuple(sorted(ctx.peers - {ctx.me})),
    )
    watch, decision = ctx.rules.decide(
        view,
        state.watch,
        ctx.leases,
        me=ctx.me,
        algorithm=ctx.algorithm,
        now=now,
        lease_timeout=ctx.lease_timeout,
        takeover=ctx.takeover,
    )
    if watch != state.watch:
        state = attrs.evolve(state, watch=watch)
    if isinstance(decision, ClaimRound) and ctx.busy:
        return state, effects, refresh, f"round {r}: waits for this node's other close"
    if isinstance(decision, ClaimRound):
        return _claim(state, decision.attempt, ctx, now, effects, decision.reason)
    if (
        state.since is not None
        and now >= state.since + ctx.takeover
        and isinstance(decision, Wait)
        and decision.until is None
        and state.watch.quorum_since is None
        and state.watch.open_since is None
    ):
        # A reporter that left the round to the closer it predicts read it late and found it
        # below quorum (waiting for reporters): nothing for a takeover to do yet, so it leaves
        # the round again for ``takeover`` seconds rather than reading it every poll.
        state = attrs.evolve(state, since=None)
    until = refresh
    if isinstance(decision, Wait) and decision.until is not None:
        until = min(refresh, decision.until)
        if state.watch.open_since is None:
            state = attrs.evolve(state, due=until)  # a timer: read the view as it runs out
    return state, effects, until, decision.reason


def poke(state: RoundState) -> RoundState:
    """Read the view again at the round's next step (a bell: this node's snapshot is out)."""
    return attrs.evolve(state, poked=True)


def _doing(state: RoundState) -> str:
    if state.closing is not None:
        return (
            f"round {state.round}: closing attempt {state.closing.attempt}, {state.closing.phase}"
        )
    return f"round {state.round} is committed"


def _list(state: RoundState, effects: list[Effect]) -> Outcome:
    """Read the round's view: its snapshots, and its claims once it may close. The snapshots
    are read again while the round is open too: observers that opened it on different views
    (one saw fewer reporters when its grace ran out) then agree within a poll on who closes
    it, rather than each waiting a takeover timeout for a closer that waits on another."""
    r, opened = state.round, state.watch.open_since is not None
    lists: list[Effect] = [ListSnapshots(round=r)]
    if opened:
        lists.append(ListClaims(round=r))
    state = attrs.evolve(state, poked=False, listing=len(lists))
    return state, effects + lists, None, f"round {r}: reading its view"


def _claim(
    state: RoundState, attempt: int, ctx: Context, now: float, effects: list[Effect], why: str
) -> Outcome:
    r = state.round
    nonce = derived(ctx.process, "claim", r, attempt)
    claim = Claim(node=ctx.me, nonce=nonce, round=r, attempt=attempt)
    closing = Closing(attempt=attempt, nonce=nonce, started=now, phase="claim")
    state = attrs.evolve(state, closing=closing, retake=False)
    return state, [*effects, CreateClaim(claim=claim)], None, why


def _every(state: RoundState, ctx: Context) -> float:
    """Seconds until the round's view is read again: a poll interval, or a ``HURRY_POLLS``-th
    of one while this node's training waits for the round's commit."""
    if state.round in ctx.hurried:
        return ctx.poll_interval / HURRY_POLLS
    return ctx.poll_interval


def _fold(
    state: RoundState, result: Result, ctx: Context, now: float
) -> tuple[RoundState, list[Effect]]:
    """One result into the round: the view's LISTs, or the close's next step."""
    if isinstance(result, SnapshotsListed) and state.closing is None:
        listed = (node for node, slot, _ in result.sizes if (node, slot) not in state.refused)
        nodes = tuple(dict.fromkeys(listed))
        if ctx.members is not None:
            nodes = robust.members(nodes, ctx.members)
        listing = max(0, state.listing - 1)
        due = now + _every(state, ctx)
        state = attrs.evolve(state, reporters=nodes, listing=listing, stale=False, due=due)
        return state, []
    if isinstance(result, ClaimsRead) and state.closing is None:
        listing = max(0, state.listing - 1)
        due = now + _every(state, ctx)
        state = attrs.evolve(state, claims=result.claims, listing=listing, stale=False, due=due)
        return state, []
    if state.closing is None:
        return state, []
    return _advance(state, state.closing, result, ctx, now)


def _advance(
    state: RoundState, closing: Closing, result: Result, ctx: Context, now: float
) -> tuple[RoundState, list[Effect]]:
    r = state.round
    if closing.phase == "claim" and isinstance(result, Created):
        if ctx.rules.ours(result, closing.nonce):
            return _won(state, closing)
        return _set(state, closing, phase="check"), [ReadClaim(round=r, attempt=closing.attempt)]
    if closing.phase == "check" and isinstance(result, ClaimRead):
        if result.claim is not None and result.claim.nonce != closing.nonce:
            return _abort(state), []  # another closer's valid claim
        # The key holds no valid claim (a forgery or garbage, reported): a claim only spares
        # duplicate work, and the create-only commit still commits the round once.
        return _won(state, closing)
    if closing.phase == "list" and isinstance(result, SnapshotsListed):
        return _listed(state, closing, result, ctx, now)
    if closing.phase == "read" and isinstance(result, SnapshotRead):
        return _snapshot(state, closing, result, ctx, now)
    if closing.phase == "sum" and isinstance(result, Accumulated):
        return _accumulated(state, closing, result, ctx)
    if closing.phase == "base" and isinstance(result, CommitRead):
        return _base_read(state, closing, result, ctx)
    if closing.phase == "load" and isinstance(result, BaseRead):
        return _loaded(state, closing, result, ctx)
    if closing.phase == "write" and isinstance(result, Written):
        return _written(state, closing, result, ctx)
    if closing.phase == "commit" and isinstance(result, Created):
        return _created(state, closing, result, ctx, now)
    if closing.phase == "lost" and isinstance(result, CommitRead):
        state, effects = _meanwhile(attrs.evolve(state, closing=None), result)
        return state, [*effects, Drop(round=r)]
    return state, []


def _set(state: RoundState, closing: Closing, **changes: Any) -> RoundState:
    return attrs.evolve(state, closing=attrs.evolve(closing, **changes))


def _abort(state: RoundState) -> RoundState:
    """The close stops; the round is looked at again once its view is read at the next poll."""
    return attrs.evolve(state, closing=None, stale=True)


def _won(state: RoundState, closing: Closing) -> tuple[RoundState, list[Effect]]:
    r = state.round
    report = Claimed(round=r, attempt=closing.attempt)
    return _set(state, closing, phase="list"), [report, ListSnapshots(round=r)]


def _listed(
    state: RoundState, closing: Closing, result: SnapshotsListed, ctx: Context, now: float
) -> tuple[RoundState, list[Effect]]:
    r = state.round
    bound = robust.snapshot_bound(ctx.manifest.fragment_schema(r % ctx.algorithm.fragments))
    effects: list[Effect] = []
    slots: dict[str, list[int]] = {}
    refused = set(state.refused)
    for node, slot, size in sorted(result.sizes):
        if (node, slot) in refused:
            continue
        too_big = robust.oversized(size, bound)
        if too_big is not None:
            effects.append(Excluded(round=r, node=node, reason=too_big, slot=slot))
            refused.add((node, slot))
        else:
            slots.setdefault(node, []).append(slot)
    reading = tuple((node, tuple(found)) for node, found in slots.items())
    state = attrs.evolve(state, refused=frozenset(refused))
    gone = tuple(node for node in state.reporters or () if node not in slots)
    if gone:
        state, held = _drop_reporters(state, gone, ctx, now)
        if held is not None:
            return held[0], effects + held[1]
    measure = robust.needs_norms(len(reading), factor=ctx.outlier_factor, clip=ctx.algorithm.clip)
    largest = max((size for node, slot, size in result.sizes if node in slots), default=0)
    ahead = max(1, min(READ_AHEAD, READ_AHEAD_BYTES // max(1, largest)))
    closing = attrs.evolve(closing, reading=reading, measure=measure, ahead=ahead)
    state, more = _read_next(state, closing, ctx)
    return state, effects + more


def _drop_reporters(
    state: RoundState, gone: Sequence[str], ctx: Context, now: float
) -> tuple[RoundState, tuple[RoundState, list[Effect]] | None]:
    """Reporters of the view whose every listed snapshot key the close refused (a squatter's
    objects under their names, core.slots) are no reporters: take them out of the view. When
    the round is still closable without them (``_closable``: every expected node reported, or
    the quorum's grace ran out), the close goes on without them; otherwise it ends, and the
    round is decided again on the view without them (its own claim is taken up again). So a
    squatter can delay a round by at most its grace, however many keys it plants."""
    reporters = tuple(n for n in state.reporters or () if n not in gone)
    state = attrs.evolve(state, reporters=reporters)
    r = state.round
    previous = previous_round(ctx.algorithm, r)
    before = ctx.commits.get(previous) if previous >= 0 else None
    view = RoundView(
        round=r,
        reporters=reporters,
        previous_reporters=tuple(i.node for i in before.included) if before is not None else None,
        claims=(),
        peers=tuple(sorted(ctx.peers - {ctx.me})),
    )
    watch, wait = _closable(view, state.watch, ctx.leases, ctx.algorithm, now, ctx.lease_timeout)
    state = attrs.evolve(state, watch=watch)
    if wait is None:
        return state, None
    ended = attrs.evolve(_abort(state), retake=True)
    return state, (ended, [Drop(round=r)])


def _read_next(
    state: RoundState, closing: Closing, ctx: Context
) -> tuple[RoundState, list[Effect]]:
    """Read the next snapshot to sum, or end the pass when none is left."""
    if closing.reading:
        node, slots = closing.reading[0]
        ahead = tuple((n, found[0]) for n, found in closing.reading[1 : closing.ahead])
        read = ReadSnapshot(round=state.round, node=node, slot=slots[0], ahead=ahead)
        return _set(state, closing, phase="read", waiting=None), [read]
    if closing.final is not None:
        return _based(state, closing, ctx)
    return _summed(state, closing, ctx)


def _skip(
    state: RoundState, closing: Closing, ctx: Context, effects: list[Effect]
) -> tuple[RoundState, list[Effect]]:
    """The snapshot in hand is not summed: on to the next one."""
    state, more = _read_next(state, attrs.evolve(closing, reading=closing.reading[1:]), ctx)
    return state, effects + more


def _snapshot(
    state: RoundState, closing: Closing, result: SnapshotRead, ctx: Context, now: float
) -> tuple[RoundState, list[Effect]]:
    r, node = state.round, result.node
    if not closing.reading or (node, result.slot) != _in_hand(closing):
        return state, []
    if closing.final is not None:  # the second pass: the very snapshot summed the first time
        wanted = closing.final[len(closing.chosen)]
        if result.record is None or Included.of(result.record) != wanted:
            why = result.rejected or "changed or gone between the two passes of its close"
            return _failed(state, closing, keys.snapshot(r, node, result.slot), why)
        weights, _ = outer_sum(ctx.algorithm, closing.final, dict(closing.norms))
        return _sum(state, closing, result.record, weights[len(closing.chosen)])
    if result.rejected is not None:
        report = Excluded(round=r, node=node, reason=result.rejected, slot=result.slot)
        state = attrs.evolve(state, refused=state.refused | {(node, result.slot)})
        later = closing.reading[0][1][1:]
        if later:  # the key is squatted: the node's next key (core.slots)
            closing = attrs.evolve(closing, reading=((node, later), *closing.reading[1:]))
            state, more = _read_next(state, closing, ctx)
            return state, [report, *more]
        if node in (state.reporters or ()):
            state, held = _drop_reporters(state, (node,), ctx, now)
            if held is not None:
                return held[0], [report, *held[1]]
        return _skip(state, closing, ctx, [report])
    if result.record is None:
        return _skip(state, closing, ctx, [])
    _, excluded = include(ctx.algorithm, r, [(node, result.record)])
    if excluded:
        reports: list[Effect] = [
            Excluded(round=r, node=n, reason=why, slot=result.slot) for n, why in excluded
        ]
        return _skip(state, closing, ctx, reports)
    record = result.record
    first = closing.chosen[0].samples if closing.chosen else record.samples
    return _sum(
        state, closing, record, _sum_weight(ctx.algorithm, record.samples, record.steps, first)
    )


def _in_hand(closing: Closing) -> tuple[str, int]:
    """The node and snapshot key of the snapshot being read."""
    node, slots = closing.reading[0]
    return node, slots[0]


def _sum(
    state: RoundState, closing: Closing, record: Snapshot, weight: float
) -> tuple[RoundState, list[Effect]]:
    effect = Accumulate(
        round=state.round,
        node=record.node,
        weight=weight,
        start=not closing.chosen,
        norm=closing.measure and closing.final is None,
    )
    return _set(state, closing, phase="sum", waiting=record), [effect]


def _accumulated(
    state: RoundState, closing: Closing, result: Accumulated, ctx: Context
) -> tuple[RoundState, list[Effect]]:
    r, node = state.round, result.node
    if not closing.reading or node != closing.reading[0][0] or closing.waiting is None:
        return state, []
    _, slot = _in_hand(closing)
    if result.rejected is not None:
        if closing.final is not None:
            return _failed(state, closing, keys.snapshot(r, node, slot), result.rejected)
        report = Excluded(round=r, node=node, reason=result.rejected, slot=slot)
        return _skip(state, closing, ctx, [report])
    norms = closing.norms
    if result.norm is not None:
        norms = (*norms, (node, result.norm))
    closing = attrs.evolve(
        closing,
        reading=closing.reading[1:],
        waiting=None,
        chosen=(*closing.chosen, Included.of(closing.waiting)),
        slots=(*closing.slots, (node, slot)) if closing.final is None else closing.slots,
        norms=norms,
    )
    return _read_next(state, closing, ctx)


def _summed(state: RoundState, closing: Closing, ctx: Context) -> tuple[RoundState, list[Effect]]:
    """Every snapshot is read and the sum taken: exclude outliers and clip where the rules
    read norms; when either changes a weight, take the sum again over those that stay."""
    r, chosen = state.round, closing.chosen
    if not robust.needs_norms(len(chosen), factor=ctx.outlier_factor, clip=ctx.algorithm.clip):
        return _based(state, closing, ctx)
    norms = dict(closing.norms)
    out = robust.outliers(
        chosen, norms, inner_steps=ctx.algorithm.inner_steps, factor=ctx.outlier_factor
    )
    dropped = {node for node, _ in out}
    read_at = dict(closing.slots)
    effects: list[Effect] = [
        Excluded(round=r, node=n, reason=why, slot=read_at.get(n, 0)) for n, why in out
    ]
    final = tuple(i for i in chosen if i.node not in dropped)
    scales: dict[str, float] = {}
    if ctx.algorithm.clip is not None and final:
        scales = robust.clip_scales(
            final, norms, inner_steps=ctx.algorithm.inner_steps, clip=ctx.algorithm.clip
        )
        effects += [
            Clipped(round=r, node=n, factor=f, slot=read_at[n])
            for n, f in sorted(scales.items())
            if f < 1
        ]
    if final == chosen and all(f == 1.0 for f in scales.values()):
        state, more = _based(state, closing, ctx)
        return state, effects + more
    if not final:
        state, more = _based(state, attrs.evolve(closing, chosen=()), ctx)
        return state, effects + more
    reading = tuple((i.node, (read_at[i.node],)) for i in final)
    again = attrs.evolve(closing, reading=reading, chosen=(), final=final)
    state, more = _read_next(state, again, ctx)
    return state, effects + more


def _based(state: RoundState, closing: Closing, ctx: Context) -> tuple[RoundState, list[Effect]]:
    """Something to commit: find the outer step's starting point. Nothing: see whether
    another closer committed the round meanwhile."""
    r = state.round
    if not closing.chosen:
        return _set(state, closing, phase="lost"), [ReadCommit(round=r)]
    previous = previous_round(ctx.algorithm, r)
    if previous >= 0 and previous not in ctx.commits:
        return _set(state, closing, phase="base"), [ReadCommit(round=previous)]
    return _load(state, closing, ctx)


def _load(
    state: RoundState, closing: Closing, ctx: Context, *, base: Commit | None = None
) -> tuple[RoundState, list[Effect]]:
    """Load the outer state from ``base``: the fragment's previous commit (given when just
    read, else the one this node knows), or the initial parameters for its first round."""
    r = state.round
    previous = previous_round(ctx.algorithm, r)
    if base is None and previous >= 0:
        base = ctx.commits[previous]
    load = ReadOuterState(round=r, fragment=r % ctx.algorithm.fragments, base=base)
    return _set(state, closing, phase="load"), [load]


def _base_read(
    state: RoundState, closing: Closing, result: CommitRead, ctx: Context
) -> tuple[RoundState, list[Effect]]:
    r = state.round
    if result.commit is None or result.rejected is not None:
        reason = result.rejected or f"round {r}'s base round {result.round} has no commit"
        key = keys.commit(result.round) if result.rejected else keys.round_prefix(r)
        return _failed(state, closing, key, reason)
    return _load(state, closing, ctx, base=result.commit)  # the commit just read


def _loaded(
    state: RoundState, closing: Closing, result: BaseRead, ctx: Context
) -> tuple[RoundState, list[Effect]]:
    r = state.round
    k = r % ctx.algorithm.fragments
    if not result.present or result.rejected is not None:
        previous = ctx.commits.get(previous_round(ctx.algorithm, r))
        if result.rejected is not None:
            reason = result.rejected
        else:
            reason = "outer state is gone" if previous else "initial parameters are gone"
        key = previous.state.key if previous is not None else ctx.manifest.init[k].key
        return _failed(state, closing, key, reason)
    norms = dict(closing.norms) if ctx.algorithm.clip is not None else None
    _, scale = outer_sum(ctx.algorithm, closing.chosen, norms)
    step_effect = OuterStep(round=r, fragment=k, scale=scale)
    return _set(state, closing, phase="write"), [step_effect]


def _written(
    state: RoundState, closing: Closing, result: Written, ctx: Context
) -> tuple[RoundState, list[Effect]]:
    r = state.round
    if result.failed is not None or result.params is None or result.state is None:
        return _failed(
            state, closing, keys.round_prefix(r), result.failed or "payloads not written"
        )
    commit = Commit(
        round=r,
        fragment=r % ctx.algorithm.fragments,
        base_round=previous_round(ctx.algorithm, r),
        closer=ctx.me,
        attempt=closing.attempt,
        nonce=result.nonce,
        included=closing.chosen,
        params=result.params,
        state=result.state,
    )
    return _set(state, closing, phase="commit", commit=commit), ctx.rules.commit(commit)


def _created(
    state: RoundState, closing: Closing, result: Created, ctx: Context, now: float
) -> tuple[RoundState, list[Effect]]:
    commit = closing.commit
    assert commit is not None
    r = state.round
    if not ctx.rules.ours(result, commit.nonce):
        # Another attempt committed first: ours must leave no trace (Decision 2).
        lost = Delete(keys=(commit.params.key, commit.state.key))
        return _set(state, closing, phase="lost"), [lost, ReadCommit(round=r)]
    k = commit.fragment
    before = ctx.commits.get(commit.base_round)
    if before is not None:
        superseded: tuple[str, ...] = (before.params.key, before.state.key)
    else:
        superseded = (ctx.manifest.init[k].key,) if commit.base_round < 0 else ()
    effects: list[Effect] = [Committed(commit=commit, seconds=now - closing.started)]
    if writes_head(ctx.algorithm, r):
        effects.append(PutHead(fragment=k, round=r))
    effects += [Forget(keys=superseded), Drop(round=r)]
    return attrs.evolve(state, closing=None, committed=True), effects


def _failed(
    state: RoundState, closing: Closing, key: str, reason: str
) -> tuple[RoundState, list[Effect]]:
    """A read or write of the close failed: report it, then read whether another closer
    committed the round meanwhile; the round is looked at again later."""
    r = state.round
    return _set(state, closing, phase="lost"), [
        Rejected(key=key, reason=reason),
        ReadCommit(round=r),
    ]


def _meanwhile(state: RoundState, result: CommitRead) -> tuple[RoundState, list[Effect]]:
    """After a close that committed nothing: when another closer committed the round (while
    this node stalled, say), the round is over; otherwise it is looked at again."""
    state = attrs.evolve(state, stale=True)
    if result.rejected is not None:
        return state, [Rejected(key=keys.commit(state.round), reason=result.rejected)]
    if result.commit is not None:
        return attrs.evolve(state, committed=True), []
    return state, []
