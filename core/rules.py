"""The rule functions a node runs, as one value: ``Rules``.

Every machine (``learner``, ``polling``, ``syncer``, ``join``) takes its sub-rules from the
``Rules`` it is given, the real ones by default (``RULES``). A planted bug (Decision 12) is a
``Rules`` with one function swapped for a broken variant (``specs/bugs.py``), passed in as an
argument: the Hypothesis machine, the explorer and the simulator run the same variants, and
nothing is patched at run time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from gradientmail.core import chain, closing, gc, identity, learner, leases
from gradientmail.core.effects import CreateCommit, Effect
from gradientmail.core.records import Commit

__all__ = ["RULES", "Rules"]


def create_commit(commit: Commit) -> list[Effect]:
    """The write that closes a round: a create of its commit record (a round commits once)."""
    return [CreateCommit(commit=commit)]


def counted_on_skip(
    counted: frozenset[tuple[str, str]], skipped: Commit, newest: Commit
) -> frozenset[tuple[str, str]]:
    """What a learner that skips from ``skipped`` (its parameters collected) to ``newest``
    knows was counted: both commits' snapshots (commit records are never collected)."""
    return counted | frozenset((i.node, i.nonce) for i in newest.included)


@attrs.frozen(kw_only=True)
class Rules:
    """The protocol's rule functions. ``name`` says which variant this is ("real", or a
    planted bug's name)."""

    name: str = "real"
    decide: Callable[..., Any] = closing.decide
    attentive: Callable[..., float | None] = closing.attentive
    ours: Callable[..., bool] = identity.ours
    on_commit: Callable[..., Any] = learner.on_commit
    counted: Callable[..., frozenset[tuple[str, str]]] = counted_on_skip
    collectable: Callable[..., int | None] = gc.collectable
    walk: Callable[..., Any] = chain.advance
    commit: Callable[[Commit], list[Effect]] = create_commit
    observe: leases.Observe = leases.observe
    awaited: Callable[..., frozenset[int]] = leases.awaited


RULES = Rules()
"""The real rules."""
