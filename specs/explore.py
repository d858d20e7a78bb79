"""An explicit-state explorer of our own, and a seeded random walk, over ``specs.world``.

``explore`` is breadth-first with a parent pointer per distinct state, so the first violation
found has a shortest trace. States are deduplicated by ``specs.view.fingerprint`` (blake2b over
a stable encoding of a view that drops history and normalizes times).

Per distinct state it checks the safety invariants (``specs.invariants``), deadlock (no
progress step enabled now or after waiting out every timer, while a running node has a round
in flight) and, when ``liveness`` is on, the healed fair schedule of ``specs.liveness``.
"""

from __future__ import annotations

import contextlib
import gc
import random
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import NamedTuple

from specs.config import Config
from specs.fairness import RESTART, Graph, settled
from specs.invariants import check
from specs.liveness import settle, tick_bound
from specs.state import DOWN, Event, World
from specs.view import fingerprint
from specs.world import apply, initial, progress_possible, runnable, successors

__all__ = ["SETTLE", "Result", "Violation", "explore", "random_walk", "replay", "without_gc"]

SETTLE = ("bounds", "all", "none")
"""Where ``explore`` runs the healed schedule: states with an event cut by a bound, every
state, or none."""
# Steps that make progress on their own (the rest only pass time or are the user's choice).
PROGRESS = frozenset({"train", "merge", "step", "finish", "resume"})
# A random walk favours progress and keeps faults and leaving rare, so it goes deep.
WALK_WEIGHTS = {
    **dict.fromkeys(PROGRESS | {"join"}, 4.0),
    **dict.fromkeys(("crash", "pause", "leave", "fast", "slow"), 0.2),
    "resume": 0.5,
}


@contextlib.contextmanager
def without_gc() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, as it was after it.

    An exploration keeps millions of objects alive (worlds, encodings, fingerprints), and each
    full collection walks all of them; none of them is in a cycle (worlds are trees of
    immutable values), so the collections found almost nothing (4,632 objects over the first
    60,000 states of #20's world) and took a third of the time. Reference counting still frees
    everything else at once."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Violation(NamedTuple):
    """``kind`` is "invariant", "deadlock" or "liveness"; ``trace`` leads from the initial
    world to the violating one; ``tail`` is the healed schedule that failed (liveness)."""

    kind: str
    name: str
    message: str
    trace: tuple[Event, ...]
    tail: tuple[Event, ...] = ()


class Result(NamedTuple):
    config: Config
    generated: int
    distinct: int
    depth: int
    seconds: float
    violation: Violation | None
    complete: bool
    fair: int = 0
    """States the graph's liveness check judged (``specs.fairness``: reached, not settled,
    within the bounds); 0 when it did not run."""

    @property
    def rate(self) -> float:
        """Distinct states per second."""
        return self.distinct / self.seconds if self.seconds > 0 else 0.0


def replay(config: Config, events: tuple[Event, ...] | list[Event]) -> list[World]:
    """The worlds a trace goes through, from the initial one (a counterexample as a test)."""
    worlds = [initial(config)]
    for event in events:
        worlds.append(apply(worlds[-1], event))
    return worlds


def explore(
    config: Config,
    *,
    liveness: bool = True,
    settle: str = "bounds",
    max_states: int | None = None,
    progress: Callable[[int, int, int], None] | None = None,
    visit: Callable[[World], None] | None = None,
    workers: int = 1,
) -> Result:
    """Breadth-first exploration of every interleaving within ``config``'s bounds;
    ``visit`` is called with one world of each distinct state. With ``liveness``: once the
    exploration is complete, the graph's fair schedules (``specs.fairness``), and the healed
    schedule of ``specs.liveness`` (``settle``) from each state the graph cannot judge: where an
    event was cut by a bound, and in a world whose nodes never leave every state, since only
    that schedule closes them there ("bounds", the default); from every state as it is reached
    ("all": its trace is the shortest to a stall it finds; five times the cost), or from none
    ("none"). With ``workers`` above 1 the frontier is expanded by that many processes
    (``specs.parallel``; "bounds" or "none" only)."""
    if settle not in SETTLE:
        raise ValueError(f"settle={settle!r}: expected one of {', '.join(SETTLE)}")
    if workers > 1:
        if visit is not None:
            raise ValueError("visit needs every world in this process: run with workers=1")
        from specs.parallel import explore_parallel  # it builds on this module

        return explore_parallel(
            config,
            workers=workers,
            liveness=liveness,
            settle=settle,
            max_states=max_states,
            progress=progress,
        )
    with without_gc():
        return _explore(config, liveness, settle, max_states, progress, visit)


def _explore(
    config: Config,
    liveness: bool,
    settle: str,
    max_states: int | None,
    progress: Callable[[int, int, int], None] | None,
    visit: Callable[[World], None] | None,
) -> Result:
    started = time.perf_counter()
    world, root, graph, parents = begin(config, liveness)
    queue: deque[tuple[World, bytes, int]] = deque([(world, root, 0)])
    memo: dict[bytes, bool] = {}
    deferred: list[Violation] = []
    generated = depth = 0
    report = 25_000
    settling = liveness and settle == "all"
    at_bounds = liveness and settle == "bounds"
    violation = resolve(judge(world, settling, memo), root, parents, deferred)
    if visit is not None:
        visit(world)
    while queue and violation is None:
        if max_states is not None and len(parents) >= max_states:
            break
        world, fp, d = queue.popleft()
        depth = max(depth, d)
        cut: list[Event] | None = [] if graph is not None else None
        steps = successors(world, cut=cut)
        violation = resolve(deadlock(world, steps), fp, parents, deferred)
        if at_bounds and heals_at(world, cut) and violation is None:
            violation = resolve(healed(world, memo), fp, parents, deferred)
        edges: list[tuple[Event, bytes]] = []
        for event, after in steps:
            generated += 1
            child = fingerprint(after)
            edges.append((labelled(world, event), child))
            if child in parents:
                continue
            if graph is not None:
                graph.add(child, settled(after))
            parents[child] = (fp, event)
            if visit is not None:
                visit(after)
            violation = violation or resolve(judge(after, settling, memo), child, parents, deferred)
            if violation is not None:
                depth = d + 1
                break
            queue.append((after, child, d + 1))
        if graph is not None and violation is None:
            graph.expand(fp, edges, bool(cut))
        if progress is not None and len(parents) >= report:
            progress(generated, len(parents), depth)
            report += 25_000
    complete = not queue and violation is None
    return finish(config, graph, parents, deferred, violation, complete, generated, depth, started)


def finish(
    config: Config,
    graph: Graph | None,
    parents: dict[bytes, tuple[bytes, Event] | None],
    deferred: list[Violation],
    violation: Violation | None,
    complete: bool,
    generated: int,
    depth: int,
    started: float,
) -> Result:
    """The result of an exploration: once it is complete, the graph's fair schedules."""
    fair = 0
    if complete and graph is not None:
        stall = graph.stall(depth=lambda fp: len(_trace(fp, parents)))
        fair = graph.judged
        if stall is not None:
            what = "no healed step" if not stall.cycle else f"a fair cycle of {len(stall.cycle)}"
            violation = Violation(
                "liveness",
                "eventually-committed",
                f"{what} events from here never commits what a running node published",
                _trace(stall.state, parents),
                stall.cycle,
            )
    if violation is None and deferred:
        violation = deferred[0]
    return Result(
        config=config,
        generated=generated,
        distinct=len(parents),
        depth=depth,
        seconds=time.perf_counter() - started,
        violation=violation,
        complete=complete,
        fair=fair,
    )


def begin(
    config: Config, liveness: bool
) -> tuple[World, bytes, Graph | None, dict[bytes, tuple[bytes, Event] | None]]:
    """An exploration's start: the initial world, its fingerprint, the graph (with
    ``liveness``) and the parent pointers, each holding it."""
    world = initial(config)
    root = fingerprint(world)
    graph = Graph() if liveness else None
    if graph is not None:
        graph.add(root, settled(world))
    return world, root, graph, {root: None}


def labelled(world: World, event: Event) -> Event:
    """``event`` as the graph's fairness reads it: a crashed node's ``join`` is a restart."""
    if event.kind == "join" and world.node(event.node).status == DOWN:
        return event._replace(loop=RESTART)
    return event


def _trace(fp: bytes, parents: dict[bytes, tuple[bytes, Event] | None]) -> tuple[Event, ...]:
    events = []
    link = parents[fp]
    while link is not None:
        fp, event = link
        events.append(event)
        link = parents[fp]
    return tuple(reversed(events))


class Finding(NamedTuple):
    """A violation before its trace is known (what a worker of ``specs.parallel`` sends):
    ``kind`` "invariant", "deadlock", "liveness", or "deferred" (an invariant broken inside a
    healed schedule, reported only if nothing else is found)."""

    kind: str
    name: str
    message: str
    tail: tuple[Event, ...] = ()

    def violation(self, fp: bytes, parents: dict[bytes, tuple[bytes, Event] | None]) -> Violation:
        kind = "invariant" if self.kind == "deferred" else self.kind
        return Violation(kind, self.name, self.message, _trace(fp, parents), self.tail)


def judge(world: World, liveness: bool, memo: dict[bytes, bool]) -> Finding | None:
    """What a newly reached state breaks: an invariant at once, or (with ``liveness``) the
    healed schedule from it. An invariant that breaks inside a healed schedule is kept aside
    (``resolve``): a shortest trace to it within the bounds may yet come, so it is reported
    only if the exploration finds nothing else."""
    broken = check(world)
    if broken is not None:
        return Finding("invariant", broken[0], broken[1])
    return healed(world, memo) if liveness else None


def resolve(
    found: Finding | None,
    fp: bytes,
    parents: dict[bytes, tuple[bytes, Event] | None],
    deferred: list[Violation],
) -> Violation | None:
    """The violation ``found`` at ``fp``, or None when nothing was found or it is deferred
    (kept in ``deferred`` if it is the first)."""
    if found is None:
        return None
    if found.kind != "deferred":
        return found.violation(fp, parents)
    if not deferred:
        deferred.append(found.violation(fp, parents))
    return None


def heals_at(world: World, cut: list[Event] | None) -> bool:
    """With ``settle="bounds"``: whether the healed schedule runs from an expanded state, one
    where an event was ``cut`` by a bound, or any state of a world whose nodes never leave
    (only that schedule closes them there)."""
    return bool(cut) or not world.config.leave


def healed(world: World, memo: dict[bytes, bool]) -> Finding | None:
    """The healed schedule from ``world`` (``specs.liveness.settle``)."""
    settled = settle(world, memo=memo)
    if settled.ok:
        return None
    if settled.broken is not None:
        name, message = settled.broken
        return Finding("deferred", name, message, settled.events)
    tail = settle(world).events  # again without the memo, for the whole schedule
    return Finding("liveness", "eventually-committed", settled.reason, tail)


def deadlock(world: World, steps: list[tuple[Event, World]]) -> Finding | None:
    """No progress step now, or after waiting out every timer, while a round is in flight."""
    if any(event.kind in PROGRESS for event, _ in steps) or progress_possible(world, PROGRESS):
        return None
    waiting = [
        i
        for i, node in enumerate(world.nodes)
        if node.running
        and node.trainer is not None
        and any(f.outstanding is not None for f in node.trainer.fragments)
    ]
    if not waiting:
        return None
    later = world
    for _ in range(tick_bound(world.config)):
        later = apply(later, Event("tick"))
        if progress_possible(later, PROGRESS) or any(
            runnable(node, loop) for node in later.nodes for loop in ("learner", "syncer")
        ):
            return None
    nodes = ", ".join(f"n{i}" for i in waiting)
    return Finding("deadlock", "deadlock", f"{nodes} wait forever")


def random_walk(
    config: Config,
    *,
    seed: int = 0,
    walks: int = 100,
    depth: int = 200,
    liveness: bool = True,
) -> Result:
    """Seeded random walks: each picks among enabled events by ``WALK_WEIGHTS``; every state is
    checked, and every walk's last state settles (liveness)."""
    rng = random.Random(seed)
    started = time.perf_counter()
    seen: set[bytes] = set()
    generated = longest = 0
    violation = None
    for _ in range(walks):
        world = initial(config)
        trace: list[Event] = []
        for _ in range(depth):
            steps = successors(world)
            if not steps:  # only a state constraint cuts a world off like this
                break
            weights = [WALK_WEIGHTS.get(e.kind, 1.0) for e, _ in steps]
            event, world = rng.choices(steps, weights)[0]
            trace.append(event)
            generated += 1
            seen.add(fingerprint(world))
            broken = check(world)
            if broken is not None:
                violation = Violation("invariant", broken[0], broken[1], tuple(trace))
                break
            if not any(node.alive or node.status == "absent" for node in world.nodes):
                break
        longest = max(longest, len(trace))
        if violation is None and liveness:
            settled = settle(world)
            if not settled.ok:
                violation = Violation(
                    "liveness",
                    "eventually-committed",
                    settled.reason,
                    tuple(trace),
                    settled.events,
                )
        if violation is not None:
            break
    return Result(
        config=config,
        generated=generated,
        distinct=len(seen),
        depth=longest,
        seconds=time.perf_counter() - started,
        violation=violation,
        complete=False,
    )
