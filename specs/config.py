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
from specs import bugs as registry

__all__ = ["BUGS", "Config"]

BUGS = frozenset(registry.BUGS)
"""Planted bugs (design Decision 12): ``specs/bugs.py``, the registry every driver shares."""


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


SQUAT_KINDS = frozenset({"commit", "snapshot", "manifest"})


def _squat_kinds(instance: object, attribute: attrs.Attribute[object], value: object) -> None:
    if not isinstance(value, frozenset) or not value or not value <= SQUAT_KINDS:
        raise ValueError(f"squats must be a non-empty subset of {sorted(SQUAT_KINDS)}: {value!r}")


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
        Budgets: node crashes, faulty creates (lost in transit, or landed with the answer lost),
        and process pauses (a paused node takes no step until it resumes).
    forgeries, squats
        Budget of a writer without the run's secret: objects that do not verify, each created at
        the next free key of a slot sequence (``core.slots``; the world is a signed run's) of
        the kinds in ``squats``: ``commit`` (a round not committed yet), ``snapshot`` (a node's
        snapshot of a round it has not published yet), ``manifest`` (before the run exists).
    grain
        "write": a loop's step runs its rule until a call whose effects write (or it waits), so
        a node's reads between two writes see one mailbox (the explorer's default); "call":
        one rule call and its effects (the Hypothesis machines' finer grain).
    poll_interval, lease_every, lease_timeout, takeover, horizon
        The node settings: seconds between polls, renewals, after which an unchanged lease is
        expired, before another node takes over a silent closer, and before a collectable
        round is deleted (``keep`` rounds stay).
    drift
        Bound on any node's clock running ahead of or behind virtual time (seconds).
    leave
        Whether nodes may leave (``Session.close``).
    quick_leases
        Every node lists the leases every ``lease_every / 2`` seconds, as before the idle
        cadence (``syncer.lease_cadence``: ``lease_timeout`` between LISTs while a node is not
        attentive to any round); for worlds the idle cadence makes too large to exhaust here.
    gather
        Nodes wait to see every node of the world before they train (``Session.wait_for_nodes``:
        the world sends the syncer ``Gather`` when the node starts, and ``train`` waits for its
        lease view to hold ``nodes`` active nodes); the invariant ``first-rounds-expect-all``
        then holds.
    idle_polls
        Poll intervals between a learner's GETs of a commit it has no snapshot in
        (``polling.IDLE_POLLS``, 10 in the library): 2 here, so the idle poll is a timer of
        its own without ten ticks of states.
    renewals_ahead
        Renewals past the last one judged that an observer recognizes from a listed MD5
        (``leases.RENEWALS_AHEAD``, 64 in the library): 8 here, since the view tells lags apart
        up to it.
    exact
        Deduplicate on the exact view (every time a node keeps, up to the cap) instead of the
        reduced one (a lease's age only up to ``lease_timeout``, no time of the last LIST):
        for the test that the two explore the same (``specs.view``, specs/README.md).
    bugs
        Planted bugs to switch on (``BUGS``; at most one).
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
    forgeries: int = attrs.field(default=0, validator=_at_least(0))
    squats: frozenset[str] = attrs.field(
        default=frozenset({"commit"}), converter=frozenset, validator=_squat_kinds
    )
    grain: str = attrs.field(default="write")
    poll_interval: int = attrs.field(default=1, validator=_at_least(1))
    lease_every: int = attrs.field(default=1, validator=_at_least(1))
    lease_timeout: int = attrs.field(default=3, validator=_at_least(1))
    takeover: int = attrs.field(default=3, validator=_at_least(1))
    keep: int = attrs.field(default=2, validator=_at_least(1))
    horizon: int = attrs.field(default=0, validator=_at_least(0))
    drift: int = attrs.field(default=0, validator=_at_least(0))
    leave: bool = True
    quick_leases: bool = False
    gather: bool = False
    idle_polls: int = attrs.field(default=2, validator=_at_least(1))
    renewals_ahead: int = attrs.field(default=8, validator=_at_least(1))
    exact: bool = False
    bugs: frozenset[str] = attrs.field(default=frozenset(), validator=_one_of(BUGS))
    algorithm: DiLoCo = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.nodes > 9:
            raise ValueError(f"nodes must be at most 9, got {self.nodes}")
        if self.grain not in ("write", "call"):
            raise ValueError(f"grain must be 'write' or 'call', got {self.grain!r}")
        if len(self.bugs) > 1:
            raise ValueError(f"bugs: plant one at a time, got {sorted(self.bugs)}")
        if self.lease_timeout < 2 * self.lease_every + self.poll_interval:
            raise ValueError(
                f"lease_timeout ({self.lease_timeout}) must be >= 2 * lease_every + "
                f"poll_interval ({2 * self.lease_every + self.poll_interval}), as the shell "
                "requires"
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

    @property
    def cap(self) -> int:
        """Seconds beyond which no rule tells two ages (or two waits) apart: above every
        threshold a rule compares a time with, and their sums (``specs.view``)."""
        longest = self.takeover * 2 ** (self.attempts + 1) + (self.nodes - 1) * self.takeover
        return longest + self.lease_timeout + self.grace + self.poll_interval + self.horizon + 2

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
        if self.forgeries:
            parts.append(f"forgeries={self.forgeries}")
            if self.squats != {"commit"}:
                parts.append(f"squats={','.join(sorted(self.squats))}")
        if self.grain != "write":
            parts.append(f"grain={self.grain}")
        if self.horizon:
            parts.append(f"horizon={self.horizon}")
        if self.drift:
            parts.append(f"drift={self.drift}")
        if not self.leave:
            parts.append("no-leave")
        if self.quick_leases:
            parts.append("quick-leases")
        if self.gather:
            parts.append("gather")
        if self.idle_polls != 2:
            parts.append(f"idle-polls={self.idle_polls}")
        if self.exact:
            parts.append("exact-view")
        if self.bugs:
            parts.append(f"bugs={','.join(sorted(self.bugs))}")
        return " ".join(parts)
