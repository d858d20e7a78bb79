"""Three nodes on a MemoryMailbox under virtual time, in one thread (Decision 1): the same
learner and syncer code the real nodes run, with only the clock and the mailbox swapped."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from virtual_run import (  # noqa: E402
    assert_chains,
    committed_rounds,
    make_model,
    parameters,
    run_nodes,
)

from gradientmail import DiLoCo, align  # noqa: E402
from gradientmail._events import Merged  # noqa: E402
from gradientmail.adapters.torch import TorchBackend  # noqa: E402
from gradientmail.testing._audit import audit  # noqa: E402


@pytest.mark.parametrize(
    "algorithm",
    [
        DiLoCo(inner_steps=10, fragments=1, overlap_steps=0, grace=5.0),
        DiLoCo(inner_steps=10, fragments=2, overlap_steps=2, grace=5.0),
        DiLoCo(inner_steps=12, fragments=3, overlap_steps=None, alpha=0.5, grace=5.0),
    ],
    ids=["diloco", "streaming", "alpha-unbounded"],
)
def test_three_nodes_complete_a_run_in_one_thread(algorithm: DiLoCo) -> None:
    mailbox, events, _, _ = run_nodes(algorithm)
    rounds = committed_rounds(events)
    assert_chains(rounds, algorithm.fragments)
    assert len(rounds) >= 40 // algorithm.inner_steps * algorithm.fragments
    merged = [e for e in events if isinstance(e, Merged)]
    assert {e.node for e in merged} == {"node-0", "node-1", "node-2"}
    report = audit(mailbox, backend=TorchBackend())
    assert report.rounds == tuple(rounds)
    assert report.recomputed == len(rounds)  # params derive from exactly the listed snapshots


def test_virtual_runs_are_deterministic() -> None:
    algorithm = DiLoCo(inner_steps=10, fragments=2, overlap_steps=1, grace=5.0)
    first = run_nodes(algorithm, seed=3)
    second = run_nodes(algorithm, seed=3)
    assert [type(e).__name__ for e in first[1]] == [type(e).__name__ for e in second[1]]
    assert first[3].clock.time == second[3].clock.time


def test_a_lone_closer_steps_from_the_outer_state_it_kept_as_the_store_holds_it() -> None:
    # One node closes every round, so each outer step after a fragment's first starts from
    # the master and momentum it kept in memory; the audit recomputes every round from the
    # store's payloads alone and must find the very same bits.
    algorithm = DiLoCo(inner_steps=10, fragments=2, overlap_steps=None, grace=0.0)
    mailbox, events, models, _ = run_nodes(algorithm, nodes=1, steps=60)
    rounds = committed_rounds(events)
    assert_chains(rounds, algorithm.fragments)
    assert len(rounds) >= 10
    report = audit(mailbox, backend=TorchBackend())
    assert report.recomputed == len(rounds)  # audit raises on any that differ
    # It merged its own commits from the tensors its closer handed over, not from the store:
    # after close its model holds exactly the run's final parameters as stored.
    fresh = make_model(seed=1)
    assert align(fresh, mailbox=mailbox) == rounds[-1]
    assert parameters([fresh]) == parameters(models)
