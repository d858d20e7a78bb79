"""Deterministic simulation of many nodes with faults, on virtual time (the command line).

    python -m sim.simulate --nodes 64 --rounds 200 --seeds 1000
    python -m sim.simulate --nodes 64 --rounds 10 --seeds 1000 --jobs 2   # on both cores

(Stop a ``--jobs`` run with Ctrl-C, which reaches its worker processes too; a signal sent to
the parent alone leaves them running their seeds.)

runs seeds 0..999, each expanded by swarm testing into its own mix of faults and workload
(``sim_config.swarm``), each a full run of the library's own learner and syncer code over an
in-memory store (``sim_world``), checked as it goes and at the end (``sim_checks``, ``audit``).
It prints one line per seed with ``--verbose``, a report for every violation (the seed, its
configuration, the configuration shrunk to the fewest nodes, rounds and fault kinds that still
show it (``shrink``), the
trace of the shrunk run around the violation, and a one-line replay command), and a summary:
seeds run, simulated node-rounds, events per second, mailbox requests per node per committed
round, violations. Every ``--determinism-every``-th seed is run twice and must give the same
trace digest. Exit status 1 when anything was found.

``--replay SEED`` (with the options the report printed) runs one seed and prints its trace.
``--naive`` swaps the request plan for one that LISTs each round every poll, to compare costs;
``--plant`` breaks one safeguard on purpose (see ``sim_plants``) to show it is caught.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import attrs

from sim.sim_config import FAULT_RATES, PLANTS, SimConfig, setting_text, swarm
from sim.sim_world import Outcome, simulate

__all__ = ["Summary", "main", "replay_command", "run_seed", "shrink"]

# S3 standard request prices per 1000 requests (us-east-1): PUT, COPY, POST, LIST $0.005; GET
# $0.0004; DELETE free. Cost units below are GETs: a LIST costs 12.5 GETs.
_COST = {"get": 1.0, "list": 12.5, "put": 12.5, "create": 12.5, "delete": 0.0}
_FAULTS = (
    *FAULT_RATES,
    "late_joiners",
    "leavers",
    "speed_spread",
    "clock_drift",
)


@attrs.define
class Summary:
    """Totals over a batch of seeds."""

    seeds: int = 0
    node_rounds: int = 0
    committed: int = 0
    node_committed: int = 0
    events: int = 0
    steps: int = 0
    virtual: float = 0.0
    wall: float = 0.0
    cpu: float = 0.0
    requests: dict[str, int] = attrs.Factory(dict)
    failures: list[tuple[Outcome, Outcome]] = attrs.Factory(list)
    nondeterministic: list[int] = attrs.Factory(list)

    def add(self, outcome: Outcome) -> None:
        self.seeds += 1
        self.node_rounds += outcome.node_rounds
        self.committed += outcome.committed
        self.node_committed += outcome.committed * outcome.config.nodes
        self.events += outcome.events
        self.steps += outcome.steps
        self.virtual += outcome.virtual
        self.wall += outcome.wall
        self.cpu += outcome.cpu
        for kind, n in outcome.requests.items():
            self.requests[kind] = self.requests.get(kind, 0) + n

    def per_node_round(self) -> dict[str, float]:
        """Requests of each kind per node per committed round, and their cost in GETs."""
        rounds = max(1, self.node_committed)
        out = {k: self.requests.get(k, 0) / rounds for k in _COST}
        out["all"] = sum(out[k] for k in _COST)
        out["cost"] = sum(out[k] * w for k, w in _COST.items())
        return out

    def breakdown(self) -> dict[str, float]:
        """Requests per node per committed round by kind and purpose (``"list snapshot"``)."""
        rounds = max(1, self.node_committed)
        return {k: n / rounds for k, n in sorted(self.requests.items()) if " " in k}

    def lines(self) -> list[str]:
        per = self.per_node_round()
        wall, cpu = max(self.wall, 1e-9), max(self.cpu, 1e-9)
        kinds = " ".join(f"{k} {per[k]:.2f}" for k in _COST)
        return [
            f"seeds run:             {self.seeds}",
            f"simulated node-rounds: {self.node_rounds} ({self.committed} committed rounds, "
            f"{self.virtual:.0f} s of virtual time)",
            f"wall time:             {self.wall:.1f} s: {self.node_rounds / wall:.0f} "
            f"node-rounds/s, {self.events / wall:.0f} events/s, {self.steps / wall:.0f} "
            "scheduler steps/s",
            f"CPU time:              {self.cpu:.1f} s: {self.node_rounds / cpu:.0f} "
            f"node-rounds/s, {self.events / cpu:.0f} events/s (steadier on a shared machine)",
            f"requests/node/round:   {per['all']:.2f} ({kinds}; cost {per['cost']:.1f} GETs)",
            f"violations:            {len(self.failures)} seeds"
            + (
                f"; nondeterministic seeds {self.nondeterministic}" if self.nondeterministic else ""
            ),
        ]


def run_seed(
    seed: int,
    *,
    nodes: int,
    rounds: int,
    fixed: Mapping[str, object] | None = None,
    overrides: Mapping[str, str] | None = None,
    keep_trace: bool = True,
) -> Outcome:
    """One seed's run: its swarm configuration with ``fixed`` settings (not drawn) and
    ``overrides`` (``--set`` strings) applied."""
    config = swarm(seed, nodes=nodes, rounds=rounds, **(fixed or {}))
    config = config.with_overrides(overrides or {})
    return simulate(config, keep_trace=keep_trace)


def shrink(
    outcome: Outcome, *, budget: float = 60.0, latencies: bool = True
) -> tuple[Outcome, dict[str, str]]:
    """The smallest run found that still shows the first violation's kind, and the overrides
    that make it. Two stages within ``budget`` seconds together:

    1. Settings, greedy: each pass tries the candidates of ``_candidates`` in order (fewer
       nodes and rounds, each fault kind off, latency off), the largest cut first, and starts
       over from the first that still fails, until none does. A cut in nodes is tried with the
       run's seed and then with up to ``RESEED`` others: with fewer nodes the world draws its
       faults differently, so the seed that showed a violation among 4 nodes rarely shows it
       among 2, while another seed does (``overrides`` then names the seed).
    2. Choices, by delta debugging (``ddmin_faults``): of the faults that fired in that run,
       a subset that still fails and from which no single fault can be dropped (as far as the
       budget allowed), kept with ``faults_kept``; then the same of the request latencies
       waited (``ddmin_delays``, ``latency_kept``), every other request taking none.

    The replay command carries every setting, ``faults_kept`` and ``latency_kept``
    included. ``latencies=False`` leaves the latencies out of stage 2 (every request keeps its
    draw)."""
    kind = outcome.violations[0].kind
    best: Outcome = outcome
    overrides: dict[str, str] = {}
    deadline = time.perf_counter() + budget
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        for name, value in _candidates(best.config):
            try:
                cut = best.config.with_overrides({name: value})
            except ValueError:
                continue
            seeds = [cut.seed] + [cut.seed + i for i in range(1, RESEED + 1) if name == "nodes"]
            for seed in seeds:
                if time.perf_counter() >= deadline:
                    return best, overrides
                result = simulate(attrs.evolve(cut, seed=seed))
                if result.violations and result.violations[0].kind == kind:
                    trial = {**overrides, name: value}
                    if seed != outcome.config.seed:
                        trial["seed"] = str(seed)
                    best, overrides, improved = result, trial, True
                    break
            if improved:
                break
    if best.faults:
        best = ddmin_faults(best, deadline=deadline)
        if best.config.faults_kept is not None:
            overrides["faults_kept"] = setting_text(best.config.faults_kept)
    if latencies and best.delays:
        best = ddmin_delays(best, deadline=deadline)
        if best.config.latency_kept is not None:
            overrides["latency_kept"] = setting_text(best.config.latency_kept)
    return best, overrides


def ddmin_faults(outcome: Outcome, *, deadline: float) -> Outcome:
    """Delta debugging (Zeller and Hildebrandt's ddmin) of the faults that fired in
    ``outcome``'s run: the run with the fewest found to keep (``SimConfig.faults_kept``) that
    still shows the first violation's kind. Each test reruns the world firing only a subset,
    first none, then halves, quarters, ... and their complements; a fault fires in a rerun
    when its id (its incarnation, kind, request and count there) comes up again, drawn or not.
    A kept fault the rerun never reaches does not fire, so each success continues from the
    faults that did. Stops at ``deadline`` (``time.perf_counter``) with the smallest failing
    run so far."""
    return _ddmin(outcome, "faults", "faults_kept", deadline=deadline)


def ddmin_delays(outcome: Outcome, *, deadline: float) -> Outcome:
    """``ddmin_faults`` for the request latencies ``outcome``'s run waited (a traced run's
    ``Outcome.delays``): the run with the fewest kept (``SimConfig.latency_kept``; every
    other request takes no time on the way) that still shows the first violation's kind.
    These order the interleaving of requests: what is left is the slowness the violation
    needs. Stops at ``deadline``."""
    return _ddmin(outcome, "delays", "latency_kept", deadline=deadline)


def _ddmin(outcome: Outcome, chosen: str, field: str, *, deadline: float) -> Outcome:
    """ddmin of the choices ``outcome.<chosen>`` lists, kept by ``SimConfig.<field>``."""
    kind = outcome.violations[0].kind
    best = outcome

    def fails(kept: Sequence[str]) -> bool:
        nonlocal best
        if time.perf_counter() >= deadline:
            return False
        result = simulate(attrs.evolve(best.config, **{field: tuple(sorted(kept))}))
        if result.violations and result.violations[0].kind == kind:
            # Kept ids the rerun never reached change nothing: the same run keeps only those
            # it made.
            made = tuple(sorted(set(getattr(result, chosen))))
            best = attrs.evolve(result, config=attrs.evolve(result.config, **{field: made}))
            return True
        return False

    if fails(()):
        return best
    n = 2
    while len(getattr(best, chosen)) >= 2 and time.perf_counter() < deadline:
        items = list(getattr(best, chosen))
        chunks = [items[i * len(items) // n : (i + 1) * len(items) // n] for i in range(n)]
        if any(fails(chunk) for chunk in chunks):
            n = 2
            continue
        if n > 2 and any(
            fails([f for j, chunk in enumerate(chunks) if j != i for f in chunk]) for i in range(n)
        ):
            n = max(n - 1, 2)
            continue
        if n >= len(items):
            break
        n = min(2 * n, len(items))
    return best


RESEED = 24
"""Other seeds a cut in nodes is tried with (``shrink``)."""


def _candidates(config: SimConfig) -> list[tuple[str, str]]:
    """Smaller settings to try, the largest cut first: node counts down to 1, then halved, then
    one fewer (a violation that needs 3 nodes is found from 4 and from 6), the same for rounds
    (down to 2), then each fault kind off and latency off."""
    out: list[tuple[str, str]] = []

    def fewer(now: int, floor: int) -> list[int]:
        cuts = {*range(floor, min(now, floor + 3)), now // 2, now - 1}
        return sorted(n for n in cuts if floor <= n < now)

    out += [("nodes", str(n)) for n in fewer(config.nodes, 1)]
    out += [("rounds", str(r)) for r in fewer(config.rounds, 2)]
    out += [(name, "0") for name in _FAULTS if getattr(config, name) > 0]
    if config.latency != "none":
        out.append(("latency", "none"))
    return out


def replay_command(config: SimConfig, overrides: dict[str, str]) -> str:
    parts = [f"python -m sim.simulate --replay {config.seed}"]
    base = swarm(config.seed, nodes=config.nodes, rounds=config.rounds)
    parts.append(f"--nodes {config.nodes} --rounds {config.rounds}")
    if config.model != "float":
        parts.append(f"--model {config.model}")
    if config.naive:
        parts.append("--naive")
    if config.plant:
        parts.append(f"--plant {config.plant}")
    for field in attrs.fields(SimConfig):
        name = field.name
        if name in ("seed", "nodes", "rounds", "model", "naive", "plant"):
            continue
        if getattr(config, name) != getattr(base, name):
            parts.append(f"--set {name}={setting_text(getattr(config, name))}")
    del overrides  # the config already carries them; kept for the caller's record
    return " ".join(parts)


def trimmed(outcome: Outcome, *, limit: int = 60) -> list[str]:
    """The trace entries that involve the first violation's round and nodes, the last ``limit``
    of them, with faults and process events of those nodes."""
    violation = outcome.violations[0]
    K = outcome.config.fragments
    rounds = set()
    if violation.round is not None:
        rounds = {violation.round, violation.round - K}
    needles = [f"round={r}," for r in rounds] + [f"/{r:020d}/" for r in rounds if r >= 0]
    needles += [f"missed={r}," for r in rounds]
    nodes = set(violation.nodes)
    kept = [
        f"{t:10.3f}  {who:8s}  {what}"
        for t, who, what in outcome.trace
        if who == "world" or who.split("#")[0] in nodes or any(n in what for n in needles)
    ]
    if len(kept) > limit:
        kept = [f"... {len(kept) - limit} earlier entries ...", *kept[-limit:]]
    return kept


def report(outcome: Outcome, *, shrink_budget: float) -> list[str]:
    lines = [f"VIOLATION in seed {outcome.config.seed}:"]
    lines += [f"  {v}" for v in outcome.violations[:5]]
    lines.append(f"  configuration: {outcome.config.describe()}")
    small, overrides = shrink(outcome, budget=shrink_budget) if shrink_budget > 0 else (outcome, {})
    if overrides:
        lines.append(f"  shrunk with {overrides}: {small.violations[0]}")
        lines.append(
            f"  faults that fire in the shrunk run: {len(small.faults)} (the run found: "
            f"{len(outcome.faults)})"
        )
    lines.append(
        f"  trace of the {'shrunk ' if overrides else ''}run ({len(small.trace)} entries, "
        "those involving the violation's round and nodes):"
    )
    lines += [f"    {line}" for line in trimmed(small)]
    lines.append(f"  replay: {replay_command(small.config, overrides)}")
    return lines


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m sim.simulate",
        description="Deterministic simulation of many gradientmail nodes with faults.",
    )
    parser.add_argument("--nodes", type=int, default=8, help="nodes per run (default 8)")
    parser.add_argument(
        "--rounds", type=int, default=40, help="rounds each node trains for (default 40)"
    )
    parser.add_argument("--seeds", type=int, default=100, help="how many seeds (default 100)")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--replay", type=int, metavar="SEED", help="run one seed, print its trace")
    parser.add_argument(
        "--model",
        choices=("float", "torch"),
        default="float",
        help="float: tensor-free F32 vectors (fast); torch: a tiny torch model",
    )
    parser.add_argument(
        "--naive",
        action="store_true",
        help="LIST each round on every commit poll (the design Decision 8 avoids)",
    )
    parser.add_argument("--plant", choices=PLANTS, help="break one safeguard on purpose")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a drawn setting, e.g. --set crash_rate=0 (repeatable)",
    )
    parser.add_argument(
        "--determinism-every",
        type=int,
        default=25,
        help="run every N-th seed twice and compare digests (0: never)",
    )
    parser.add_argument(
        "--shrink-budget",
        type=float,
        default=60.0,
        help="wall seconds to shrink each violation (0: do not shrink)",
    )
    parser.add_argument(
        "--max-failures", type=int, default=3, help="stop after this many violating seeds"
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="one line per seed")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help=f"worker processes running seeds (default 1; the CPUs here: {os.cpu_count() or 1})",
    )
    return parser.parse_args(argv)


def _overrides(pairs: Sequence[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set takes KEY=VALUE, got {pair!r}")
        out[name.strip()] = value.strip()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    overrides = _overrides(args.set)
    fixed: dict[str, object] = {"model": args.model, "naive": args.naive, "plant": args.plant}
    if args.replay is not None:
        return _replay(args, overrides, fixed)
    if args.jobs < 1:
        raise SystemExit(f"--jobs must be at least 1, got {args.jobs}")
    summary = Summary()
    start = time.perf_counter()
    runs = [
        _SeedRun(
            seed=seed,
            nodes=args.nodes,
            rounds=args.rounds,
            overrides=overrides,
            fixed=fixed,
            twice=bool(
                args.determinism_every and (seed - args.first_seed) % args.determinism_every == 0
            ),
        )
        for seed in range(args.first_seed, args.first_seed + args.seeds)
    ]
    with _runner(args.jobs) as results:
        for outcome, again in results(runs):
            summary.add(outcome)
            if again is not None and again != outcome.digest:
                summary.nondeterministic.append(outcome.config.seed)
            if args.verbose:
                print(_line(outcome), flush=True)
            if outcome.violations:
                summary.failures.append((outcome, outcome))
                print("\n".join(report(outcome, shrink_budget=args.shrink_budget)), flush=True)
                if len(summary.failures) >= args.max_failures:
                    break
    print("\n".join(summary.lines()))
    if args.jobs > 1:
        print(
            f"elapsed:               {time.perf_counter() - start:.1f} s on {args.jobs} processes"
        )
    return 1 if summary.failures or summary.nondeterministic else 0


@attrs.frozen
class _SeedRun:
    """One seed of a batch, as a worker process runs it."""

    seed: int
    nodes: int
    rounds: int
    overrides: Mapping[str, str]
    fixed: Mapping[str, object]
    twice: bool  # run again and compare the trace digests


def _run(job: _SeedRun) -> tuple[Outcome, str | None]:
    """``job``'s outcome (its trace dropped when it found nothing: only a violation's report
    prints one) and, when it runs twice, the second run's digest."""
    outcome = run_seed(
        job.seed, nodes=job.nodes, rounds=job.rounds, overrides=job.overrides, fixed=job.fixed
    )
    again = None
    if job.twice and not outcome.violations:
        again = run_seed(
            job.seed,
            nodes=job.nodes,
            rounds=job.rounds,
            overrides=job.overrides,
            keep_trace=False,
            fixed=job.fixed,
        ).digest
    if not outcome.violations:
        outcome = attrs.evolve(outcome, trace=())
    return outcome, again


@contextlib.contextmanager
def _runner(
    jobs: int,
) -> Iterator[Callable[[Sequence[_SeedRun]], Iterator[tuple[Outcome, str | None]]]]:
    """Runs seeds in order of their numbers, in this process or in ``jobs`` worker processes
    (each seed's run is deterministic wherever it runs); leaving the block cancels the seeds
    not started."""
    if jobs == 1:
        yield lambda batch: map(_run, batch)
        return
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        try:
            yield lambda batch: pool.map(_run, batch)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def _line(outcome: Outcome) -> str:
    status = "FAIL " + outcome.violations[0].kind if outcome.violations else "ok"
    return (
        f"seed {outcome.config.seed}: {status}; {outcome.committed} rounds, {outcome.node_rounds} "
        f"node-rounds, {outcome.virtual:.0f}s virtual in {outcome.wall:.2f}s, digest "
        f"{outcome.digest[:12]} | {outcome.config.describe()}"
    )


def _replay(args: argparse.Namespace, overrides: dict[str, str], fixed: dict[str, object]) -> int:
    outcome = run_seed(
        args.replay, nodes=args.nodes, rounds=args.rounds, overrides=overrides, fixed=fixed
    )
    print(f"configuration: {outcome.config.describe()}")
    for t, who, what in outcome.trace:
        print(f"{t:10.3f}  {who:8s}  {what}")
    print(_line(outcome))
    for violation in outcome.violations:
        print(f"  {violation}")
    return 1 if outcome.violations else 0


if __name__ == "__main__":
    sys.exit(main())
