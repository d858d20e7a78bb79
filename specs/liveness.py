"""Liveness: "with a live quorum and faults healed, every published round eventually commits".

Checked as a documented approximation of "from every reachable state, a state where every
published round is committed is reachable": from the state, faults heal (no more crashes,
faulty creates or pauses; paused nodes resume), every running node closes its session
(Decision 11), then a fair schedule runs: every node's loops take every step that is due,
delivered commits are merged where ``step`` or ``close`` would merge them, and the clock ticks
when nothing is due. The state passes when every node has stopped (a closing node stops only
once its learner is done: everything it published committed and merged) within a bound of
ticks far above the protocol's longest timer chain. Crashed nodes stay down: the quorum is
whoever is still running. The schedule is deterministic and follows the same timers a real
node does, so a failure is a real stall, printed as a trace. An invariant that breaks on the
way is reported as such (``Settled.broken``).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from functools import lru_cache
from typing import NamedTuple

import attrs

from gradientmail.core import learner
from specs.config import Config
from specs.invariants import check
from specs.state import LOOPS, Event, World
from specs.view import fingerprint
from specs.world import OutOfBounds, apply, blocked, runnable

__all__ = ["Settled", "settle", "tick_bound"]


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
    # The healed run may need more claim attempts and steps than the explored bounds allow.
    return attrs.evolve(config, attempts=config.attempts + 6, steps=config.step_bound + 100)


def tick_bound(config: Config) -> int:
    """Ticks a healed schedule may take: far above the longest chain of timers (a lease
    expiring, then every attempt's takeover timeout, then grace)."""
    longest = config.lease_timeout + config.takeover * (1 << (config.attempts + 1)) + config.grace
    return 20 * longest + config.horizon


def settle(world: World, *, memo: MutableMapping[bytes, bool] | None = None) -> Settled:
    """Run the healed, fair schedule from ``world`` until every node has stopped. With
    ``memo`` (fingerprint to outcome), a schedule that reaches a state an earlier one went
    through stops there with that schedule's outcome."""
    original = world.config
    world = world._replace(config=_unbounded(original))
    events: list[Event] = []
    visited: list[bytes] = []
    ok: bool | None = None
    broken: tuple[str, str] | None = None
    for _ in range(tick_bound(original)):
        world, steps, broken, known = _progress(world, memo, visited)
        events += steps
        if broken is not None:
            ok = False
            break
        if known is not None:
            ok = known
            break
        if not any(node.alive for node in world.nodes):
            ok = True
            break
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


def _progress(
    world: World, memo: MutableMapping[bytes, bool] | None, visited: list[bytes]
) -> tuple[World, list[Event], tuple[str, str] | None, bool | None]:
    """Every step due now, node by node, until none is (bounded): the healed schedule's
    part of one tick. Returns the world, the steps, an invariant broken on the way, and the
    outcome of an earlier schedule this one joined (``memo``)."""
    events: list[Event] = []
    for _ in range(500):
        moved = False
        for i in range(len(world.nodes)):
            for event in _due(world, i):
                if event.kind == "merge" and not world.node(i).ready:
                    continue  # an earlier step of this pass merged it (``_leave``, say)
                try:
                    after = apply(world, event)
                except OutOfBounds:
                    continue
                if after == world:
                    continue
                world, moved = after, True
                events.append(event)
                broken = check(world)
                if broken is not None:
                    return world, events, broken, None
                if memo is not None:
                    fp = fingerprint(world)
                    if fp in memo:
                        return world, events, None, memo[fp]
                    visited.append(fp)
        if not moved:
            return world, events, None, None
    return world, events, None, None


def _due(world: World, i: int) -> list[Event]:
    node = world.node(i)
    config = world.config
    if node.paused:
        return [Event("resume", i)]
    if not node.alive:
        return []
    due = [Event("step", i, loop=loop) for loop in LOOPS if runnable(node, loop)]
    if node.running:
        assert node.trainer is not None
        if node.ready and (blocked(node, config) or node.leaving):
            due.append(Event("merge", i))
        if not node.leaving:
            due.append(Event("leave", i))
        elif not node.finished and not node.ready and learner.done(node.trainer):
            due.append(Event("finish", i))
    return due


def _stuck(world: World) -> str:
    waiting = []
    for i, node in enumerate(world.nodes):
        if not node.alive:
            continue
        if node.trainer is None:
            waiting.append(f"n{i} never finished joining")
            continue
        open_rounds = [f.outstanding for f in node.trainer.fragments if f.outstanding is not None]
        waiting.append(f"n{i} waits for rounds {open_rounds}" if open_rounds else f"n{i} waits")
    return "; ".join(waiting) or "no progress"
