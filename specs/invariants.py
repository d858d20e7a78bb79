"""The design brief's invariants as functions over a world: each returns None when it holds,
else a message saying what broke. ``audit`` (Decision 12) checks the same properties on a real
mailbox's records; these check the model's abstract ones, plus node-side properties only a
model can see (what a node merged and rebased).

Liveness lives in ``specs.liveness``.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise

from gradientmail.core import keys
from gradientmail.core import syncer as syncer_rules
from specs.mailbox import ClaimObj, CommitObj, SnapObj
from specs.state import World

__all__ = ["INVARIANTS", "check", "violations"]


def commit_once(world: World) -> str | None:
    """A round commits at most once."""
    for r, count in world.commit_writes:
        if count > 1:
            return f"round {r} was committed {count} times"
    return None


def _collected(world: World) -> dict[int, int]:
    """Per fragment, the newest round that may have been garbage-collected (Decision 7)."""
    algorithm = world.config.algorithm
    newest: dict[int, int] = {}
    for c in world.mailbox.commits():
        k = c.round % algorithm.fragments
        newest[k] = max(newest.get(k, -1), c.round)
    horizon = {}
    for k, r in newest.items():
        old = syncer_rules.collectable(algorithm, r)
        horizon[k] = -1 if old is None else old
    return horizon


def included_exist(world: World) -> str | None:
    """Every committed round's included snapshots exist, with those nonces and the round's
    base, and its payloads exist (until collected)."""
    algorithm = world.config.algorithm
    horizon = _collected(world)
    for c in world.mailbox.commits():
        base = syncer_rules.previous_round(algorithm, c.round)
        if c.base != base:
            return f"commit of round {c.round} has base {c.base}, not {base}"
        if c.round <= horizon.get(c.round % algorithm.fragments, -1):
            continue
        if world.mailbox.get(c.params_key) is None:
            return f"commit of round {c.round} names payload {c.params_key}, which is gone"
        for inc in c.included:
            snap = world.mailbox.get(keys.snapshot(c.round, inc.node))
            if not isinstance(snap, SnapObj) or snap.epoch != inc.epoch:
                return (
                    f"commit of round {c.round} includes {inc.node}'s snapshot, not in the mailbox"
                )
            if (snap.base, snap.lo, snap.hi, snap.steps) != (inc.base, inc.lo, inc.hi, inc.steps):
                return f"commit of round {c.round} misreports {inc.node}'s snapshot"
            if inc.base != base:
                return f"commit of round {c.round} includes a snapshot based on {inc.base}"
    return None


def chain(world: World) -> str | None:
    """A fragment's committed rounds form an unbroken chain r, r+K, r+2K, ..."""
    K = world.config.fragments
    committed = {c.round for c in world.mailbox.commits()}
    for r in committed:
        if r >= K and r - K not in committed:
            return f"round {r} committed but the fragment's previous round {r - K} did not"
    return None


def samples_once(world: World) -> str | None:
    """Each published sample of a node (per incarnation, per fragment) is counted in at most
    one commit."""
    K = world.config.fragments
    spans: dict[tuple[str, int, int], list[tuple[int, int, int]]] = {}
    for c in world.mailbox.commits():
        for inc in c.included:
            spans.setdefault((inc.node, inc.epoch, c.round % K), []).append(
                (inc.lo, inc.hi, c.round)
            )
    for (node, epoch, k), found in sorted(spans.items()):
        found.sort()
        for (_, hi, r1), (lo, _, r2) in pairwise(found):
            if lo < hi:
                return (
                    f"{node} (epoch {epoch}) samples {lo}..{hi - 1} of fragment {k} are counted "
                    f"in rounds {r1} and {r2}"
                )
    return None


def merges_forward(world: World) -> str | None:
    """A node never merges a commit older than one it holds: its ready commits are newer than
    what it merged, and no transition flagged a merge or rebase the commit contradicts."""
    if world.flags:
        return world.flags[0]
    K = world.config.fragments
    for i, node in enumerate(world.nodes):
        if node.learner is None:
            continue
        merged = [f.merged for f in node.learner.fragments]
        for c in node.ready:
            if c.round <= merged[c.round % K]:
                return f"n{i} holds round {merged[c.round % K]} yet has round {c.round} to merge"
            merged[c.round % K] = c.round
    return None


def merged_committed(world: World) -> str | None:
    """What a node merged was committed: the model holds nothing that is not a commit."""
    for i, node in enumerate(world.nodes):
        if node.learner is None:
            continue
        for f in node.learner.fragments:
            if f.merged >= 0 and not isinstance(
                world.mailbox.get(keys.commit(f.merged)), CommitObj
            ):
                return f"n{i} merged round {f.merged}, which has no commit"
    return None


def _on_mailbox(invariant: Callable[[World], str | None]) -> Callable[[World], str | None]:
    """Memoize an invariant that reads only the mailbox (and the configuration) by the
    mailbox's identity: most steps leave the mailbox as it was."""
    memo: dict[tuple[int, int], tuple[object, object, str | None]] = {}

    def checked(world: World) -> str | None:
        key = (id(world.mailbox), id(world.config))
        hit = memo.get(key)
        if hit is not None and hit[0] is world.mailbox and hit[1] is world.config:
            return hit[2]
        if len(memo) > 100_000:
            memo.clear()
        result = invariant(world)
        memo[key] = (world.mailbox, world.config, result)
        return result

    checked.__doc__ = invariant.__doc__
    return checked


def single_claim(world: World) -> str | None:
    """Without crashes or pauses, nobody takes a round over: every live closer commits within
    its poll interval, so a later attempt is wasted work (only with ``timers``, where loops
    keep their interval; Decision 2's takeover timeout exists for dead and slow closers)."""
    if not world.config.timers or world.crashes or world.pauses:
        return None
    for _, obj in world.mailbox.list(keys.ROUNDS):
        if isinstance(obj, ClaimObj) and obj.attempt > 0:
            return f"{obj.node} claimed attempt {obj.attempt} of round {obj.round} in a healthy run"
    return None


def watches_end(world: World) -> str | None:
    """A syncer stops watching a round once it is committed (Decision 8: LISTs are spent
    only on open rounds): a round the node's learner has polled past must be one its ledger
    knows committed, or the syncer would LIST it every poll, forever."""
    K = world.config.fragments
    for i, node in enumerate(world.nodes):
        for r in node.watched:
            if node.next_poll and r < node.next_poll[r % K] and node.known_commit(r) is None:
                return f"n{i} watches round {r} forever: its learner skipped that commit"
    return None


INVARIANTS: dict[str, Callable[[World], str | None]] = {
    "commit-once": commit_once,
    "included-exist": _on_mailbox(included_exist),
    "chain": _on_mailbox(chain),
    "samples-once": _on_mailbox(samples_once),
    "merges-forward": merges_forward,
    "merged-committed": merged_committed,
    "watches-end": watches_end,
    "single-claim": _on_mailbox(single_claim),
}


def violations(world: World) -> list[tuple[str, str]]:
    """Every invariant that fails, as (name, message)."""
    found = []
    for name, invariant in INVARIANTS.items():
        message = invariant(world)
        if message is not None:
            found.append((name, message))
    return found


def check(world: World) -> tuple[str, str] | None:
    """The first invariant that fails, or None."""
    for name, invariant in INVARIANTS.items():
        message = invariant(world)
        if message is not None:
            return name, message
    return None
