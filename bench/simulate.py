"""The simulator's figures: its throughput, the request plan's cost against a naive plan that
LISTs every poll, and a planted bug found.

    python bench/simulate.py             # requests at 8, 64, 256 nodes; speed at 8 and 64
    python bench/simulate.py --quick     # fewer nodes and rounds
    python bench/simulate.py --speed     # only the throughput table (6 seeds a row)

Requests (fixed workload, no faults): DiLoCo H=100, one fragment, 0.5 s per inner step (a
round every 50 s), poll_interval 1 s, lease_every 10 s, lease_timeout 30 s, uniform mailbox
latency with a 20 ms mean, tensor-free F32 model. Figures are per node per committed round,
by kind and by purpose; the cost is in GETs at S3's prices (a LIST, PUT or create costs 12.5
GETs, a DELETE nothing). The naive plan is ``SimMailbox(naive=True)``: every poll of a
round's commit first LISTs the round (what a design without predictable commit keys does).

Throughput uses the same settings with H=8 and leases every 2 s (a round every 4 s), since
simulated node-rounds per second fall with the polls each round takes: simulated node-rounds
(snapshots counted in a commit) per second of wall time and of this process's CPU time
(steadier on a busy machine); "no latency" runs it with requests that do not yield.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # sim/ lives at the repo root

from sim.sim_config import SimConfig
from sim.sim_world import Outcome, simulate
from sim.simulate import Summary, report

# Realistic proportions for the request figures: 50 s rounds, 1 s polls, 10 s lease renewals,
# and a grace of 5 polls. (With a grace of one poll, rounds closed on the nodes that had merged
# the previous commit within that poll: half the nodes, and the other half in a round of its own.)
REQUESTS: dict[str, Any] = {
    "inner_steps": 100,
    "fragments": 1,
    "step_time": 0.5,
    "poll_interval": 1.0,
    "lease_every": 10.0,
    "lease_timeout": 30.0,
    "latency": "uniform",
    "latency_mean": 0.02,
    "grace": 5.0,
    "keep_rounds": 2,
}
# Short rounds (4 s) for the throughput figures: simulated node-rounds, not polls, per second.
SPEED: dict[str, Any] = {
    **REQUESTS,
    "grace": 1.0,
    "inner_steps": 8,
    "lease_every": 2.0,
    "lease_timeout": 6.0,
}


def run(
    nodes: int, rounds: int, workload: dict[str, Any], *, seed: int = 1, **changes: Any
) -> Outcome:
    config = SimConfig(seed=seed, nodes=nodes, rounds=rounds, **{**workload, **changes})
    outcome = simulate(config, keep_trace=False)
    if outcome.violations:
        raise SystemExit(f"violations in the bench workload: {outcome.violations}")
    return outcome


def requests_table(sizes: list[tuple[int, int]], seeds: int = 1) -> None:
    """Requests per node per committed round, summed over runs of seeds 1 to ``seeds``: one
    seed's figure moves by a quarter or more when any timing changes."""
    print(
        "\nMailbox requests per node per committed round (polling plan vs naive LIST plan), "
        f"seeds 1-{seeds}"
    )
    print(
        f"{'nodes':>5} {'plan':>7} {'GET':>7} {'LIST':>6} {'PUT':>5} {'create':>6} "
        f"{'DELETE':>6} {'all':>7} {'cost (GETs)':>11} {'naive/polled cost':>17}"
    )
    for nodes, rounds in sizes:
        costs = {}
        for plan in ("polled", "naive"):
            summary = Summary()
            for seed in range(1, seeds + 1):
                summary.add(run(nodes, rounds, REQUESTS, seed=seed, naive=plan == "naive"))
            per = summary.per_node_round()
            costs[plan] = per["cost"]
            ratio = f"{costs['naive'] / costs['polled']:.2f}x" if plan == "naive" else ""
            print(
                f"{nodes:>5} {plan:>7} {per['get']:>7.2f} {per['list']:>6.2f} "
                f"{per['put']:>5.2f} {per['create']:>6.2f} {per['delete']:>6.2f} "
                f"{per['all']:>7.2f} {per['cost']:>11.1f} {ratio:>17}",
                flush=True,
            )
            top = sorted(summary.breakdown().items(), key=lambda item: -item[1])[:8]
            print(" " * 14 + "by purpose: " + ", ".join(f"{k} {v:.2f}" for k, v in top))


SPEED_TARGETS = {8: 2000, 64: 1000}
"""Issue #20's targets: simulated node-rounds per CPU second at 8 and 64 nodes (6 seeds)."""


def throughput_table(sizes: list[tuple[int, int]], seeds: int = 6) -> None:
    """Node-rounds per second summed over seeds 1 to ``seeds`` (each seed's run is timed on
    its own; the sums divide)."""
    print(f"\nSimulator throughput (tensor-free, no faults), seeds 1-{seeds}")
    print(
        f"{'nodes':>5} {'rounds':>6} {'node-rounds':>11} {'wall s':>7} {'CPU s':>6} "
        f"{'per wall s':>10} {'per CPU s':>9} {'per CPU s (no latency)':>22} "
        f"{'events/CPU s':>12} {'target':>7}"
    )
    for nodes, rounds in sizes:
        runs = [run(nodes, rounds, SPEED, seed=seed) for seed in range(1, seeds + 1)]
        flat = [
            run(nodes, rounds, SPEED, seed=seed, latency="none") for seed in range(1, seeds + 1)
        ]
        done = sum(o.node_rounds for o in runs)
        wall, cpu = sum(o.wall for o in runs), sum(o.cpu for o in runs)
        flat_rate = sum(o.node_rounds for o in flat) / sum(o.cpu for o in flat)
        target = SPEED_TARGETS.get(nodes)
        verdict = (
            "" if target is None else f"{'meets' if done / cpu >= target else 'MISSES'} {target}"
        )
        print(
            f"{nodes:>5} {rounds:>6} {done:>11} {wall:>7.1f} {cpu:>6.1f} "
            f"{done / wall:>10.0f} {done / cpu:>9.0f} {flat_rate:>22.0f} "
            f"{sum(o.events for o in runs) / cpu:>12.0f} {verdict:>7}",
            flush=True,
        )


def profile(nodes: int, rounds: int) -> None:
    print(f"\nWhere the time goes ({nodes} nodes, {rounds} rounds; cumulative CPU share)")
    profiler = cProfile.Profile()
    profiler.runcall(run, nodes, rounds, SPEED)
    stats = pstats.Stats(profiler)
    total = max(stats.total_tt, 1e-9)  # type: ignore[attr-defined]
    rows = []
    for (path, _, name), (_, _, _, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        for label, module, function in PARTS:
            if path.endswith(module) and name == function:
                rows.append((cumulative / total, label))
    for share, label in sorted(rows, reverse=True):
        print(f"  {share:6.1%}  {label}")


PARTS = [
    ("syncer loop: its rule (leases, rounds, closing)", "syncer.py", "step"),
    ("syncer loop: its executor (requests, outer step)", "syncer.py", "execute"),
    ("learner loop: its rule (uploads, commit polls)", "polling.py", "step"),
    ("learner loop: its executor (encode, requests, loads)", "learner.py", "execute"),
    ("exchange: record parsing (read_record)", "records.py", "read_record"),
    ("memory mailbox: LIST (sorts every key)", "_memory.py", "list"),
    ("simulator: invariant checks at each write", "sim_checks.py", "landed"),
    ("simulator: commit recomputation", "sim_checks.py", "_recompute"),
    ("simulator: end-of-run audit", "_audit.py", "audit"),
    ("training side: Node.step", "node.py", "step"),
]


def planted() -> None:
    print("\nA planted bug: the takeover timeout disabled (--plant takeover-now)")
    config = SimConfig(
        seed=0,
        nodes=4,
        rounds=8,
        plant="takeover-now",
        **{
            **SPEED,
            "step_time": 0.2,
            "lease_every": 1.0,
            "lease_timeout": 3.0,
            "poll_interval": 0.25,
            "latency_mean": 0.01,
            "keep_rounds": None,
        },
    )
    outcome = simulate(config)
    if not outcome.violations:
        raise SystemExit("the planted bug went unnoticed")
    print("\n".join(report(outcome, shrink_budget=60.0)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 and 64 nodes, fewer rounds")
    parser.add_argument(
        "--requests",
        metavar="NODES:ROUNDS,...",
        help="only the request table, for these sizes (e.g. 256:6)",
    )
    parser.add_argument(
        "--seeds", type=int, default=1, help="runs per row of the request table (seeds 1..N)"
    )
    parser.add_argument("--speed", action="store_true", help="only the throughput table")
    parser.add_argument(
        "--speed-seeds", type=int, default=6, help="runs per row of the throughput table"
    )
    args = parser.parse_args(argv)
    if args.requests:
        sizes = [tuple(map(int, size.split(":"))) for size in args.requests.split(",")]
        requests_table([(nodes, rounds) for nodes, rounds in sizes], args.seeds)
        return 0
    if args.speed:
        throughput_table([(8, 40), (64, 10)], args.speed_seeds)
        return 0
    if args.quick:
        requests_table([(8, 4), (64, 2)], args.seeds)
        throughput_table([(8, 20), (64, 5)], 2)
        profile(64, 5)
    else:
        requests_table([(8, 10), (64, 5), (256, 2)], args.seeds)
        throughput_table([(8, 40), (64, 10)], args.speed_seeds)
        profile(64, 10)
    planted()
    return 0


if __name__ == "__main__":
    sys.exit(main())
