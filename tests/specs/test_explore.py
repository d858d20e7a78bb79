"""The explorer: exact state counts of small worlds (a model change shows up here), the CI
configurations, planted bugs caught with shortest traces, counterexamples replayed as tests,
symmetry, fingerprints that ignore Python's hash seed, the random walk and the command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from specs.__main__ import main
from specs.config import Config
from specs.explore import explore, random_walk, replay
from specs.invariants import check
from specs.liveness import settle
from specs.state import Event, World
from specs.view import fingerprint
from specs.world import initial, successors

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("config", "generated", "distinct", "depth"),
    [
        (Config(nodes=1, rounds=1), 69, 38, 10),
        (Config(nodes=1, rounds=2), 123, 68, 17),
        (Config(nodes=1, fragments=2, rounds=3, faults=1), 1259, 637, 30),
        (Config(nodes=2, rounds=1, leave=False, quorum=2, grace=1), 3843, 1694, 34),
    ],
    ids=lambda value: value.describe() if isinstance(value, Config) else None,
)
def test_state_counts(config: Config, generated: int, distinct: int, depth: int) -> None:
    """Exact counts: a change to the model or to a core rule changes them (update on purpose)."""
    result = explore(config, liveness=False)
    assert result.complete and result.violation is None
    assert (result.generated, result.distinct, result.depth) == (generated, distinct, depth)


CI_CONFIGS = [
    Config(nodes=1, rounds=2, crashes=1, faults=1),
    Config(nodes=2, rounds=1, leave=False),
    Config(nodes=2, rounds=1, leave=False, quorum=2, grace=1),
]
SLOW_CONFIGS = [
    Config(nodes=1, rounds=2, crashes=1, faults=1, pauses=1),
    Config(nodes=2, rounds=1),
    Config(nodes=2, rounds=1, leave=False, faults=1),
    Config(nodes=2, rounds=1, leave=False, crashes=1),
    Config(nodes=2, fragments=2, rounds=2, leave=False),
]


@pytest.mark.parametrize("config", CI_CONFIGS, ids=Config.describe)
def test_ci_configuration_holds(config: Config) -> None:
    """Every safety invariant, deadlock freedom and liveness hold in every reachable state."""
    result = explore(config)
    assert result.complete, result
    assert result.violation is None, result.violation


@pytest.mark.slow
@pytest.mark.parametrize("config", SLOW_CONFIGS, ids=Config.describe)
def test_larger_configuration_holds(config: Config) -> None:
    result = explore(config, liveness=False)
    assert result.complete and result.violation is None, result.violation


# Planted bugs (Decision 12): the smallest world that shows each, the property it breaks, and
# the length of the shortest trace (breadth-first).
PLANTED = [
    ("rebase-included", Config(nodes=1, rounds=1, leave=False), "merges-forward", 8),
    ("no-readback", Config(nodes=1, rounds=1, leave=False, faults=1), "included-exist", 7),
    ("no-takeover", Config(nodes=2, rounds=1, leave=False, crashes=1), "eventually-committed", 8),
    (
        "commit-not-create-only",
        Config(nodes=2, rounds=1, leave=False, pauses=1),
        "commit-once",
        18,
    ),
]


@pytest.mark.parametrize(
    ("bug", "config", "broken", "length"), PLANTED, ids=[p[0] for p in PLANTED]
)
def test_planted_bug_is_caught_with_a_shortest_trace(
    bug: str, config: Config, broken: str, length: int
) -> None:
    planted = attrs.evolve(config, bugs=frozenset({bug}))
    result = explore(planted, liveness=broken == "eventually-committed")
    assert result.violation is not None and result.violation.name == broken
    assert len(result.violation.trace) == length
    # Without the bug, the same steps break nothing and the healed schedule still finishes.
    worlds = replay(config, result.violation.trace)
    assert all(check(world) is None for world in worlds)
    assert settle(worlds[-1]).ok


@pytest.mark.slow
def test_a_late_takeover_is_benign() -> None:
    """Takeover timing is a performance rule: with ``takeover=0`` nothing the brief promises
    breaks, since commits are create-only (the cost is duplicate work)."""
    config = Config(
        nodes=2, rounds=1, leave=False, pauses=1, bugs=frozenset({"no-takeover-timeout"})
    )
    assert explore(config, liveness=False).violation is None


# The shortest counterexample of commit-not-create-only, as printed by ``python -m specs``.
OVERWRITE = [
    Event("join", 0),
    Event("train", 0),
    Event("upload", 0),
    Event("tick"),
    Event("sync", 0),
    Event("pause", 0),
    Event("join", 1),
    Event("train", 1),
    Event("upload", 1),
    Event("tick"),
    Event("sync", 1),
    Event("tick"),
    Event("sync", 1),
    Event("tick"),
    Event("resume", 0),
    Event("commit", 0),
    Event("sync", 1),
    Event("commit", 1),
]


def test_a_counterexample_replays_as_a_regression() -> None:
    config = Config(nodes=2, rounds=1, leave=False, pauses=1)
    for world in replay(config, OVERWRITE):
        assert check(world) is None
    buggy = Config(
        nodes=2, rounds=1, leave=False, pauses=1, bugs=frozenset({"commit-not-create-only"})
    )
    worlds = replay(buggy, OVERWRITE)
    assert check(worlds[-2]) is None
    assert check(worlds[-1]) == ("commit-once", "round 0 was committed 2 times")


def test_symmetry_explores_a_subset_of_the_orbits() -> None:
    """Node permutation is not an exact symmetry (the closer rotation depends on node ids): the
    reduced exploration sees only orbits of reachable states, and misses a few of them."""
    config = Config(nodes=2, rounds=1, leave=False, quorum=2, grace=1)
    full = _reachable(config, symmetry=False)
    reduced = _reachable(config, symmetry=True)
    orbits = {fingerprint(world, symmetry=True) for world in full}
    assert {fingerprint(world, symmetry=True) for world in reduced} <= orbits
    assert (len(full), len(orbits), len(reduced)) == (1694, 1210, 1186)


def test_fingerprints_do_not_depend_on_the_hash_seed() -> None:
    code = (
        "from specs.config import Config; from specs.explore import explore, replay;"
        "from specs.view import fingerprint; from specs.state import Event;"
        "w = replay(Config(nodes=2, rounds=1), [Event('join', 0), Event('join', 1),"
        " Event('train', 1)])[-1];"
        "print(fingerprint(w).hex(), fingerprint(w, symmetry=True).hex())"
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


def test_the_command_prints_a_trace_or_no_violation(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explore", "--nodes", "1", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "distinct states:  38" in out and "no violation (complete)" in out
    assert (
        main(["explore", "--nodes", "1", "--rounds", "1", "--no-leave", "--bug", "rebase-included"])
        == 1
    )
    out = capsys.readouterr().out
    assert "VIOLATION (invariant) merges-forward" in out
    assert "5. n0 sync" in out and "EVENTS = [Event('join', 0)" in out


def _reachable(config: Config, *, symmetry: bool) -> list[World]:
    world = initial(config)
    seen = {fingerprint(world, symmetry=symmetry): world}
    frontier = [world]
    while frontier:
        nxt = []
        for w in frontier:
            for _, after in successors(w):
                fp = fingerprint(after, symmetry=symmetry)
                if fp not in seen:
                    seen[fp] = after
                    nxt.append(after)
        frontier = nxt
    return list(seen.values())


# Real bugs the random walk found (shortest known traces), both about a reader that skips
# commits whose payloads were collected (Decision 7), as the shell's ``Learner._poll_fragment``
# does. SKIP_COUNTED: n1 commits round 0 with its own snapshot and pauses before polling it; n0
# commits rounds 1 and 2, which collects round 0's payloads. n1 resumes, skips to round 2, and
# ``on_commit(round=2, included=False)`` takes its counted snapshot for a missed one: it merges
# "since base" and rebases those samples into round 3, so they count twice.
SKIP_COUNTED = [
    Event("join", 1), Event("train", 1), Event("upload", 1), Event("tick"), Event("sync", 1),
    Event("commit", 1), Event("join", 0), Event("train", 0), Event("upload", 0),
    Event("pause", 1), Event("tick"), Event("sync", 0), Event("commit", 0), Event("poll", 0),
    Event("merge", 0), Event("train", 0), Event("upload", 0), Event("tick"), Event("sync", 0),
    Event("commit", 0), Event("poll", 0), Event("merge", 0), Event("train", 0),
    Event("resume", 1), Event("poll", 1), Event("sync", 1), Event("merge", 1),
]  # fmt: skip
# SKIP_WATCHED: n1 publishes into round 0 late, after n0 committed rounds 0 to 2 and collected
# round 0; n1's learner skips to round 2, but its ledger never learns that round 0 committed,
# so its syncer watches round 0 (a LIST every poll, and new claims) forever.
SKIP_WATCHED = [
    Event("join", 0), Event("train", 0), Event("upload", 0), Event("tick"), Event("join", 1),
    Event("sync", 0), Event("train", 1), Event("pause", 1), Event("commit", 0), Event("poll", 0),
    Event("merge", 0), Event("tick"), Event("train", 0), Event("upload", 0), Event("sync", 0),
    Event("commit", 0), Event("poll", 0), Event("merge", 0), Event("tick"), Event("train", 0),
    Event("upload", 0), Event("resume", 1), Event("sync", 0), Event("sync", 1),
    Event("commit", 0), Event("upload", 1), Event("poll", 1),
]  # fmt: skip
SKIPS = {
    "counted": (
        SKIP_COUNTED,
        "merges-forward",
        "n1 merged round 2 since its base though the commit counts its snapshot",
    ),
    "watched": (
        SKIP_WATCHED,
        "watches-end",
        "n1 watches round 0 forever: its learner skipped that commit",
    ),
}
SKIPPING = Config(nodes=2, rounds=4, pauses=1)


@pytest.mark.parametrize("case", sorted(SKIPS))
def test_skipping_collected_commits(case: str) -> None:
    worlds = replay(SKIPPING, SKIPS[case][0])
    assert [check(world) for world in worlds] == [None] * len(worlds)
    assert settle(worlds[-1]).ok


@pytest.mark.parametrize("case", sorted(SKIPS))
def test_the_skipping_bug_found_lives_on_as_a_planted_bug(case: str) -> None:
    events, name, message = SKIPS[case]
    buggy = attrs.evolve(SKIPPING, bugs=frozenset({"skip-forgets"}))
    assert check(replay(buggy, events)[-1]) == (name, message)
