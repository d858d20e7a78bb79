"""The bounds and settings of one explored world.

Times are integer seconds of virtual time. The defaults are the smallest values the shell
accepts (``lease_timeout >= 2 * lease_every + poll_interval`` with a poll interval of 1,
``takeover >= lease_timeout``), so timers expire after a few ticks and the explored space stays
small while every comparison the rules make is still exercised.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from gradientmail.core.algorithm import DiLoCo

__all__ = ["BUGS", "Config"]

# Planted bugs (design Decision 12): each swaps one rule for a broken variant; see specs/bugs.py.
BUGS = frozenset(
    {
        "commit-not-create-only",
        "rebase-included",
        "no-readback",
        "no-takeover",
        "no-takeover-timeout",
        "skip-forgets",
    }
)


def _one_of(allowed: frozenset[str]) -> Callable[[Any, attrs.Attribute[frozenset[str]], Any], None]:
    def check(instance: object, attribute: attrs.Attribute[frozenset[str]], value: object) -> None:
        if not isinstance(value, frozenset) or not value <= allowed:
            raise ValueError(
                f"{attribute.name} must be a frozenset of {sorted(allowed)}, got {value!r}"
            )

    return check


def _at_least(low: int) -> Callable[[Any, attrs.Attribute[int], Any], None]:
    def check(instance: object, attribute: attrs.Attribute[int], value: object) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{attribute.name} must be an integer >= {low}, got {value!r}")

    return check


@attrs.frozen(kw_only=True, cache_hash=True)
class Config:
    """One world's nodes, algorithm, timers and bounds.

    Attributes
    ----------
    nodes
        Node ids ``n0 .. n{nodes-1}``; every node starts absent and joins by an event.
    fragments, inner_steps, quorum, grace, overlap
        The algorithm (``DiLoCo``); ``inner_steps`` defaults to ``fragments`` so every step
        ends a slot and publishes.
    rounds
        State constraint: training publishes only into rounds ``0 .. rounds-1``; a leaving or
        rebasing node may go up to ``fragments`` rounds further.
    steps
        State constraint: inner steps per incarnation (default ``rounds + fragments``).
    attempts
        State constraint: claim attempts ``0 .. attempts-1`` per round.
    crashes, faults, pauses
        Budgets: node crashes, faulty writes (lost or ambiguous creates), and process pauses
        (a paused node takes no step until it resumes, however long that is).
    timers
        True: every running node's syncer makes one pass (renew, observe, look at its rounds)
        per tick, as the shell's loop does every poll interval, and time waits for it (a
        late node is a paused one). False: renew, observe and each round's look are separate
        events with no timing at all (the Hypothesis machine's finer grain).
    lease_every, lease_timeout, takeover
        Seconds between renewals a live node makes, seconds unchanged after which a lease is
        expired, seconds before another node takes over a silent closer.
    drift
        Bound on any node's clock running ahead of or behind virtual time (seconds).
    leave
        Whether nodes may leave (``Session.close``).
    bugs
        Planted bugs to switch on (``BUGS``).
    """

    nodes: int = attrs.field(default=2, validator=_at_least(1))
    fragments: int = attrs.field(default=1, validator=_at_least(1))
    rounds: int = attrs.field(default=2, validator=_at_least(1))
    inner_steps: int | None = None
    quorum: int = attrs.field(default=1, validator=_at_least(1))
    grace: int = attrs.field(default=0, validator=_at_least(0))
    overlap: int | None = 0
    steps: int | None = None
    attempts: int = attrs.field(default=2, validator=_at_least(1))
    crashes: int = attrs.field(default=0, validator=_at_least(0))
    faults: int = attrs.field(default=0, validator=_at_least(0))
    pauses: int = attrs.field(default=0, validator=_at_least(0))
    timers: bool = True
    lease_every: int = attrs.field(default=1, validator=_at_least(1))
    lease_timeout: int = attrs.field(default=3, validator=_at_least(1))
    takeover: int = attrs.field(default=3, validator=_at_least(1))
    drift: int = attrs.field(default=0, validator=_at_least(0))
    leave: bool = True
    bugs: frozenset[str] = attrs.field(default=frozenset(), validator=_one_of(BUGS))
    algorithm: DiLoCo = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.nodes > 9:
            raise ValueError(f"nodes must be at most 9, got {self.nodes}")
        if self.lease_timeout < 2 * self.lease_every + 1:
            raise ValueError(
                f"lease_timeout ({self.lease_timeout}) must be >= 2 * lease_every + 1 "
                f"({2 * self.lease_every + 1}), as the shell requires"
            )
        if self.takeover < self.lease_timeout:
            raise ValueError(f"takeover ({self.takeover}) must be >= lease_timeout")
        algorithm = DiLoCo(
            inner_steps=self.inner_steps or self.fragments,
            fragments=self.fragments,
            quorum_size=self.quorum,
            grace=float(self.grace),
            overlap_steps=self.overlap,
        )
        object.__setattr__(self, "algorithm", algorithm)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f"n{i}" for i in range(self.nodes))

    @property
    def step_bound(self) -> int:
        return self.steps if self.steps is not None else self.rounds + self.fragments

    @property
    def round_bound(self) -> int:
        """The first round nothing may publish into (leaving and rebasing included)."""
        return self.rounds + self.fragments

    def describe(self) -> str:
        parts = [
            f"nodes={self.nodes}",
            f"fragments={self.fragments}",
            f"rounds={self.rounds}",
            f"quorum={self.quorum}",
            f"crashes={self.crashes}",
            f"faults={self.faults}",
        ]
        if self.grace:
            parts.append(f"grace={self.grace}")
        if self.overlap != 0:
            parts.append(f"overlap={self.overlap}")
        if self.pauses:
            parts.append(f"pauses={self.pauses}")
        if not self.timers:
            parts.append("no-timers")
        if self.drift:
            parts.append(f"drift={self.drift}")
        if not self.leave:
            parts.append("no-leave")
        if self.bugs:
            parts.append(f"bugs={','.join(sorted(self.bugs))}")
        return " ".join(parts)
