"""Liveness as a property of the explored graph (``specs.fairness``): a fair schedule that never
settles is found, an unfair one is not, and the explorer finds a planted stall with it alone."""

from __future__ import annotations

import attrs

from specs.config import Config
from specs.explore import explore, replay
from specs.fairness import Graph, settled
from specs.state import Event
from specs.view import fingerprint
from specs.world import apply, runnable

SYNCER = Event("step", 0, loop="syncer")
LEARNER = Event("step", 1, loop="learner")
TICK = Event("tick")
MERGE = Event("merge", 0)
LEAVE = Event("leave", 0)
RESTART = Event("join", 1, loop="restart")
TRAIN = Event("train", 0)
CRASH = Event("crash", 1)


def graph(
    edges: dict[str, list[tuple[Event, str]]],
    *,
    done: frozenset[str] = frozenset(),
    cut: frozenset[str] = frozenset(),
) -> Graph:
    """A graph of named states: ``done`` are settled, ``cut`` had an event cut by a bound."""
    g = Graph()
    for name in edges:
        g.add(name.encode(), name in done)
    for name, out in edges.items():
        g.expand(name.encode(), [(event, child.encode()) for event, child in out], name in cut)
    return g


def test_a_fair_cycle_that_never_settles_is_a_stall() -> None:
    stall = graph({"a": [(SYNCER, "b")], "b": [(TICK, "a")]}).stall()
    assert stall is not None and stall.state in (b"a", b"b")
    assert sorted(stall.cycle) == sorted((SYNCER, TICK))  # once round, from either state


def test_a_cycle_that_never_takes_an_event_it_keeps_enabling_is_unfair() -> None:
    # b enables the merge that settles; a schedule cycling a-b forever never takes it.
    g = graph(
        {"a": [(SYNCER, "b")], "b": [(TICK, "a"), (MERGE, "c")], "c": []},
        done=frozenset({"c"}),
    )
    assert g.stall() is None
    assert g.judged == 2


def test_a_fair_cycle_inside_an_unfair_component_is_found() -> None:
    # {a, b, d} is unfair (b enables the merge, never taken inside), but a schedule that
    # cycles a-d never visits b and takes every event it enables (Emerson-Lei).
    g = graph(
        {
            "a": [(SYNCER, "b"), (LEARNER, "d")],
            "b": [(LEARNER, "a"), (MERGE, "c")],
            "d": [(SYNCER, "a")],
            "c": [],
        },
        done=frozenset({"c"}),
    )
    stall = g.stall()
    assert stall is not None and stall.state in (b"a", b"d")
    assert set(stall.cycle) == {SYNCER, LEARNER}


def test_choices_bind_no_schedule_and_faults_are_not_followed() -> None:
    # Leaving, a crashed node's restart (choices) and a crash (a fault) lead to a settled
    # state; a fair schedule need take none of them.
    choices = {"a": [(TICK, "a"), (LEAVE, "c"), (RESTART, "c"), (CRASH, "c")], "c": []}
    stall = graph(choices, done=frozenset({"c"})).stall()
    assert stall is not None and stall.cycle == (TICK,)
    # Training on is assumed of a running node (a quorum may wait for its snapshot).
    assert graph({"a": [(TICK, "a"), (TRAIN, "c")], "c": []}, done=frozenset({"c"})).stall() is None
    # A state whose only way on is a fault: once faults stop, nothing happens there.
    stuck = graph({"a": [(CRASH, "c")], "c": []}, done=frozenset({"c"})).stall()
    assert stuck is not None and stuck.state == b"a" and stuck.cycle == ()


def test_settled_states_and_states_at_the_bounds_are_not_judged() -> None:
    idle = {"a": [(TICK, "a")]}
    for g in (graph(idle, done=frozenset({"a"})), graph(idle, cut=frozenset({"a"}))):
        assert g.stall() is None and g.judged == 0


def test_the_explorer_finds_a_planted_stall_by_the_graph_alone() -> None:
    # An observer that ignores a newer lease calls the node's own lease expired: its
    # snapshot stops counting and its round never closes (specs/bugs.py).
    config = Config(nodes=1, rounds=1, leave=False, bugs=frozenset({"stale-lease"}))
    result = explore(config, settle="none")
    assert result.complete and result.fair > 0
    violation = result.violation
    assert violation is not None and violation.name == "eventually-committed"
    # The cycle is a real schedule: from the trace's last state it comes back to it, through
    # states none of which has settled.
    start = replay(config, violation.trace)[-1]
    world = start
    assert violation.tail
    for event in violation.tail:
        assert not settled(world)
        world = apply(world, event)
    assert fingerprint(world) == fingerprint(start)
    # The same world without the bug has no stall.
    clean = explore(attrs.evolve(config, bugs=frozenset()), settle="none")
    assert clean.complete and clean.violation is None and clean.fair > 0


def test_a_node_that_began_to_close_and_is_still_alive_has_not_settled() -> None:
    # Decision 11: close returns once the node's rounds commit; until its process is gone a
    # fair schedule has not settled, so a close that never returns is a stall.
    config = Config(nodes=1, rounds=1)
    world = replay(config, [Event("join", 0)])[-1]
    for _ in range(100):
        if world.node(0).running:
            break
        joining = runnable(world.node(0), "join")
        world = apply(world, Event("step", 0, loop="join") if joining else TICK)
    assert world.node(0).running and settled(world)
    closing = apply(world, LEAVE)
    assert closing.node(0).alive and not settled(closing)


def test_the_healed_schedule_at_the_bounds_judges_what_it_judged_from_every_state() -> None:
    # The graph judges every state within the bounds on every fair schedule, so the healed
    # schedule runs only where it cannot: states with an event cut by a bound. Both ways the
    # same worlds hold and the same stall is found.
    for config in (Config(nodes=1, rounds=2), Config(nodes=1, rounds=1, crashes=1)):
        every = explore(config, settle="all")
        bounds = explore(config, settle="bounds")
        assert every.complete and bounds.complete
        assert every.violation is None and bounds.violation is None, bounds.violation
        assert every.distinct == bounds.distinct and bounds.fair > 0
    buggy = Config(nodes=1, rounds=1, leave=False, bugs=frozenset({"stale-lease"}))
    found = [explore(buggy, settle=s).violation for s in ("all", "bounds")]
    assert all(v is not None and v.name == "eventually-committed" for v in found), found
