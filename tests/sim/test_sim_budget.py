"""Decision 8's request budget, checked by the simulator on the workload of
``bench/simulate.py --requests`` (issue #21): at most 2 LISTs per node per committed round,
about one commit GET per poll only while a node has a snapshot in the round, and a plan that
costs several times less than listing every round at every poll."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import attrs

from sim.sim_config import SimConfig
from sim.sim_world import Outcome, simulate

ROOT = Path(__file__).resolve().parents[2]


def workload() -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location("bench_simulate", ROOT / "bench/simulate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    requests: dict[str, Any] = module.REQUESTS
    return requests


def per_node_round(outcome: Outcome, key: str) -> float:
    return outcome.requests.get(key, 0) / outcome.committed / outcome.config.nodes


def test_the_request_plan_keeps_its_budget() -> None:
    nodes, rounds = 8, 5
    for seed in (1, 2):
        config = SimConfig(seed=seed, nodes=nodes, rounds=rounds, **workload())
        outcome = simulate(config, keep_trace=False)
        assert outcome.violations == ()
        # Every round includes every node: one commit per round of each node.
        assert outcome.committed == rounds, outcome.committed
        lists = per_node_round(outcome, "list")
        assert lists <= 2.0, f"seed {seed}: {lists:.2f} LISTs per node per round"
        # 100 steps of 0.5 s: a round is open about 55 polls; a node polls its commit every
        # poll only from its snapshot to the commit, every 10 polls before.
        commit_gets = per_node_round(outcome, "get commit")
        assert commit_gets <= 15.0, f"seed {seed}: {commit_gets:.1f} commit GETs per round"
        naive = simulate(attrs.evolve(config, naive=True), keep_trace=False)
        assert naive.violations == () and naive.committed == rounds
        assert per_node_round(naive, "list") > 3 * lists
