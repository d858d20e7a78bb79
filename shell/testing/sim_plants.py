"""Process-wide switches a simulated run needs: seeded nonces, and planted bugs.

``deterministic_nonces``: the shell draws writer nonces from ``secrets`` (``exchange.new_nonce``,
imported by name into the learner, syncer and run modules). Nonces name payload keys and sit in
every record, so a replay is bit for bit only if they come from the run's seed; for the
duration of a run this swaps the function in every module that imported it.

``planted``: a documented broken variant of one safeguard, to show the simulator catches it
(Decision 12). Each wraps a core rule the shell looks up at call time; none edits its code.

- ``takeover-now``: ``core.syncer._open_attempt`` with a zero takeover timeout, so attempt
  a+1 opens as soon as attempt a's claim is seen (Decision 2's timeout disabled).
- ``rebase-included``: ``core.learner.on_commit`` always told its snapshot was not included, so
  a node rebases (and republishes) progress the commit already counted.
- ``commit-overwrite``: the commit record written with an overwriting put instead of a
  create-only write (done in ``SimMailbox``; nothing to patch here).
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any

from gradientmail.core import learner as learner_rules
from gradientmail.core import syncer as syncer_rules

__all__ = ["deterministic_nonces", "planted"]


@contextlib.contextmanager
def deterministic_nonces(rng: random.Random) -> Iterator[None]:
    """Within the block, every ``new_nonce()`` of the shell draws from ``rng``."""
    from gradientmail import exchange

    original = exchange.new_nonce

    def seeded() -> str:
        return f"{rng.getrandbits(64):016x}"

    patched = [
        module
        for name, module in list(sys.modules.items())
        if name.startswith("gradientmail") and getattr(module, "new_nonce", None) is original
    ]
    for module in patched:
        module.new_nonce = seeded  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module in patched:
            module.new_nonce = original  # type: ignore[attr-defined]


@contextlib.contextmanager
def planted(plant: str | None) -> Iterator[None]:
    """Within the block, the safeguard ``plant`` names is broken (see the module docstring)."""
    if plant == "takeover-now":
        with _swapped(syncer_rules, "_open_attempt", _no_takeover_timeout):
            yield
    elif plant == "rebase-included":
        with _swapped(learner_rules, "on_commit", _never_included):
            yield
    else:
        yield


@contextlib.contextmanager
def _swapped(module: Any, name: str, make: Callable[[Any], Any]) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, make(original))
    try:
        yield
    finally:
        setattr(module, name, original)


def _no_takeover_timeout(original: Any) -> Any:
    def open_attempt(
        view: Any, watch: Any, leases: Any, now: float, lease_timeout: float, takeover: float
    ) -> Any:
        return original(view, watch, leases, now, lease_timeout, 0.0)

    return open_attempt


def _never_included(original: Any) -> Any:
    def on_commit(state: Any, algorithm: Any, *, round: int, included: bool) -> Any:
        return original(state, algorithm, round=round, included=False)

    return on_commit
