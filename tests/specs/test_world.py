"""The world model's semantics: create-only objects under the real keys, faulty creates,
crashes and restarts, the timing discipline, and the view's normalization of time."""

from __future__ import annotations

import hashlib

import pytest

import specs.view
from gradientmail.core import keys
from gradientmail.core.records import Commit
from specs.config import Config
from specs.explore import explore, replay
from specs.mailbox import SnapObj
from specs.state import LOOPS, Event, World
from specs.view import fingerprint, view
from specs.world import apply, enabled, initial, may_tick, runnable, try_apply

ONE = Config(nodes=1, rounds=2, faults=2, crashes=1, leave=False)


def run(config: Config, events: list[Event]) -> World:
    world = initial(config)
    for event in events:
        after = try_apply(world, event)
        assert after is not None, f"{event} is not enabled"
        world = after
    return world


def due(world: World, i: int = 0, *, outcome: str = "ok") -> World:
    """Every loop step of node ``i`` that is due, until none is (``outcome`` for the first
    step that creates)."""
    for _ in range(100):
        loops = [loop for loop in LOOPS if runnable(world.node(i), loop)]
        if not loops:
            return world
        for loop in loops:
            if outcome != "ok":
                after = try_apply(world, Event("step", i, loop=loop, outcome=outcome))
                if after is not None:
                    world, outcome = after, "ok"
                    continue
            world = apply(world, Event("step", i, loop=loop))
    raise AssertionError("loops never settle")


def joined(config: Config = ONE) -> World:
    return due(apply(initial(config), Event("join", 0)))


def published(config: Config = ONE, *, outcome: str = "ok") -> World:
    """Node 0 joined, trained a step (which publishes round 0) and its loops caught up."""
    return due(apply(joined(config), Event("train", 0)), outcome=outcome)


def test_every_object_lies_under_a_real_key() -> None:
    world = published()
    kinds = {keys.parse(key).kind for key, _ in world.mailbox.items()}
    assert kinds == {"manifest", "init", "lease", "snapshot", "claim", "params", "state", "commit",
                     "head"}  # fmt: skip


def test_a_lone_node_closes_and_merges_its_round() -> None:
    world = published()
    commit = world.mailbox.get(keys.commit(0))
    assert isinstance(commit, Commit) and commit.includes("n0")
    world = apply(world, Event("train", 0))  # merges the delivered commit first
    assert world.node(0).trainer is not None
    assert world.node(0).trainer.fragments[0].merged == 0


def running(world: World, i: int = 0) -> World:
    """Node ``i``'s loops and the clock, until its join is done (a restart waits to see its
    old lease stand still: Decision 9)."""
    for _ in range(10):
        world = due(world, i)
        if world.node(i).running:
            return world
        world = apply(world, Event("tick"))
    raise AssertionError("the join never ends")


def test_a_restarted_node_misses_the_round_its_old_snapshot_holds() -> None:
    world = apply(joined(), Event("train", 0))
    world = apply(world, Event("step", 0, loop="learner"))  # round 0's snapshot is out
    first = world.mailbox.get(keys.snapshot(0, "n0"))
    assert isinstance(first, SnapObj) and first.epoch == 1
    world = running(apply(apply(world, Event("crash", 0)), Event("join", 0)))
    assert world.node(0).epoch == 2 and world.mailbox.get(keys.commit(0)) is None
    world = due(apply(world, Event("train", 0)))  # publishes round 0 again: the key is taken
    again = world.mailbox.get(keys.snapshot(0, "n0"))
    assert again == first  # create-only: not replaced
    commit = world.mailbox.get(keys.commit(0))
    assert isinstance(commit, Commit) and commit.included[0].nonce == first.record.nonce
    world = apply(world, Event("train", 0))  # the commit counts the dead process's snapshot
    trainer = world.node(0).trainer
    assert trainer is not None and trainer.fragments[0].outstanding == 1  # rebased, at once


def test_an_ambiguous_upload_is_read_back_as_ours() -> None:
    world = published(outcome="ambiguous@snapshot")
    assert world.faults == 1
    commit = world.mailbox.get(keys.commit(0))
    assert isinstance(commit, Commit) and commit.includes("n0")


def test_a_lost_commit_create_is_retried() -> None:
    world = published(outcome="lost@commit")
    assert world.faults == 1 and isinstance(world.mailbox.get(keys.commit(0)), Commit)
    assert world.commit_writes == ((0, 1),)


def test_an_ambiguous_commit_keeps_its_payloads() -> None:
    world = published(outcome="ambiguous@commit")
    commit = world.mailbox.get(keys.commit(0))
    assert isinstance(commit, Commit) and commit.params.key in world.mailbox
    assert world.commit_writes == ((0, 1),) and world.faults == 1


def test_a_crash_loses_volatile_state_and_a_restart_rejoins_from_the_newest_commit() -> None:
    world = apply(published(), Event("crash", 0))
    down = world.node(0)
    assert down.status == "down" and down.trainer is None and down.syncer is None
    lease_before = world.mailbox.get(keys.lease("n0"))
    world = running(apply(world, Event("join", 0)))
    node = world.node(0)
    assert node.epoch == 2 and node.trainer is not None
    assert node.trainer.fragments[0].merged == 0 and node.learner is not None
    assert node.learner.state.next == (1,)
    assert world.mailbox.get(keys.lease("n0")) != lease_before


def test_time_waits_for_every_running_nodes_loops() -> None:
    world = apply(joined(), Event("train", 0))
    assert runnable(world.node(0), "learner")  # the capture is due for upload
    assert not may_tick(world) and Event("tick") not in enabled(world)
    world = due(world)
    assert may_tick(world) and Event("tick") in enabled(world)


def test_the_view_drops_absolute_time_and_lease_counters() -> None:
    world = published()
    shifted = world._replace(
        time=world.time + 100,
        nodes=tuple(n._replace(clock=n.clock + 100) for n in world.nodes),
    )
    assert fingerprint(shifted) != fingerprint(world)  # stamps are not shifted: ages differ
    steady = world
    for _ in range(40):
        steady = due(apply(steady, Event("tick")))
    # Idle, a node's timers repeat with the period of its idle commit poll (Config.idle_polls).
    later = steady
    for _ in range(world.config.idle_polls):
        later = due(apply(later, Event("tick")))
    assert later.time == steady.time + world.config.idle_polls
    assert view(later) == view(steady) and fingerprint(later) == fingerprint(steady)


@pytest.mark.parametrize(
    "config",
    [
        Config(nodes=2, rounds=1, leave=False, quick_leases=True, idle_polls=1),
        Config(nodes=2, rounds=1, leave=False, quick_leases=True, idle_polls=1, exact=True),
        Config(nodes=2, rounds=1, drift=1),
    ],
    ids=Config.describe,
)
def test_a_cached_fingerprint_is_that_of_the_view_encoded_afresh(config: Config) -> None:
    """The fingerprint reuses the encodings of parts a world shares with others, down to the
    records nested in a loop, some under every node's clock at once: each equals the blake2b of
    ``repr(view)`` computed with nothing cached."""
    worlds: list[World] = []
    explore(config, liveness=False, max_states=3_000, visit=worlds.append)
    warm = [fingerprint(w) for w in worlds]
    for world, fp in zip(worlds, warm, strict=True):
        specs.view._clear()
        assert fp == hashlib.blake2b(repr(view(world)).encode(), digest_size=16).digest()


def test_a_replayed_trace_goes_through_the_same_worlds() -> None:
    events = [Event("join", 0), Event("step", 0, loop="join"), Event("step", 0, loop="join")]
    worlds = replay(ONE, events)
    assert len(worlds) == len(events) + 1 and worlds[-1] == run(ONE, events)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"lease_timeout": 2}, "lease_timeout"),
        ({"takeover": 2}, "takeover"),
        ({"bugs": frozenset({"typo"})}, "bugs"),
        ({"bugs": frozenset({"no-takeover", "takeover-now"})}, "one at a time"),
        ({"grain": "loop"}, "grain"),
        ({"nodes": 0}, "nodes"),
        ({"nodes": 10}, "nodes"),
    ],
)
def test_bad_configurations_are_refused(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Config(**changes)  # type: ignore[arg-type]
