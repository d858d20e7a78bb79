"""Planted bugs (Decision 12): the one registry of broken rule variants.

Each entry is a ``Rules`` with one rule function swapped for a broken variant, passed to the
code under test as an argument: the Hypothesis machines (tests/core/test_stateful.py) and the
explorer give it to the world's nodes, the simulator (sim/) to its ``Node``s. Each must be
caught by all three, on the property it breaks (``BROKEN``).

- ``commit-overwrite``: the closer deletes the round's commit key before creating its record,
  so its write overwrites a commit another closer made (breaks "a round commits once").
- ``rebase-included``: the learner ignores whether the commit counted its snapshot and rebases
  it anyway (its samples count twice).
- ``no-readback``: a create that failed in transit is never read back, so a taken key always
  means another writer's: a closer deletes the payloads of its own landed commit, a node
  rebases the snapshot the round counted.
- ``no-takeover``: no later attempt is ever opened: a closer that dies after its claim leaves
  the round open forever (a liveness bug).
- ``takeover-now``: takeover without waiting (Decision 2's timeouts disabled): every reporter
  reads the round at once and every candidate claims at once; safety rests on create-only
  commits, so it shows as wasted, racing claims.
- ``skip-forgets``: a real bug the random walk found: a reader that skips commits whose
  parameters were collected judges its snapshot by the newest commit alone, rebasing progress
  an earlier, skipped commit counted.
- ``gc-too-early``: collection ignores ``keep``: it deletes the fragment's previous round as
  soon as a round commits (readers one round behind, and the audit, find payloads gone that the
  rule keeps).
- ``chain-skips``: the chain walk reads every other round going forward, so a node joining a
  run loads a commit older than the newest.
- ``stale-lease``: an observer folding a LIST ignores a newer lease of a node it has seen
  (``observe`` keeps the first record's time), so every renewed lease looks expired once
  ``lease_timeout`` has passed since it was first seen. A node's own included: a lone node's
  snapshot stops counting as a live reporter's and its round never closes (liveness); the
  simulator reports the expiry itself (lease-expired-early: called expired after a LIST showed
  it renewed).
- ``leave-early``: a leaving node's lease says ``left`` as soon as its training side is done,
  before its last snapshots are under their keys (the race behind session 29's CI failure): a
  closer that sees the lease ``left`` closes the round without the snapshot still uploading
  (breaks "a ``left`` lease finds its snapshots", Decision 11).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from gradientmail.core import chain, closing, keys, learner, leases
from gradientmail.core.algorithm import DiLoCo
from gradientmail.core.effects import (
    CommitRead,
    CreateCommit,
    Created,
    Delete,
    Effect,
    HeadRead,
    ReadCommit,
    Wait,
)
from gradientmail.core.learner import LearnerState
from gradientmail.core.records import Commit
from gradientmail.core.rules import RULES, Rules

__all__ = ["BROKEN", "BUGS", "rules_for"]


def _overwrite(commit: Commit) -> list[Effect]:
    return [Delete(keys=(keys.commit(commit.round),)), CreateCommit(commit=commit)]


def _rebase_included(
    state: LearnerState, algorithm: DiLoCo, *, round: int, included: bool
) -> tuple[LearnerState, list[learner.Effect]]:
    return learner.on_commit(state, algorithm, round=round, included=False)


def _no_readback(created: Created, nonce: str) -> bool:
    return created.outcome == "created"


def _no_takeover(*args: Any, **kwargs: Any) -> tuple[closing.RoundWatch, closing.Decision]:
    watch, decision = closing.decide(*args, **kwargs)
    if isinstance(decision, closing.ClaimRound) and decision.attempt > 0:
        return watch, Wait(until=None, reason="planted bug: no takeover")
    return watch, decision


def _takeover_now(*args: Any, **kwargs: Any) -> tuple[closing.RoundWatch, closing.Decision]:
    return closing.decide(*args, **{**kwargs, "takeover": 0.0})


def _attentive_now(state: closing.RoundState, ctx: closing.Context, *, now: float) -> float | None:
    # The same timeout disabled where a reporter waits before reading a round it leaves to
    # the closer it predicts: every reporter reads and decides at once.
    return closing.attentive(state, attrs.evolve(ctx, takeover=0.0), now=now)


def _skip_forgets(
    counted: frozenset[tuple[str, str]], skipped: Commit, newest: Commit
) -> frozenset[tuple[str, str]]:
    return frozenset((i.node, i.nonce) for i in newest.included)


def _gc_too_early(algorithm: DiLoCo, committed: int, *, keep: int = 2) -> int | None:
    old = committed - algorithm.fragments
    return old if old >= 0 else None


def _chain_skips(
    walk: chain.Walk, result: HeadRead | CommitRead
) -> tuple[chain.Walk, list[Effect]]:
    walk, effects = chain.advance(walk, result)
    if walk.phase != "forward":
        return walk, effects
    K = walk.algorithm.fragments
    return walk, [
        attrs.evolve(e, round=e.round + K) if isinstance(e, ReadCommit) else e for e in effects
    ]


def _stale_lease(
    view: leases.Leases, listing: Mapping[str, tuple[str, bool, str]], *, now: float
) -> leases.Leases:
    seen = dict(view.seen)
    for node, (version, left, nonce) in listing.items():
        old = seen.get(node)
        changed_at = now if old is None else old.changed_at  # a newer record is no change
        seen[node] = leases.Observed(version=version, left=left, nonce=nonce, changed_at=changed_at)
    return leases.Leases(seen=tuple(sorted(seen.items())), polled_at=now)


def _leave_early(after: Iterable[int], **_: Any) -> frozenset[int]:
    return frozenset()


BUGS: dict[str, Rules] = {
    "commit-overwrite": attrs.evolve(RULES, name="commit-overwrite", commit=_overwrite),
    "rebase-included": attrs.evolve(RULES, name="rebase-included", on_commit=_rebase_included),
    "no-readback": attrs.evolve(RULES, name="no-readback", ours=_no_readback),
    "no-takeover": attrs.evolve(RULES, name="no-takeover", decide=_no_takeover),
    "takeover-now": attrs.evolve(
        RULES, name="takeover-now", decide=_takeover_now, attentive=_attentive_now
    ),
    "skip-forgets": attrs.evolve(RULES, name="skip-forgets", counted=_skip_forgets),
    "gc-too-early": attrs.evolve(RULES, name="gc-too-early", collectable=_gc_too_early),
    "chain-skips": attrs.evolve(RULES, name="chain-skips", walk=_chain_skips),
    "stale-lease": attrs.evolve(RULES, name="stale-lease", observe=_stale_lease),
    "leave-early": attrs.evolve(RULES, name="leave-early", awaited=_leave_early),
}

BROKEN: dict[str, str] = {
    "commit-overwrite": "commit-once",
    "rebase-included": "merges-forward",
    "no-readback": "included-exist",
    "no-takeover": "eventually-committed",
    "takeover-now": "single-claim",
    "skip-forgets": "merges-forward",
    "gc-too-early": "included-exist",
    "chain-skips": "join-newest",
    "stale-lease": "eventually-committed",
    "leave-early": "left-after-uploads",
}
"""The property each planted bug breaks (the explorer's and the machines' invariant names)."""


def rules_for(bugs: frozenset[str] | None) -> Rules:
    """The rules with the planted bug ``bugs`` names switched on (at most one), else the real
    ones."""
    if not bugs:
        return RULES
    if len(bugs) > 1:
        raise ValueError(f"plant one bug at a time, got {sorted(bugs)}")
    (name,) = bugs
    return BUGS[name]
