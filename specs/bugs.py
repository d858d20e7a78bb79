"""Planted bugs (design Decision 12): each swaps one rule for a broken variant, so the tests can
show that the stateful machine and the explorer catch it.

- ``commit-not-create-only``: the commit record is written with put semantics, so a slow
  closer overwrites the commit of a closer that took over (breaks "a round commits once").
- ``rebase-included``: the learner ignores whether the commit included its snapshot and
  rebases it anyway (breaks "no snapshot both included and rebased" and sample accounting).
- ``no-readback``: a create whose first try failed transiently is not read back; a taken key
  means "someone else's" (a closer deletes the payloads of its own, landed commit).
- ``no-takeover``: no later attempt is ever opened: a closer that dies after its claim leaves
  the round open forever (a liveness bug).
- ``no-takeover-timeout``: takeover without waiting (``takeover=0``): every candidate claims
  at once and later attempts open as soon as a claim is seen. Safety rests on create-only
  commits, so only the duplicate-work property notices it.
"""

from __future__ import annotations

import attrs

from gradientmail.core import learner as learner_rules
from gradientmail.core import syncer as syncer_rules
from gradientmail.core.learner import LearnerState
from gradientmail.core.leases import Leases
from specs.config import Config

__all__ = ["commit_overwrites", "decide", "on_commit", "skips_readback"]


def on_commit(
    config: Config, state: LearnerState, *, round: int, included: bool, counted: bool
) -> tuple[LearnerState, list[learner_rules.Effect]]:
    """``rules.on_commit``, or a variant. ``counted``: whether the node's snapshot in flight
    was counted (by this commit, or by a skipped one); only the proposed fix reads it."""
    if "rebase-included" in config.bugs:
        included = False
    if "jump-counted" in config.fixes and counted and not included:
        # The proposed fix of core.learner.on_commit (a reader that skipped collected commits
        # keeps the progress its counted snapshot carried): ``mine`` holds when the snapshot
        # in flight was counted, whether by ``round`` or by an earlier, skipped round.
        k = round % config.algorithm.fragments
        fragments = list(state.fragments)
        fragments[k] = attrs.evolve(fragments[k], outstanding=round)
        state = attrs.evolve(state, fragments=tuple(fragments))
        included = True
    return learner_rules.on_commit(state, config.algorithm, round=round, included=included)


def skips_readback(config: Config) -> bool:
    return "no-readback" in config.bugs


def commit_overwrites(config: Config) -> bool:
    return "commit-not-create-only" in config.bugs


def decide(
    config: Config,
    view: syncer_rules.RoundView,
    watch: syncer_rules.RoundWatch,
    leases: Leases,
    *,
    me: str,
    now: float,
) -> tuple[syncer_rules.RoundWatch, syncer_rules.Decision]:
    takeover = 0 if "no-takeover-timeout" in config.bugs else config.takeover
    watch, decision = syncer_rules.decide(
        view,
        watch,
        leases,
        me=me,
        algorithm=config.algorithm,
        now=now,
        lease_timeout=config.lease_timeout,
        takeover=takeover,
    )
    takes_over = isinstance(decision, syncer_rules.ClaimRound) and decision.attempt > 0
    if "no-takeover" in config.bugs and takes_over:
        return watch, syncer_rules.Wait(until=None, reason="planted bug: no takeover")
    return watch, decision
