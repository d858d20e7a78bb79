"""Three nodes on a MemoryMailbox under virtual time, in one thread (Decision 1): the same
learner and syncer code the real nodes run, with only the clock and the mailbox swapped."""

from __future__ import annotations

from collections import Counter
from typing import Any

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
from gradientmail._events import Committed, Merged, Published, Rebased  # noqa: E402
from gradientmail.adapters.torch import TorchBackend  # noqa: E402
from gradientmail.core import keys  # noqa: E402
from gradientmail.mailboxes._memory import Faults, MemoryMailbox  # noqa: E402
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


class SlowLastSnapshots:
    """A store on which the snapshots of rounds ``first`` on take a second to upload, and
    everything else (leases, commits) none."""

    def __init__(self, store: MemoryMailbox, first: int) -> None:
        self._store, self._first = store, first
        self._slow = store.handle(faults=Faults(delay=(1.0, 1.0)))

    def _for(self, key: str) -> MemoryMailbox:
        slow = "/snapshots/" in key and keys.parse(key).round >= self._first
        return self._slow if slow else self._store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def create(self, key: str, data: bytes, *, durable: bool = True) -> bool:
        return await self._for(key).create(key, data, durable=durable)

    async def put(self, key: str, data: bytes, *, durable: bool = True) -> None:
        await self._for(key).put(key, data, durable=durable)


@pytest.mark.parametrize("overlap", [0, 1, None])
def test_nodes_that_close_together_end_on_the_same_commits_when_their_last_uploads_are_slow(
    overlap: int | None,
) -> None:
    # Decision 11: a closing node's lease says "left" only once its last snapshots are
    # uploaded. Written at once, as before, the closer of the last round saw the others left
    # and their snapshots not yet there, closed it alone, and each late snapshot went into a
    # round of its own: three nodes ended on three different parameters.
    algorithm = DiLoCo(inner_steps=10, fragments=2, overlap_steps=overlap, quorum_size=3)
    store, events, models, _ = run_nodes(
        algorithm, steps=43, wrap=lambda store: SlowLastSnapshots(store, first=7)
    )
    commits = {e.round: e.included for e in events if isinstance(e, Committed)}
    assert sorted(commits) == list(range(max(commits) + 1)), commits
    # Every snapshot published made its round: none was left to a round of its own.
    published = Counter(e.round for e in events if isinstance(e, Published))
    assert commits == dict(published), (commits, published)
    assert not [e for e in events if isinstance(e, Rebased)]
    if overlap is None:
        return  # the nodes take part in different last rounds (they train at other speeds)
    assert set(commits.values()) == {3}, commits
    assert parameters(models[1:]) == parameters(models[:1]) * 2
    fresh = make_model(seed=1)
    assert align(fresh, mailbox=store) == max(commits)
    assert parameters([fresh]) == parameters(models[:1])
