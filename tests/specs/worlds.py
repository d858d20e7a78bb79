"""The explorations CI runs whole, started in the background as soon as the session has
collected its tests (``conftest.pytest_collection_finish``): worker processes at the lowest
CPU priority explore them on whatever CPU the other tests leave idle (most tests run one
process at a time, or wait on nodes, stores and timeouts), so the explorer's minutes overlap the
rest of the suite instead of following it. ``tests/specs/test_explore.py`` collects the
results."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ProcessPoolExecutor
from functools import partial

import attrs

from specs.config import Config
from specs.explore import Result, explore

CI_CONFIGS = [
    Config(nodes=1, rounds=2, crashes=1, faults=1),
    # Two nodes with the idle timers (leases never listed by an idle node, commits it has no
    # snapshot in polled every other interval) exceed 100,000 states before half their depth:
    # CI explores them with the quick cadences (docs/decisions.md, "Idle nodes list no leases").
    Config(nodes=2, rounds=1, leave=False, quick_leases=True, idle_polls=1),
    Config(nodes=2, rounds=1, leave=False, quorum=2, grace=1, quick_leases=True, idle_polls=1),
    # A forger squats commit keys (core.slots): 20,980 distinct states in about 20 s.
    Config(nodes=1, rounds=2, forgeries=2),
    # ... or a snapshot key, or the manifest key before the run: 16,784 states in about 11 s.
    Config(nodes=1, rounds=2, forgeries=1, squats=frozenset({"commit", "snapshot", "manifest"})),
]

GATHER = Config(nodes=2, rounds=1, leave=False, quick_leases=True, idle_polls=1)
GATHERED = attrs.evolve(GATHER, gather=True)

CI_TEST = "test_ci_configuration_holds"
GATHERED_TEST = "test_with_the_start_barrier_every_first_round_expects_every_node"


def jobs_for(selected: Iterable[str]) -> dict[str, Callable[[], Result]]:
    """The explorations the selected tests (by item name) need, by configuration."""
    names = set(selected)
    jobs: dict[str, Callable[[], Result]] = {
        config.describe(): partial(explore, config)
        for config in CI_CONFIGS
        if f"{CI_TEST}[{config.describe()}]" in names
    }
    if GATHERED_TEST in names:  # safety only
        jobs[GATHERED.describe()] = partial(explore, GATHERED, liveness=False)
    return jobs


_pool: ProcessPoolExecutor | None = None
_started: dict[str, Future[Result]] = {}


def start(selected: Iterable[str]) -> None:
    """Submit the explorations ``selected`` tests need, largest first, to workers that run
    at the lowest priority (``nice`` 19): they take only CPU no other process wants."""
    global _pool
    jobs = jobs_for(selected)
    if not jobs or _pool is not None:
        return
    context = multiprocessing.get_context("spawn")
    _pool = ProcessPoolExecutor(
        max_workers=os.cpu_count() or 1, mp_context=context, initializer=_lowest_priority
    )
    for name, job in jobs.items():
        _started[name] = _pool.submit(job)


def started() -> dict[str, Future[Result]]:
    """The futures ``start`` submitted, by configuration (empty if none were)."""
    return _started


def stop() -> None:
    """End the workers (the session is over: anything not collected is not needed)."""
    global _pool
    if _pool is not None:
        processes = list((getattr(_pool, "_processes", None) or {}).values())
        _pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:  # ours: a job still running is not waited for
            if process.is_alive():
                process.terminate()
        _pool = None


def _lowest_priority() -> None:
    os.nice(19)
