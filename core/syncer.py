"""The syncer's rules: when a round may close, who closes it, when another node takes over, what
a commit includes and weighs, and what may be garbage-collected. Every decision about rounds and
quorum lives in this module; the shell gathers a ``RoundView`` and executes the ``Decision``.

Closing (docs/protocol.md has the diagram). Round ``r`` may close once it has a snapshot and
either every *expected* node has reported, or ``quorum_size`` snapshots exist and ``grace``
seconds have passed since this observer first saw them. Expected nodes are the active (live, not
left) nodes that reported in the fragment's previous round, or every active node for a
fragment's first round (with those seen reporting elsewhere whose leases this observer has not
listed yet). So a synchronous run closes as soon as everyone is in; a straggler costs
at most ``grace``; a newcomer is not waited for until it has reported once; and no cycle of
waiting nodes can stall the run, since the grace timer always runs out.

Closer. Attempt ``a``'s candidates are the round's reporters rotated by a stable hash of ``r``
plus ``a``, live ones that have not left first, then live ones that have (a leaving node still
closes its own rounds when nobody else can). Candidate ``i`` may claim ``claims/<a>`` once the
attempt has been open for ``i * takeover`` seconds: the first at once, the others only if it
stays silent. Attempt ``a+1`` opens when attempt ``a``'s claimant is seen expired, or
``takeover * 2**a`` seconds after its claim was first seen without a commit (Decision 2). Claims
and the commit are create-only, so racing closers still commit once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import attrs

from gradientmail.core import robust
from gradientmail.core.algorithm import DiLoCo
from gradientmail.core.leases import Leases
from gradientmail.core.records import Claim, Included, Snapshot

__all__ = [
    "HEAD_EVERY",
    "ClaimRound",
    "Done",
    "RoundView",
    "RoundWatch",
    "Wait",
    "decide",
    "designated",
    "include",
    "outer_weights",
    "previous_round",
    "writes_head",
]

HEAD_EVERY = 4
"""A closer updates a fragment's ``heads/`` hint at every ``HEAD_EVERY``-th commit of it, so a
reader usually walks fewer than ``HEAD_EVERY`` commits past the hint (one GET each), and three
rounds in four cost one PUT less (S3 prices a PUT like about twelve GETs)."""


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
    """A node's timers for one round, on its own clock (seconds)."""

    round: int
    quorum_since: float | None = None
    open_since: float | None = None
    claim_seen: tuple[tuple[int, float], ...] = ()

    def seen(self, attempt: int) -> float | None:
        return dict(self.claim_seen).get(attempt)


@attrs.frozen(kw_only=True)
class ClaimRound:
    """Create ``claims/<attempt>`` and, if that wins, close the round."""

    round: int
    attempt: int
    reason: str


@attrs.frozen(kw_only=True)
class Wait:
    """Nothing to do before ``until`` (seconds, observer's clock; None: until the view
    changes)."""

    until: float | None
    reason: str


@attrs.frozen(kw_only=True)
class Done:
    reason: str


Decision = ClaimRound | Wait | Done


def previous_round(algorithm: DiLoCo, r: int) -> int:
    """The fragment's round before ``r``: ``r - K``, or -1 (the manifest) for a first round."""
    return r - algorithm.fragments if r >= algorithm.fragments else -1


def rotation_seed(r: int) -> int:
    """A stable hash of the round (blake2b, never Python's salted ``hash``)."""
    return int.from_bytes(hashlib.blake2b(str(r).encode(), digest_size=8).digest(), "big")


def designated(
    reporters: Sequence[str], r: int, attempt: int, leases: Leases, *, now: float, timeout: float
) -> tuple[str, ...]:
    """Attempt ``attempt``'s candidate closers of round ``r``, in order."""
    ordered = sorted(reporters)
    if not ordered:
        return ()
    start = rotation_seed(r) % len(ordered)
    rotated = ordered[start:] + ordered[:start]
    live = leases.live(now=now, lease_timeout=timeout)
    left = leases.left()
    staying = [n for n in rotated if n in live and n not in left]
    leaving = [n for n in rotated if n in live and n in left]
    # Attempt a is led by the a-th live node of the rotation (Decision 2).
    return tuple(_rotate(staying, attempt) + _rotate(leaving, attempt))


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
    """What ``me`` should do about round ``view.round`` now."""
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
    active = leases.active(now=now, lease_timeout=lease_timeout)
    if view.previous_reporters is None:
        # A fragment's first round: every active node, and every node seen reporting that the
        # lease view has not caught up with (its lease LIST is older than that node's join).
        expected = active | (set(view.peers) - set(leases.by_node))
    else:
        expected = active & set(view.previous_reporters)
    if not expected <= reporters:
        if len(reporters) < algorithm.quorum_size:
            return watch, Wait(
                until=None,
                reason=(
                    f"round {view.round}: {len(reporters)} of quorum {algorithm.quorum_size}, "
                    f"waiting for {sorted(expected - reporters)}"
                ),
            )
        if watch.quorum_since is None:
            watch = attrs.evolve(watch, quorum_since=now)
        assert watch.quorum_since is not None
        deadline = watch.quorum_since + algorithm.grace
        if now < deadline:
            return watch, Wait(
                until=deadline,
                reason=f"round {view.round}: grace for {sorted(expected - reporters)}",
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
    if leases.expired(last.node, now=now, lease_timeout=lease_timeout):
        # A fixed opening time, so the fallback candidates' turns (i * takeover later) arrive.
        observed = leases.by_node.get(last.node)
        expired_at = observed.changed_at + lease_timeout if observed is not None else seen
        return last.attempt + 1, max(seen, expired_at)
    deadline = seen + takeover * 2**last.attempt
    if now >= deadline:
        return last.attempt + 1, deadline
    return last.attempt + 1, Wait(
        until=deadline,
        reason=f"attempt {last.attempt} of round {view.round} is {last.node}'s",
    )


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
    then required), so the backend's weighted sum needs nothing more."""
    total = sum(i.samples for i in included)
    if total <= 0:
        raise ValueError("a commit needs at least one snapshot with samples")
    weights = [i.samples * algorithm.inner_steps / i.steps / total for i in included]
    if algorithm.clip is None:
        return weights
    if norms is None:
        raise ValueError("algorithm.clip is set: outer_weights needs the deltas' norms")
    scales = robust.clip_scales(
        included, norms, inner_steps=algorithm.inner_steps, clip=algorithm.clip
    )
    return [w * scales[i.node] for w, i in zip(weights, included, strict=True)]


def writes_head(algorithm: DiLoCo, committed: int) -> bool:
    """Whether the closer of round ``committed`` updates its fragment's ``heads/`` hint: at
    the fragment's first commit and every ``HEAD_EVERY``-th after it."""
    return (committed // algorithm.fragments) % HEAD_EVERY == 0


def collectable(algorithm: DiLoCo, committed: int, *, keep: int = 2) -> int | None:
    """After round ``committed`` commits, the fragment's round whose payloads, snapshots and
    claims may be deleted (its commit record stays forever), or None. ``keep`` rounds of the
    fragment stay readable, so a reader ``keep - 1`` rounds behind still finds its params."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1 round, got {keep}")
    old = committed - keep * algorithm.fragments
    return old if old >= 0 else None
