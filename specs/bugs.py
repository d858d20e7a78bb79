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
- ``skip-forgets``: a real bug the random walk found, kept as a planted one: a reader that
  skips commits whose parameters were collected judges its snapshot by the newest commit alone
  (rebasing progress an earlier, skipped commit counted) and never tells its syncer that the
  skipped rounds committed (it watches them forever).
"""

from __future__ import annotations

from gradientmail.core import learner as learner_rules
from gradientmail.core import syncer as syncer_rules
from gradientmail.core.learner import LearnerState
from gradientmail.core.leases import Leases
from specs.config import Config

__all__ = ["commit_overwrites", "decide", "forgets_skipped", "on_commit", "skips_readback"]


def on_commit(
    config: Config, state: LearnerState, *, round: int, included: bool, counted: bool
) -> tuple[LearnerState, list[learner_rules.Effect]]:
    """``rules.on_commit`` as the shell calls it, or a variant. ``included``: whether this commit
    itself counts the node's snapshot in flight; ``counted``: whether it or a commit the node
    skipped to reach it does (what the shell's learner passes)."""
    if "skip-forgets" not in config.bugs:
        included = counted
    if "rebase-included" in config.bugs:
        included = False
    return learner_rules.on_commit(state, config.algorithm, round=round, included=included)


def forgets_skipped(config: Config) -> bool:
    return "skip-forgets" in config.bugs


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
