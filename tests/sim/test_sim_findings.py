"""What the simulator finds: planted bugs (Decision 12: each broken safeguard must be caught),
and regression tests for the protocol bugs it found (F1, F2, F4, F5; docs/protocol.md), each
replaying the settings and seeds that found it."""

from __future__ import annotations

import time
from typing import Any

import attrs
import pytest

from sim.sim_config import SimConfig
from sim.sim_world import Outcome, World, simulate
from sim.simulate import ddmin_delays, ddmin_faults, main, replay_command, run_seed, shrink
from specs.bugs import BUGS

# A small, fast cluster: 4 nodes, short leases, a round every 8 steps of 0.2 s.
BASE: dict[str, Any] = {
    "nodes": 4,
    "rounds": 8,
    "inner_steps": 8,
    "step_time": 0.2,
    "lease_every": 1.0,
    "lease_timeout": 3.0,
    "poll_interval": 0.25,
    "latency": "uniform",
    "latency_mean": 0.01,
    "keep_rounds": None,
}


def first_found(kind: str, seeds: range, **settings: Any) -> Outcome | None:
    """The first run among ``seeds`` that shows a violation of ``kind``."""
    for seed in seeds:
        outcome = simulate(SimConfig(seed=seed, **{**BASE, **settings}), keep_trace=False)
        if any(v.kind == kind for v in outcome.violations):
            return outcome
    return None


# Every planted bug of the registry (specs/bugs.py), the violation the simulator reports, and
# the faults that make it show within a few seeds.
PLANTED: list[tuple[str, str, dict[str, Any]]] = [
    # Decision 2's takeover timeout disabled: attempt 1 opens as soon as attempt 0 is seen.
    # Requests of 50 ms, so that a close (its reads fetched together) outlasts the others'
    # next poll, where they see its claim.
    ("takeover-now", "takeover-early", {"latency_mean": 0.05}),
    # The learner told its snapshot was never included: it rebases counted progress.
    ("rebase-included", "rebased-included", {}),
    # The closer deletes the commit key before its create; needs a stalled closer.
    ("commit-overwrite", "commit-twice", {"pause_on_write": 0.02, "pause_length": 2.0}),
    # Creates never read back: a closer whose commit landed with its answer lost deletes its
    # payloads, and the readers of that commit find its parameters gone for good. With an
    # overlap of 3 steps: a node held at the bound polls the commit four times an interval
    # (``Hurry``) and reads the parameters before they are deleted.
    ("no-readback", "node-failed", {"fail_after": 0.2, "overlap_steps": 3}),
    # No takeover: a closer that crashes after its claim leaves its round open forever.
    ("no-takeover", "liveness", {"crash_on_write": 0.05, "restart": 0.0}),
    # A reader skipping collected commits judges its snapshot by the newest one alone.
    (
        "skip-forgets",
        "rebased-included",
        {"keep_rounds": 1, "pause_rate": 20.0, "pause_length": 3.0},
    ),
    # Collection ignoring keep_rounds: the audit finds payloads gone that the rule keeps.
    ("gc-too-early", "audit", {"keep_rounds": 2}),
    # A chain walk that skips a commit: a restarted node joins holding an older commit.
    ("chain-skips", "join-newest", {"crash_rate": 20.0, "restart": 1.0, "downtime": 2.0}),
    # Newer leases ignored: a node calls a lease expired that its LIST showed renewed.
    ("stale-lease", "lease-expired-early", {}),
    # A leaving node's lease says left before its last snapshot landed: half the nodes leave.
    ("leave-early", "left-before-upload", {"leavers": 0.5}),
]


PLANTED_SETTINGS = {plant: settings for plant, _, settings in PLANTED}


def test_every_planted_bug_is_simulated() -> None:
    assert {plant for plant, _, _ in PLANTED} == set(BUGS)


@pytest.mark.parametrize(("plant", "kind", "settings"), PLANTED, ids=[p[0] for p in PLANTED])
def test_a_planted_bug_is_found_with_a_replayable_seed(
    plant: str, kind: str, settings: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    found = first_found(kind, range(6), plant=plant, **settings)
    assert found is not None, f"planted {plant} went unnoticed in 6 seeds"
    again = simulate(found.config, keep_trace=False)
    assert again.digest == found.digest and again.violations == found.violations
    assert f"--plant {plant}" in replay_command(found.config, {})
    # Shrunk to at most 3 nodes (issue #20), and the bug is what fails there: the same run
    # without the plant holds.
    # (The latencies' shrink, which can take the whole budget, has its own tests below.)
    small, overrides = shrink(found, budget=60.0, latencies=False)
    assert small.config.nodes <= 3, (plant, overrides)
    assert small.violations[0].kind == kind
    assert simulate(attrs.evolve(small.config, plant=None), keep_trace=False).violations == ()
    # Delta debugging left only faults the violation needs: without any one, it is gone.
    for fault in small.faults:
        rest = tuple(f for f in small.faults if f != fault)
        without = simulate(attrs.evolve(small.config, faults_kept=rest), keep_trace=False)
        assert [v.kind for v in without.violations[:1]] != [kind], (plant, fault)
    replay = replay_command(small.config, overrides).split("python -m sim.simulate ")[1]
    assert main(replay.split()) == 1, replay  # the one command replays the shrunk run
    assert f"[{kind}]" in capsys.readouterr().out


def test_delta_debugging_keeps_only_the_faults_a_violation_needs() -> None:
    # Creates never read back, every write failing after it lands one time in five: seed 0's
    # run fires 18 faults, and the lost reply of one commit is what fails a reader.
    config = SimConfig(seed=0, **{**BASE, **PLANTED_SETTINGS["no-readback"]}, plant="no-readback")
    found = simulate(config)
    assert found.violations[0].kind == "node-failed" and len(found.faults) >= 10
    small = ddmin_faults(found, deadline=time.perf_counter() + 120.0)
    assert small.violations[0].kind == "node-failed"
    assert len(small.faults) <= 3, small.faults
    assert small.config.faults_kept == tuple(sorted(set(small.faults)))
    # The kept faults are what fires, named in the trace; the run replays from its config.
    fired = [what for _, _, what in small.trace if what.startswith("fault ")]
    assert [what.split()[1].rstrip(":") for what in fired] == list(small.faults)
    again = simulate(small.config)
    assert again.digest == small.digest and again.violations == small.violations


def test_kept_latencies_wait_as_drawn_and_none_kept_is_no_latency() -> None:
    config = SimConfig(seed=2, **BASE)
    traced = simulate(config)
    assert len(traced.delays) > 100  # every request's two legs, named
    assert simulate(config, keep_trace=False).delays == ()  # a swarm's run names none
    waited = tuple(sorted(set(traced.delays)))
    assert simulate(attrs.evolve(config, latency_kept=waited)).digest == traced.digest
    zero = simulate(attrs.evolve(config, latency_kept=()))
    assert zero.delays == () and zero.digest != traced.digest
    assert zero.digest == simulate(attrs.evolve(config, latency="none")).digest


def test_delta_debugging_keeps_only_the_request_latencies_a_violation_needs() -> None:
    # A takeover opened at once is seen only while a close outlasts the others' next poll:
    # without latency the run holds, so some slow requests are what fails it.
    found = first_found("takeover-early", range(6), plant="takeover-now", latency_mean=0.05)
    assert found is not None
    traced = simulate(found.config)
    assert traced.digest == found.digest and len(traced.delays) > 100
    assert not simulate(attrs.evolve(found.config, latency_kept=())).violations
    small = ddmin_delays(traced, deadline=time.perf_counter() + 120.0)
    assert small.violations[0].kind == "takeover-early"
    assert 0 < len(small.delays) < len(traced.delays) / 4, len(small.delays)
    assert small.config.latency_kept == tuple(sorted(set(small.delays)))
    for delay in small.delays:  # none can be dropped: each is slowness the violation needs
        rest = tuple(d for d in small.delays if d != delay)
        without = simulate(attrs.evolve(small.config, latency_kept=rest), keep_trace=False)
        assert [v.kind for v in without.violations[:1]] != ["takeover-early"], delay
    named = [what.split()[1].rstrip(":") for _, _, what in small.trace if what.startswith("delay ")]
    assert named == list(small.delays)  # the trace names each one it waited
    again = simulate(small.config)
    assert again.digest == small.digest and again.violations == small.violations
    replay = replay_command(small.config, {"latency_kept": ",".join(small.delays)})
    assert "latency_kept=" in replay


def test_without_a_plant_the_base_runs_are_clean() -> None:
    for seed in range(3):
        outcome = simulate(SimConfig(seed=seed, **BASE), keep_trace=False)
        assert outcome.violations == (), outcome.violations
        assert outcome.committed >= 8 and outcome.node_rounds >= 4 * 8


@pytest.mark.parametrize(("plant", "kind", "settings"), PLANTED, ids=[p[0] for p in PLANTED])
def test_without_the_plant_the_same_runs_are_clean(
    plant: str, kind: str, settings: dict[str, Any]
) -> None:
    for seed in range(3):
        outcome = simulate(SimConfig(seed=seed, **{**BASE, **settings}), keep_trace=False)
        assert outcome.violations == (), outcome.violations
        assert outcome.committed >= 8


def test_f1_a_lease_missing_from_one_listing_does_not_expire_it() -> None:
    # The swarm seeds that found it (8 nodes, 10 rounds; stale_list=0.3 in both).
    for seed in (9, 24):
        outcome = run_seed(seed, nodes=8, rounds=10, keep_trace=False)
        assert outcome.violations == (), outcome.violations


def test_f6_nodes_held_in_opposite_phases_publish_what_they_owe() -> None:
    # Found by the 200-seed swarm (seed 107; 8 nodes, 2 fragments, a quorum of every node,
    # overlap 1): two late joiners were each held by a round the other had yet to publish, and
    # two rounds never committed. A node held at the bound now publishes the rounds it owes
    # first. Seeds 3 and 140 of these settings show it with the code of session 19 (seed 107's
    # draws, then seed 48's, have since changed; a node held at the bound now polls its commit
    # four times an interval): without the held rule both stop at 4 commits with a liveness
    # violation.
    fixed = {
        "quorum_size": 8,
        "late_joiners": 0.5,
        "overlap_steps": 1,
        "fragments": 2,
        "inner_steps": 4,
        "grace": 5.0,
    }
    for seed in (3, 140):
        outcome = run_seed(seed, nodes=8, rounds=6, fixed=fixed, keep_trace=False)
        assert outcome.violations == (), outcome.violations
        assert outcome.committed >= 8


# Nodes that crash and never restart, polling slowly: F2's runs, and the lease replayer's.
DEAD_FOR_GOOD: dict[str, Any] = {
    "rounds": 10,
    "poll_interval": 1.0,
    "quorum_size": 4,
    "crash_rate": 20.0,
    "restart": 0.0,
}


def test_f2_a_dead_node_expires_however_slowly_its_observers_poll() -> None:
    assert first_found("liveness", range(3), **DEAD_FOR_GOOD) is None


def test_f4_a_stalled_closer_survives_its_inputs_being_collected() -> None:
    settings = {
        "rounds": 30,
        "inner_steps": 4,
        "keep_rounds": 2,
        "pause_rate": 30.0,
        "pause_length": 4.0,
    }
    assert first_found("node-failed", range(1, 4), **settings) is None


def test_f5_a_collected_claim_is_not_won_again() -> None:
    settings = {
        "rounds": 12,
        "inner_steps": 4,
        "keep_rounds": 2,
        "pause_on_write": 0.02,
        "pause_length": 6.0,
    }
    assert first_found("audit", range(3), **settings) is None


def test_replayed_leases_keep_no_dead_node_alive() -> None:
    """A writer without the secret puts every lease back as it was a moment before: a crashed
    node's last genuine lease again and again (it never restarts), a live node's older renewals
    between its own. Observers judge the record (core.leases): the dead stay dead and every
    round commits in time, the live are never expired early, and the replays are reported.
    With session 10's judgement (a new version of the same size is a renewal) the same three
    seeds stall for good: the dead node looks alive, its rounds wait for it, and the run ends
    at the time limit with liveness violations (measured in session 11)."""
    settings = {**DEAD_FOR_GOOD, "replay_leases": True}
    for seed in range(3):
        outcome = simulate(SimConfig(seed=seed, **{**BASE, **settings}), keep_trace=True)
        assert outcome.violations == (), outcome.violations
        assert outcome.notes.get("lease replayed", 0) > 100, outcome.notes
        crashed = [what for _, _, what in outcome.trace if "crash" in what]
        replays = [what for _, _, what in outcome.trace if "replayed: " in what]
        assert replays, "observers saw and refused replays"
        if crashed:
            return  # a seed where a node died and stayed dead under the replays: shown
    raise AssertionError("no seed crashed a node")


def test_nodes_that_close_together_do_not_wait_out_a_takeover() -> None:
    """Four nodes, no fault, all calling ``close()`` within a few seconds: each close ends in
    a few seconds. Found in session 19 (a 3-process bench's ``close()`` took the 60 s
    ``lease_timeout``), two ways, both in these seeds: the closer order put leaving nodes last,
    and each node, seeing itself leaving and the others not yet, left its final rounds to
    another (seeds 1 and 5: every close took 20 s); and the last node to leave never listed the
    leases again, so it left its last rounds to nodes already gone (seed 3: 22 s)."""
    settings = {
        "nodes": 4,
        "rounds": 6,
        "inner_steps": 8,
        "fragments": 2,
        "overlap_steps": 1,
        "latency": "exponential",
        "latency_mean": 0.05,
        "lease_every": 2.0,
        "lease_timeout": 20.0,
    }
    for seed in (1, 3, 5):
        outcome = simulate(SimConfig(seed=seed, **settings))
        assert outcome.violations == (), outcome.violations
        began = {who: t for t, who, what in outcome.trace if what == "closing"}
        took = {who: t - began[who] for t, who, what in outcome.trace if what == "closed"}
        assert len(took) == 4, took
        assert max(took.values()) < 10.0, (seed, took)  # takeover is 20 s


def test_the_liveness_bound_allows_for_the_slowest_of_many_nodes_requests() -> None:
    # Swarm seed 69 at 64 nodes: a quorum of all 64, three fragments, a pareto latency of
    # 0.3 s mean. Every round waits on the slowest of 64 nodes' requests, about 40 s a round,
    # and a round first published early waits for the three before it: round 3, published at
    # 27 s, committed at 163 s. The bound (106 s) had allowed latency as measured at 8 nodes.
    def bound(nodes: int, **settings: Any) -> float:
        return World(SimConfig(seed=0, nodes=nodes, **settings)).bound

    pareto = {"latency": "pareto", "latency_mean": 0.3, "fragments": 3, "inner_steps": 6}
    assert bound(64, **pareto) > bound(8, **pareto) + 150
    assert bound(64, latency="uniform") == bound(8, latency="uniform")  # no tail to wait on
    outcome = run_seed(69, nodes=64, rounds=10, keep_trace=False)
    assert outcome.violations == (), outcome.violations[:3]
    assert outcome.committed >= 10


# Swarm seed 135 at 64 nodes (session 21), shrunk to seed 140 at 32 nodes. With quorum_size
# equal to the node count, grace never starts, so a round closes only once every expected node
# has reported. After commits out of round order, node n002 had published round 11 (bounded,
# overlap_steps=0) the step its round-8 snapshot was merged: held by 11, it owed round 10 but
# had no samples for it (Decision 6), and held it never got any. Round 10 waited for n002, and
# round 11 for the nodes held by round 10: every node waited until the time limit. Fixed by the
# learner's rule that an owed round with no step since its snapshot does not hold the node
# (core/learner.py, ``_owes_untrained``). Before the fix the run stalled (about 2 minutes to the
# time limit); now it finishes in seconds.
SEED_140 = {
    "inner_steps": "12", "fragments": "2", "overlap_steps": "0", "quorum_size": "32",
    "grace": "5.0", "takeover": "22.0", "gc_horizon": "11.0", "step_time": "0.05",
    "speed_spread": "1.0", "clock_drift": "0.0001", "latency": "none", "latency_mean": "0.3",
    "fail_before": "0.0", "conflict": "0.01", "crash_rate": "0.0", "crash_on_write": "0.002",
    "restart": "1.0", "downtime": "1.0", "pause_on_write": "0.002", "pause_length": "4.0",
}  # fmt: skip


def test_a_held_node_steps_once_to_publish_a_round_it_owes_and_has_not_trained_for() -> None:
    outcome = run_seed(140, nodes=32, rounds=10, overrides=SEED_140, keep_trace=False)
    assert outcome.violations == (), outcome.violations[:3]
    assert outcome.committed >= 10
