"""Liveness: "with a live quorum and faults healed, every published round eventually commits".

Checked as a documented approximation of "from every reachable state, a state where every
published round is committed is reachable": from the state, faults heal (no more crashes, lost
or ambiguous writes) and every running node closes its session (Decision 11), then a fair
schedule runs: each running node in turn takes its next step (leave, merge, upload, poll,
commit, stop); when none can, every node makes its syncer pass (renew, observe, look at its
rounds; paused nodes resume first) and the clock ticks. The state passes when every node has
stopped (a closing node stops only once its learner is done: everything it published committed
and merged), within a bound of ticks far above the protocol's longest timer chain. Crashed
nodes stay down: the quorum is whoever is still running. The schedule is deterministic and
follows the same timers a real node does, so a failure is a real stall, printed as a trace.
An invariant that breaks on the way is reported as such (``Settled.broken``).
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from functools import lru_cache
from typing import NamedTuple

import attrs

from gradientmail.core import learner as rules
from specs import closing, learning
from specs.config import Config
from specs.invariants import check
from specs.state import Event, World
from specs.view import fingerprint
from specs.world import apply

__all__ = ["Settled", "settle"]


class Settled(NamedTuple):
    """``ok``: every node stopped. ``broken``: an invariant (name, message) failed on the way,
    after ``events`` (the schedule stops there)."""

    ok: bool
    world: World
    events: tuple[Event, ...]
    reason: str
    broken: tuple[str, str] | None = None


@lru_cache(maxsize=64)
def _unbounded(config: Config) -> Config:
    # The healed run may need more claim attempts than the explored bound allows.
    return attrs.evolve(config, attempts=config.attempts + 6)


def tick_bound(config: Config) -> int:
    """Ticks a healed schedule may take: far above the longest chain of timers (a lease
    expiring, then every attempt's takeover timeout, then grace)."""
    longest = config.lease_timeout + config.takeover * (1 << (config.attempts + 1)) + config.grace
    return 20 * longest


def settle(world: World, *, memo: MutableMapping[bytes, bool] | None = None) -> Settled:
    """Run the healed, fair schedule from ``world`` until every node has stopped."""
    original = world.config
    world = world._replace(config=_unbounded(original))
    events: list[Event] = []
    visited: list[bytes] = []
    ok: bool | None = None
    broken: tuple[str, str] | None = None
    for _ in range(tick_bound(original)):
        world, steps, broken = _progress(world)
        events += steps
        if broken is not None:
            ok = False
            break
        if not any(node.running for node in world.nodes):
            ok = True
            break
        if memo is not None:
            fp = fingerprint(world)
            if fp in memo:
                ok = memo[fp]
                break
            visited.append(fp)
        world, synced = _sync(world)
        events += synced
        world = apply(world, Event("tick"))
        events.append(Event("tick"))
    if ok is None:
        ok = False
    if memo is not None and broken is None:
        for fp in visited:
            memo[fp] = ok
    world = world._replace(config=original)
    if broken is not None:
        return Settled(False, world, tuple(events), broken[1], broken)
    return Settled(ok, world, tuple(events), "" if ok else _stuck(world))


def _sync(world: World) -> tuple[World, list[Event]]:
    """Every running node's syncer pass of this tick (resuming paused nodes: faults heal)."""
    events = []
    for i, node in enumerate(world.nodes):
        if node.paused:
            world = apply(world, Event("resume", i))
            events.append(Event("resume", i))
        if node.running and not node.synced and node.work is None:
            world = apply(world, Event("sync", i))
            events.append(Event("sync", i))
    return world, events


def _progress(world: World) -> tuple[World, list[Event], tuple[str, str] | None]:
    """Every node takes steps, in turn, until none can (or an invariant breaks)."""
    events: list[Event] = []
    moved = True
    while moved:
        moved = False
        for i in range(len(world.nodes)):
            for event in _steps(world, i):
                try:
                    after = apply(world, event)
                except closing.OutOfBounds:
                    continue
                if after != world:
                    world, moved = after, True
                    events.append(event)
                    broken = check(world)
                    if broken is not None:
                        return world, events, broken
                    break
    return world, events, None


def _steps(world: World, i: int) -> Iterator[Event]:
    node = world.node(i)
    if not node.active:
        return
    assert node.learner is not None
    if not node.leaving:
        yield Event("leave", i)
    if node.ready:
        yield Event("merge", i)
    if node.jobs:
        yield Event("upload", i)
    if learning.pollable(world, i):
        yield Event("poll", i)
    if node.work is not None:
        yield Event("commit", i)
        return
    if not node.jobs and rules.done(node.learner):
        yield Event("stop", i)


def _stuck(world: World) -> str:
    waiting = []
    for i, node in enumerate(world.nodes):
        if node.running and node.learner is not None:
            rounds = [f.outstanding for f in node.learner.fragments if f.outstanding is not None]
            waiting.append(f"n{i} waits for rounds {rounds}")
    return "; ".join(waiting) or "no progress"
