"""The world: ``initial(config)``, ``successors(world)``, ``enabled(world)`` and
``apply(world, event)``. Every protocol decision is the real core rule's (``specs.learning``,
``specs.closing``); this module only says which atomic steps exist and when they may happen.

Events, per node ``i`` (``Event.kind``):

====================  =======================================================================
join                  create or join the run (a restart when the node is down: new nonce)
train                 apply ready commits, then one inner step (``rules.step``); a publish
                      captures a job (``Learner.advance``)
merge                 apply the first ready commit (``rules.on_commit``) while ``step`` is
                      blocked or the node is closing (the shell's ``blocked``/``done``)
upload                create the first job's snapshot; outcome ok, lost or ambiguous
poll                  GET the next commit of every fragment
sync                  one syncer pass: renew, observe, look at each watched round
renew / observe       (no timers) put the node's lease / LIST all leases
claim round r         (no timers) ``rules.decide`` on watched round r; claim and read it
commit                create the commit record of won work; outcome ok, lost or ambiguous
crash                 the process dies, losing everything volatile
pause / resume        the whole process freezes / goes on (a long GC, a suspended VM)
leave / stop          ``Session.close`` (``rules.close``) / the learner is done: stop
tick / fast / slow    virtual time advances (all clocks, one clock ahead, one clock behind)
====================  =======================================================================

With ``timers``, ``tick`` waits until every running, unpaused node has done what its loops do
every poll interval: its syncer pass, the commit of a round it claimed, its uploads and its
polls. Within a tick those steps interleave freely; a node that falls behind is a paused node
(budgeted). Training is the user's loop and has no timing; merges follow training.

State constraints (``Config``): training publishes below ``rounds``, anything below
``rounds + fragments``; ``steps`` per incarnation; ``attempts`` per round; crash and fault
budgets; clock drift within ``drift``.
"""

from __future__ import annotations

from collections.abc import Callable

from gradientmail.core import learner as rules
from specs import closing, learning
from specs.config import Config
from specs.mailbox import Mailbox
from specs.state import ABSENT, DOWN, Event, NodeState, World

__all__ = [
    "apply",
    "enabled",
    "initial",
    "of_kind",
    "progress_possible",
    "successors",
    "try_apply",
]

FAULTS = ("lost", "ambiguous")


def initial(config: Config) -> World:
    """No run yet: every node is absent and the mailbox is empty."""
    return World(
        config=config,
        time=0,
        nodes=tuple(NodeState() for _ in range(config.nodes)),
        mailbox=Mailbox(),
    )


def apply(world: World, event: Event) -> World:
    """The world after ``event`` (which must be enabled)."""
    i = event.node
    kind = event.kind
    if kind in _NODE_STEPS:
        return _NODE_STEPS[kind](world, i)
    if kind == "train":
        return learning.train(world, i, event.samples)
    if kind == "upload":
        return learning.upload(world, i, event.outcome)
    if kind == "claim":
        return closing.claim(world, i, event.round)
    if kind == "commit":
        return closing.commit(world, i, event.outcome)
    if kind == "tick":
        nodes = tuple(n._replace(clock=n.clock + 1, synced=False) for n in world.nodes)
        return world._replace(time=world.time + 1, nodes=nodes)
    if kind == "pause":
        world = world._replace(pauses=world.pauses + 1)
        return world.with_node(i, world.node(i)._replace(paused=True))
    if kind == "resume":
        return world.with_node(i, world.node(i)._replace(paused=False))
    if kind == "fast":
        return world.with_node(i, world.node(i)._replace(clock=world.node(i).clock + 1))
    if kind == "slow":
        nodes = tuple(n._replace(clock=n.clock + (j != i)) for j, n in enumerate(world.nodes))
        return world._replace(time=world.time + 1, nodes=nodes)
    raise ValueError(f"unknown event kind {kind!r}")


_NODE_STEPS: dict[str, Callable[[World, int], World]] = {
    "sync": closing.sync,
    "join": learning.join,
    "merge": learning.merge,
    "poll": learning.poll,
    "renew": learning.renew,
    "observe": learning.observe_leases,
    "crash": learning.crash,
    "leave": learning.leave,
    "stop": learning.stop,
}


def successors(world: World, *, samples: tuple[int, ...] = (1,)) -> list[tuple[Event, World]]:
    """Every enabled event with the world it leads to, in a fixed order (nodes by index).
    Events that would leave the bounds, or that change nothing, are not enabled."""
    found: list[tuple[Event, World]] = []
    for i, node in enumerate(world.nodes):
        for event in _candidates(world, i, node, samples):
            try:
                after = apply(world, event)
            except closing.OutOfBounds:
                continue
            if after != world and _within(world, after, i, event):
                found.append((event, after))
    if _may_tick(world):
        found.append((Event("tick"), apply(world, Event("tick"))))
    if world.config.drift:
        for i, node in enumerate(world.nodes):
            skew = node.clock - world.time
            if node.running and skew < world.config.drift:
                found.append((Event("fast", i), apply(world, Event("fast", i))))
            if node.running and skew > -world.config.drift:
                found.append((Event("slow", i), apply(world, Event("slow", i))))
    return found


def enabled(world: World, *, samples: tuple[int, ...] = (1,)) -> list[Event]:
    return [event for event, _ in successors(world, samples=samples)]


def try_apply(world: World, event: Event) -> World | None:
    """The world after ``event`` when it is enabled (and changes something), else None."""
    if event.kind in ("tick", "fast", "slow"):
        return dict(successors(world)).get(event)
    if not 0 <= event.node < len(world.nodes):
        return None
    node = world.node(event.node)
    if event not in _candidates(world, event.node, node, (event.samples,)):
        return None
    try:
        after = apply(world, event)
    except closing.OutOfBounds:
        return None
    if after == world or not _within(world, after, event.node, event):
        return None
    return after


def of_kind(
    world: World, kinds: frozenset[str], *, samples: tuple[int, ...] = (1,)
) -> list[tuple[Event, World]]:
    """The enabled events of ``kinds`` only (cheaper than ``successors`` when a driver picks
    a kind of step first, as the Hypothesis machine does)."""
    if kinds & {"tick", "fast", "slow"}:
        return [(e, w) for e, w in successors(world, samples=samples) if e.kind in kinds]
    found = []
    for i, node in enumerate(world.nodes):
        for event in _candidates(world, i, node, samples):
            if event.kind not in kinds:
                continue
            try:
                after = apply(world, event)
            except closing.OutOfBounds:
                continue
            if after != world and _within(world, after, i, event):
                found.append((event, after))
    return found


def progress_possible(world: World, kinds: frozenset[str]) -> bool:
    """Whether a step of one of ``kinds`` would change the world, bounds ignored."""
    for i, node in enumerate(world.nodes):
        for event in _candidates(world, i, node, (1,), bounded=False):
            if event.kind not in kinds:
                continue
            try:
                if apply(world, event) != world:
                    return True
            except closing.OutOfBounds:
                return True
    return False


def _may_tick(world: World) -> bool:
    if not world.config.timers:
        return True
    return all(
        not node.active
        or (node.synced and node.work is None and not node.jobs and not learning.pollable(world, i))
        for i, node in enumerate(world.nodes)
    )


def _candidates(
    world: World, i: int, node: NodeState, samples: tuple[int, ...], *, bounded: bool = True
) -> list[Event]:
    config = world.config
    if node.status in (ABSENT, DOWN):
        return [Event("join", i)]
    if not node.running:
        return []
    crash = [Event("crash", i)] if world.crashes < config.crashes else []
    if node.paused:
        return [Event("resume", i), *crash]
    assert node.learner is not None
    events = []
    blocked = rules.waiting_on(node.learner, config.algorithm) is not None
    more = node.learner.step < config.step_bound or not bounded
    if not node.learner.closing and not blocked and more:
        events += [Event("train", i, samples=s) for s in samples]
    if node.ready and (blocked or node.learner.closing):
        events.append(Event("merge", i))
    outcomes = ("ok", *FAULTS) if world.faults < config.faults else ("ok",)
    if node.jobs:
        events += [Event("upload", i, outcome=o) for o in outcomes]
    if learning.pollable(world, i):
        events.append(Event("poll", i))
    if node.work is not None:
        events += [Event("commit", i, outcome=o) for o in outcomes]
    elif config.timers:
        if not node.synced:
            events.append(Event("sync", i))
    else:
        events += [Event("renew", i), Event("observe", i), Event("sync", i)]
        events += [Event("claim", i, round=r) for r in node.watched]
    events += crash
    if world.pauses < config.pauses:
        events.append(Event("pause", i))
    if config.leave and not node.leaving:
        events.append(Event("leave", i))
    if node.leaving and node.work is None and not node.jobs and rules.done(node.learner):
        events.append(Event("stop", i))
    return events


def _within(before: World, after: World, i: int, event: Event) -> bool:
    if event.kind not in ("train", "merge", "leave"):
        return True
    config = before.config
    bound = config.rounds if event.kind == "train" else config.round_bound
    new = after.node(i).jobs[len(before.node(i).jobs) :]
    return all(job.round < bound for job in new)
