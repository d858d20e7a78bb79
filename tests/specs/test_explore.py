"""The explorer: exact state counts of small worlds (a model change shows up here), the CI
configurations, every planted bug caught (breadth-first with a shortest trace where the world
is small enough, by the random walk where the race is deep), counterexamples replayed as tests,
fingerprints that ignore Python's hash seed, and the command line."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import attrs
import pytest
import worlds
from worlds import CI_CONFIGS, GATHER, GATHERED

from gradientmail.core import keys
from gradientmail.core.records import Commit
from specs.__main__ import main
from specs.bugs import BROKEN, BUGS
from specs.config import Config
from specs.explore import Result, explore, random_walk, replay
from specs.invariants import check, first_rounds_expect_all
from specs.liveness import settle
from specs.mailbox import Forged, commit_at, manifest_at, snapshot_at
from specs.state import Event, World
from specs.view import _mailbox as view_mailbox
from specs.view import fingerprint
from specs.world import initial, successors

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("config", "generated", "distinct", "depth"),
    [
        (Config(nodes=1, rounds=1), 2653, 1424, 44),
        (Config(nodes=1, rounds=2), 4469, 2382, 56),
        (Config(nodes=1, fragments=2, rounds=3, faults=1), 28691, 12593, 77),
    ],
    ids=lambda value: value.describe() if isinstance(value, Config) else None,
)
def test_state_counts(config: Config, generated: int, distinct: int, depth: int) -> None:
    """Exact counts: a change to the model or to a core rule changes them (update on purpose)."""
    result = explore(config, liveness=False)
    assert result.complete and result.violation is None
    assert (result.generated, result.distinct, result.depth) == (generated, distinct, depth)


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_off_while_exploring_and_as_it_was_after(enabled: bool) -> None:
    """The explorer pauses the cyclic garbage collector (its full passes over every state kept
    took a third of the time) and leaves it as it found it."""
    seen: list[bool] = []
    (gc.enable if enabled else gc.disable)()
    try:
        result = explore(Config(nodes=1, rounds=1), visit=lambda _: seen.append(gc.isenabled()))
        assert gc.isenabled() is enabled
    finally:
        gc.enable()
    assert result.complete and len(seen) == result.distinct == 1424
    assert not any(seen)


# Exhausted by hand (`--runslow`): 172,378 distinct states in about three minutes.
SLOW_CONFIGS = [
    Config(nodes=2, rounds=1, leave=False, faults=1, quick_leases=True, idle_polls=1),
]
# Worlds this machine does not exhaust (pauses, leaving, crashes of two nodes, two fragments:
# millions of states at this grain): checked breadth-first over their first states, so every
# interleaving up to the depth reached holds every safety property (docs/protocol.md).
BOUNDED_CONFIGS = [
    Config(nodes=1, rounds=2, crashes=1, faults=1, pauses=1),
    Config(nodes=2, rounds=1),
    Config(nodes=2, rounds=1, leave=False, crashes=1),
    Config(nodes=2, fragments=2, rounds=2, leave=False),
    Config(nodes=2, rounds=1, leave=False, forgeries=1),
    # A squatted snapshot key under the other node's name, before it publishes: the closer's
    # view counts it until a close refuses it, then decides again (closing.RoundState.refused).
    Config(
        nodes=2,
        rounds=1,
        leave=False,
        forgeries=1,
        squats=frozenset({"snapshot"}),
        quick_leases=True,
        idle_polls=1,
    ),
]
BOUND = 200_000


@pytest.fixture(scope="module")
def ci_explorations() -> dict[str, Future[Result]]:
    """The CI configurations this session selected, each explored whole in a worker process
    started with the session (``worlds.start``; minutes each): one future each, by the
    configuration's description."""
    return worlds.started()


@pytest.mark.parametrize("config", CI_CONFIGS, ids=Config.describe)
def test_ci_configuration_holds(config: Config, ci_explorations: dict[str, Future[Result]]) -> None:
    """Every safety invariant, deadlock freedom and liveness hold in every reachable state."""
    result = ci_explorations[config.describe()].result()
    assert result.config == config
    assert result.complete, result
    assert result.violation is None, result.violation
    assert result.fair > 0  # liveness on every fair schedule too (specs.fairness)


@pytest.mark.slow
@pytest.mark.parametrize("config", SLOW_CONFIGS, ids=Config.describe)
def test_larger_configuration_holds(config: Config) -> None:
    result = explore(config, liveness=False)
    assert result.complete and result.violation is None, result.violation


@pytest.mark.slow
@pytest.mark.parametrize("config", BOUNDED_CONFIGS, ids=Config.describe)
def test_the_first_states_of_larger_worlds_hold(config: Config) -> None:
    result = explore(config, liveness=False, max_states=BOUND)
    assert result.violation is None, result.violation
    assert result.complete or result.distinct >= BOUND


# Planted bugs (Decision 12): the smallest world that shows each, and the length of its
# shortest trace (breadth-first); the property each breaks is the registry's (specs/bugs.py).
SHALLOW = [
    ("rebase-included", Config(nodes=1, rounds=1, leave=False), 14),
    ("no-readback", Config(nodes=1, rounds=1, leave=False, faults=1), 12),
    ("gc-too-early", Config(nodes=1, rounds=2, leave=False), 21),
    ("chain-skips", Config(nodes=2, rounds=2, leave=False), 13),
    ("no-takeover", Config(nodes=2, rounds=1, leave=False, crashes=1), 13),
    ("takeover-now", Config(nodes=2, rounds=1, leave=False), 25),
    ("stale-lease", Config(nodes=1, rounds=1, leave=False), 14),
    ("leave-early", Config(nodes=1, rounds=1), 7),
]
# Races too deep to exhaust on this machine (a stalled closer taken over, a reader paused
# until its round's payloads are collected): the random walk over the same world finds them.
DEEP = [
    # 36 s here: CI finds it with the Hypothesis machine and the simulator, this --runslow.
    pytest.param(
        "commit-overwrite",
        Config(nodes=2, rounds=2, pauses=2, leave=False),
        4,
        marks=pytest.mark.slow,
        id="commit-overwrite",
    ),
    pytest.param(
        "skip-forgets",
        Config(nodes=2, rounds=3, pauses=1, keep=1, leave=False),
        3,
        id="skip-forgets",
    ),
]


def test_every_planted_bug_has_a_world_here() -> None:
    assert {bug for bug, *_ in SHALLOW} | {p.values[0] for p in DEEP} == set(BUGS)


@pytest.mark.parametrize(("bug", "config", "length"), SHALLOW, ids=[p[0] for p in SHALLOW])
def test_planted_bug_is_caught_with_a_shortest_trace(bug: str, config: Config, length: int) -> None:
    planted = attrs.evolve(config, bugs=frozenset({bug}))
    # A stall is found by the healed schedule from every state, breadth-first: the graph's
    # fair schedules judge only a world explored whole (test_fairness.py).
    result = explore(planted, liveness=BROKEN[bug] == "eventually-committed", settle="all")
    assert result.violation is not None and result.violation.name == BROKEN[bug]
    assert len(result.violation.trace) == length
    # Without the bug, the same steps break nothing and the healed schedule still finishes.
    worlds = replay(config, result.violation.trace)
    assert all(check(world) is None for world in worlds)
    assert settle(worlds[-1]).ok


@pytest.mark.parametrize(("bug", "config", "seed"), DEEP)
def test_a_deep_planted_bug_is_caught_by_the_random_walk(
    bug: str, config: Config, seed: int
) -> None:
    planted = attrs.evolve(config, bugs=frozenset({bug}))
    found = random_walk(planted, seed=seed, walks=300, depth=300, liveness=False).violation
    assert found is not None and found.name == BROKEN[bug]
    worlds = replay(config, found.trace)
    assert all(check(world) is None for world in worlds)


# The commit-overwrite race the walk found (seed 4), as printed by ``python -m specs``: n0
# claims round 0 and pauses before its commit; n1 takes the round over and commits it; n0
# resumes and writes its own record over n1's.
OVERWRITE = [
    Event("join", 0), Event("step", 0, loop="join"), Event("step", 0, loop="join"),
    Event("step", 0, loop="join"), Event("join", 1), Event("train", 0),
    Event("step", 1, loop="join"), Event("step", 0, loop="syncer"),
    Event("step", 1, loop="learner"), Event("step", 0, loop="syncer"),
    Event("step", 1, loop="syncer"), Event("step", 0, loop="learner"),
    Event("step", 0, loop="learner"), Event("step", 1, loop="syncer"), Event("train", 1),
    Event("step", 1, loop="learner"), Event("step", 0, loop="syncer"),
    Event("step", 1, loop="learner"), Event("step", 1, loop="syncer"),
    Event("step", 0, loop="syncer"), Event("step", 1, loop="syncer"), Event("pause", 0),
    Event("tick"), Event("step", 1, loop="syncer"), Event("step", 1, loop="learner"),
    Event("step", 1, loop="syncer"), Event("tick"), Event("step", 1, loop="syncer"),
    Event("step", 1, loop="learner"), Event("step", 1, loop="syncer"), Event("tick"),
    Event("step", 1, loop="learner"), Event("step", 1, loop="syncer"), Event("resume", 0),
    Event("step", 0, loop="syncer"), Event("step", 0, loop="learner"), Event("merge", 0),
    Event("step", 0, loop="syncer"), Event("step", 1, loop="syncer"),
    Event("step", 1, loop="syncer"), Event("step", 0, loop="learner"),
    Event("step", 1, loop="syncer"),
]  # fmt: skip


def test_a_counterexample_replays_as_a_regression() -> None:
    config = Config(nodes=2, rounds=2, pauses=2, leave=False)
    for world in replay(config, OVERWRITE):
        assert check(world) is None
    buggy = attrs.evolve(config, bugs=frozenset({"commit-overwrite"}))
    worlds = replay(buggy, OVERWRITE)
    assert check(worlds[-2]) is None
    assert check(worlds[-1]) == ("commit-once", "round 0 was committed 2 times")


# The real bug the old model's random walk found, found again on this world (seed 3): n1 is
# paused with its snapshot counted by round 2's commit unread, while n0's commits collect
# round 2's payloads; n0 then skips from round 2 to the newest commit, and judging its own
# snapshot by the newest commit alone would rebase samples round 2 already counted.
SKIP_COUNTED = [
    Event("join", 0), Event("join", 1), Event("step", 0, loop="join"),
    Event("step", 0, loop="join"), Event("step", 1, loop="join"), Event("step", 0, loop="join"),
    Event("step", 0, loop="learner"), Event("step", 0, loop="syncer"), Event("train", 1),
    Event("step", 0, loop="syncer"), Event("train", 0), Event("step", 1, loop="syncer"),
    Event("step", 0, loop="learner"), Event("step", 1, loop="syncer"),
    Event("step", 1, loop="learner"), Event("step", 1, loop="learner"),
    Event("step", 1, loop="syncer"), Event("step", 1, loop="syncer"),
    Event("step", 1, loop="syncer"), Event("step", 0, loop="learner"),
    Event("step", 1, loop="syncer"), Event("step", 1, loop="learner"), Event("merge", 1),
    Event("step", 0, loop="syncer"), Event("train", 1), Event("step", 1, loop="syncer"),
    Event("step", 0, loop="syncer"), Event("step", 1, loop="learner"),
    Event("step", 1, loop="learner"), Event("step", 1, loop="syncer"),
    Event("step", 1, loop="syncer"), Event("step", 1, loop="syncer"),
    Event("step", 1, loop="syncer"), Event("step", 1, loop="learner"), Event("merge", 1),
    Event("step", 1, loop="syncer"), Event("train", 1), Event("step", 1, loop="learner"),
    Event("step", 1, loop="learner"), Event("step", 1, loop="syncer"),
    Event("step", 1, loop="syncer"), Event("step", 1, loop="syncer"), Event("pause", 1),
    Event("tick"), Event("step", 0, loop="syncer"), Event("step", 0, loop="learner"),
    Event("merge", 0),
]  # fmt: skip
SKIPPING = Config(nodes=2, rounds=3, pauses=1, keep=1, leave=False)


def test_skipping_collected_commits() -> None:
    worlds = replay(SKIPPING, SKIP_COUNTED)
    assert [check(world) for world in worlds] == [None] * len(worlds)
    assert settle(worlds[-1]).ok


def test_the_skipping_bug_found_lives_on_as_a_planted_bug() -> None:
    buggy = attrs.evolve(SKIPPING, bugs=frozenset({"skip-forgets"}))
    name, message = check(replay(buggy, SKIP_COUNTED)[-1]) or ("", "")
    assert name == "merges-forward" and "since its base though the commit counts" in message


def test_without_the_start_barrier_a_first_round_can_close_on_a_view_older_than_a_join() -> None:
    """Issue #21's first rounds that closed early: a node that trains before it has seen the
    others closes its fragment's first round expecting only the nodes its lease view held,
    though another node had joined (a breadth-first search finds it within 20,000 states)."""
    found: list[str] = []

    def visit(world: World) -> None:
        message = first_rounds_expect_all(world, always=True)
        if message is not None:
            found.append(message)

    explore(GATHER, liveness=False, max_states=20_000, visit=visit)
    assert found
    assert found[0] in (
        "n0 closes round 0, a first round, expecting ['n0']: ['n1'] running and not expected",
        "n1 closes round 0, a first round, expecting ['n1']: ['n0'] running and not expected",
    )


def test_with_the_start_barrier_every_first_round_expects_every_node(
    ci_explorations: dict[str, Future[Result]],
) -> None:
    """The same world with ``Session.wait_for_nodes`` (``gather``): exhausted, and the
    invariant ``first-rounds-expect-all`` holds in every state (71,236 distinct states)."""
    result = ci_explorations[GATHERED.describe()].result()
    assert result.config == GATHERED
    assert result.complete and result.violation is None, result.violation


def protocol_state(world: World) -> str:
    """What the run has done, without any node's timers: the mailbox's objects and each
    node's process status, incarnation and trainer state (samples, rounds merged)."""
    nodes = tuple((n.status, n.epoch, repr(n.trainer), n.produced) for n in world.nodes)
    return repr((view_mailbox(world.mailbox), nodes))


@pytest.mark.parametrize(
    "config",
    [
        Config(nodes=1, rounds=1),
        Config(nodes=1, rounds=2),
        Config(nodes=1, rounds=2, faults=1, leave=False),
        Config(nodes=1, rounds=1, crashes=1, leave=False),
        # About three minutes: by hand (--runslow).
        pytest.param(
            Config(nodes=2, rounds=1, leave=False, quick_leases=True, idle_polls=1),
            marks=pytest.mark.slow,
        ),
    ],
    ids=Config.describe,
)
def test_the_reduced_view_explores_what_the_exact_view_does(config: Config) -> None:
    """The view keeps a lease's age only up to lease_timeout and not the time of the last LIST
    (specs/README.md): it merges states, never behaviours. Same violations (none), and the same
    protocol states reached, against the view that keeps every time up to the cap."""
    found: dict[bool, set[str]] = {}
    sizes = {}
    for exact in (True, False):
        seen: set[str] = set()
        result = explore(
            attrs.evolve(config, exact=exact),
            liveness=False,
            visit=lambda w, seen=seen: seen.add(protocol_state(w)),  # type: ignore[misc]
        )
        assert result.complete and result.violation is None, result
        found[exact], sizes[exact] = seen, result.distinct
    assert found[True] == found[False]
    assert sizes[False] <= sizes[True]


def test_fingerprints_do_not_depend_on_the_hash_seed() -> None:
    code = (
        "from specs.config import Config; from specs.explore import replay;"
        "from specs.view import fingerprint; from specs.state import Event;"
        "w = replay(Config(nodes=2, rounds=1), [Event('join', 0), Event('join', 1),"
        " Event('step', 1, loop='join'), Event('step', 1, loop='join')])[-1];"
        "print(fingerprint(w).hex())"
    )
    outputs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        outputs.add(done.stdout)
    assert len(outputs) == 1


def test_random_walks_hold_and_find_a_planted_bug() -> None:
    config = Config(nodes=3, fragments=2, rounds=4, crashes=1, faults=1, pauses=1, quorum=2)
    result = random_walk(config, seed=1, walks=5, depth=150)
    assert result.violation is None and result.generated > 0
    buggy = Config(nodes=2, rounds=3, bugs=frozenset({"rebase-included"}))
    found = random_walk(buggy, seed=1, walks=20, depth=150, liveness=False).violation
    assert found is not None and found.name in ("merges-forward", "samples-once")


def first_state(config: Config, wanted: Callable[[World], bool]) -> World:
    """Breadth-first over ``config``'s world: the first state ``wanted`` holds in, checking
    every state on the way against every invariant (and no round committed twice)."""
    world = initial(config)
    seen, frontier = {fingerprint(world)}, [world]
    while frontier:
        following = []
        for w in frontier:
            for _, after in successors(w):
                fp = fingerprint(after)
                if fp in seen:
                    continue
                seen.add(fp)
                assert check(after) is None, check(after)
                assert all(count == 1 for _, count in after.commit_writes)
                if wanted(after):
                    return after
                following.append(after)
        frontier = following
    raise AssertionError(f"no such state among {len(seen)}")


def test_a_squatted_commit_key_moves_the_commit_to_the_next_key() -> None:
    """The explored forger does reach the rounds it squats: breadth-first over a one-node world
    with two forgeries, some state has round 0's commit at its third key behind two squatted
    ones, every state holds every invariant, and no round is committed twice."""
    config = Config(nodes=1, rounds=1, forgeries=2, leave=False)
    found = first_state(
        config,
        lambda w: (
            isinstance(commit_at(w.mailbox, 0)[1], Commit)
            and isinstance(w.mailbox.get(keys.commit(0, 1)), Forged)
        ),
    )
    key, commit = commit_at(found.mailbox, 0)
    assert key == keys.commit(0, 2) and commit is not None
    assert isinstance(found.mailbox.get(keys.commit(0)), Forged)


def test_a_squatted_snapshot_key_moves_the_snapshot_and_its_round_includes_it() -> None:
    """A forgery at n0's first snapshot key of round 0, planted before n0 publishes: n0
    publishes at its next key, and round 0's commit includes it (core.slots)."""
    config = Config(nodes=1, rounds=1, forgeries=1, squats=frozenset({"snapshot"}), leave=False)

    def wanted(w: World) -> bool:
        commit = commit_at(w.mailbox, 0)[1]
        return (
            isinstance(commit, Commit)
            and isinstance(w.mailbox.get(keys.snapshot(0, "n0")), Forged)
            and commit.includes("n0")
        )

    found = first_state(config, wanted)
    key, snap = snapshot_at(found.mailbox, 0, "n0")
    assert key == keys.snapshot(0, "n0", 1) and snap is not None


def test_a_squatted_manifest_key_moves_the_run_to_the_next_key() -> None:
    """A forgery at ``manifest`` before the run exists: the run is created at
    ``manifest-0001``, and its first round commits."""
    config = Config(nodes=1, rounds=1, forgeries=1, squats=frozenset({"manifest"}), leave=False)
    found = first_state(
        config,
        lambda w: (
            isinstance(w.mailbox.get(keys.manifest(0)), Forged)
            and isinstance(commit_at(w.mailbox, 0)[1], Commit)
        ),
    )
    assert manifest_at(found.mailbox)[0] == keys.manifest(1)


def test_the_command_prints_a_trace_or_no_violation(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explore", "--nodes", "1", "--rounds", "1", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "distinct states:  1424" in out and "no violation (complete)" in out
    args = ["explore", "--nodes", "1", "--rounds", "1", "--no-leave", "--bug", "rebase-included"]
    assert main([*args, "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "VIOLATION (invariant) merges-forward" in out
    assert "n0 syncer" in out and "EVENTS = [Event('join', 0)" in out
