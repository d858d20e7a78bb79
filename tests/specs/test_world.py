"""The world model's semantics: create-only objects under the real keys, faulty writes, crashes
and restarts, the timing discipline, and the view's normalization of time."""

from __future__ import annotations

import pytest

from gradientmail.core import keys
from specs.config import Config
from specs.explore import replay
from specs.mailbox import CommitObj, SnapObj
from specs.state import Event, World
from specs.view import fingerprint, view
from specs.world import apply, enabled, initial, try_apply

ONE = Config(nodes=1, rounds=2, faults=2, crashes=1, leave=False)
PUBLISHED = [Event("join", 0), Event("train", 0), Event("upload", 0), Event("tick")]
CLAIMED = [*PUBLISHED, Event("sync", 0)]


def run(config: Config, events: list[Event]) -> World:
    world = initial(config)
    for event in events:
        after = try_apply(world, event)
        assert after is not None, f"{event} is not enabled"
        world = after
    return world


def test_every_object_lies_under_a_real_key() -> None:
    world = run(ONE, [*CLAIMED, Event("commit", 0), Event("poll", 0)])
    kinds = {keys.parse(key).kind for key, _ in world.mailbox.items()}
    assert kinds == {"manifest", "lease", "snapshot", "claim", "params", "commit"}


def test_a_restarted_node_misses_the_round_its_old_snapshot_holds() -> None:
    world = run(ONE, [*PUBLISHED, Event("crash", 0), Event("join", 0), Event("train", 0)])
    node = world.node(0)
    assert node.epoch == 2 and node.jobs[0].round == 0
    world = run(
        ONE,
        [*PUBLISHED, Event("crash", 0), Event("join", 0), Event("train", 0), Event("upload", 0)],
    )
    snapshot = world.mailbox.get(keys.snapshot(0, "n0"))
    assert isinstance(snapshot, SnapObj) and snapshot.epoch == 1  # create-only: not replaced
    assert world.node(0).jobs == () and world.node(0).watched == (0,)


def test_an_ambiguous_upload_is_read_back_as_ours() -> None:
    world = run(ONE, [Event("join", 0), Event("train", 0), Event("upload", 0, outcome="ambiguous")])
    assert world.node(0).jobs[0].retried
    assert keys.snapshot(0, "n0") in world.mailbox
    world = run(
        ONE,
        [
            Event("join", 0),
            Event("train", 0),
            Event("upload", 0, outcome="ambiguous"),
            Event("upload", 0),
        ],
    )
    assert world.node(0).jobs == () and world.faults == 1


def test_a_lost_commit_is_retried() -> None:
    world = run(ONE, [*CLAIMED, Event("commit", 0, outcome="lost")])
    assert keys.commit(0) not in world.mailbox and world.node(0).work is not None
    world = apply(world, Event("commit", 0))
    assert isinstance(world.mailbox.get(keys.commit(0)), CommitObj)
    assert world.commit_writes == ((0, 1),) and world.node(0).work is None


def test_an_ambiguous_commit_keeps_its_payloads() -> None:
    world = run(ONE, [*CLAIMED, Event("commit", 0, outcome="ambiguous"), Event("commit", 0)])
    commit = world.mailbox.get(keys.commit(0))
    assert isinstance(commit, CommitObj) and commit.params_key in world.mailbox
    assert world.commit_writes == ((0, 1),)


def test_a_crash_loses_volatile_state_and_a_restart_rejoins_from_the_newest_commit() -> None:
    world = run(ONE, [*CLAIMED, Event("commit", 0), Event("crash", 0)])
    down = world.node(0)
    assert down.status == "down" and down.learner is None and down.work is None
    lease_before = world.mailbox.get(keys.lease("n0"))
    world = apply(world, Event("join", 0))
    node = world.node(0)
    assert node.epoch == 2 and node.learner is not None
    assert node.learner.fragments[0].merged == 0 and node.next_poll == (1,)
    assert world.mailbox.get(keys.lease("n0")) != lease_before


def test_time_waits_for_every_running_nodes_loops() -> None:
    world = run(ONE, PUBLISHED)  # the tick happened after the upload
    assert Event("tick") not in enabled(world)  # its syncer pass of this tick is due
    world = apply(world, Event("sync", 0))  # claims round 0: the commit is due
    assert Event("tick") not in enabled(world)
    world = apply(world, Event("commit", 0))
    assert Event("tick") not in enabled(world)  # the commit must be polled
    assert Event("tick") in enabled(apply(world, Event("poll", 0)))


def test_the_view_drops_absolute_time_and_lease_counters() -> None:
    world = run(ONE, CLAIMED)
    shifted = world._replace(
        time=world.time + 100,
        nodes=tuple(n._replace(clock=n.clock + 100) for n in world.nodes),
    )
    assert fingerprint(shifted) != fingerprint(world)  # stamps are not shifted: ages differ
    ages_capped = run(ONE, [*CLAIMED, Event("commit", 0), Event("poll", 0)])
    for _ in range(20):
        ages_capped = apply(apply(ages_capped, Event("sync", 0)), Event("tick"))
    later = apply(apply(ages_capped, Event("sync", 0)), Event("tick"))
    assert later.time == ages_capped.time + 1
    assert view(later) == view(ages_capped) and fingerprint(later) == fingerprint(ages_capped)


def test_a_replayed_trace_goes_through_the_same_worlds() -> None:
    worlds = replay(ONE, CLAIMED)
    assert len(worlds) == len(CLAIMED) + 1 and worlds[-1] == run(ONE, CLAIMED)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"lease_timeout": 2}, "lease_timeout"),
        ({"takeover": 2}, "takeover"),
        ({"bugs": frozenset({"typo"})}, "bugs"),
        ({"nodes": 0}, "nodes"),
        ({"nodes": 10}, "nodes"),
    ],
)
def test_bad_configurations_are_refused(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Config(**changes)  # type: ignore[arg-type]
