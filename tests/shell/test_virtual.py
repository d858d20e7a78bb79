"""Three nodes on a MemoryMailbox under virtual time, in one thread (Decision 1): the same
learner and syncer code the real nodes run, with only the clock and the mailbox swapped."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gradientmail import DiLoCo  # noqa: E402
from gradientmail.events import Committed, Event, Merged  # noqa: E402
from gradientmail.memory import MemoryMailbox  # noqa: E402
from gradientmail.session import Node  # noqa: E402
from gradientmail.adapters.torch import TorchBackend  # noqa: E402
from gradientmail.testing.audit import audit  # noqa: E402
from gradientmail.testing.virtual import Scheduler, VirtualClock  # noqa: E402


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def run_nodes(
    algorithm: DiLoCo, *, nodes: int = 3, steps: int = 40, seed: int = 0
) -> tuple[MemoryMailbox, list[Event], list[torch.nn.Module], Scheduler]:
    clock = VirtualClock()
    scheduler = Scheduler(clock, seed=seed)
    mailbox = MemoryMailbox(f"memory://virtual-{seed}-{id(clock)}", clock=clock)
    events: list[Event] = []
    models = [make_model() for _ in range(nodes)]
    target = torch.randn(4, 1)

    async def main(i: int) -> None:
        model = models[i]
        node = Node(
            model,
            algorithm=algorithm,
            mailbox=mailbox,
            clock=clock,
            learner_id=f"node-{i}",
            poll_interval=0.5,
            lease_every=2.0,
            lease_timeout=5.0,
            on_event=events.append,
            keep_rounds=None,
        )
        await clock.sleep(0.1 * i)
        await node.join()
        assert node.learner is not None and node.syncer is not None
        scheduler.spawn(f"learner-{i}", node.learner.run())
        scheduler.spawn(f"syncer-{i}", node.syncer.run())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        generator = torch.Generator().manual_seed(100 + i)
        for _ in range(steps):
            await clock.sleep(0.2 + 0.05 * i)
            x = torch.randn(16, 4, generator=generator)
            loss = ((model(x) - x @ target) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            node.learner.advance(16)
            while node.learner.blocked() is not None:
                await clock.sleep(0.1)
        node.begin_close()
        while not node.learner.done:
            await clock.sleep(0.1)
        node.finish()

    for i in range(nodes):
        scheduler.spawn(f"node-{i}", main(i))
    scheduler.run(until=10_000)
    assert scheduler.errors == []
    return mailbox, events, models, scheduler


def committed_rounds(events: list[Event]) -> list[int]:
    return sorted(e.round for e in events if isinstance(e, Committed))


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
    mailbox, events, models, scheduler = run_nodes(algorithm)
    rounds = committed_rounds(events)
    assert rounds == sorted(set(rounds)), "a round committed twice"
    assert len(rounds) >= 40 // algorithm.inner_steps * algorithm.fragments
    # Every fragment's commits form an unbroken chain r, r+K, ...
    K = algorithm.fragments
    for k in range(K):
        chain = [r for r in rounds if r % K == k]
        assert chain == list(range(k, k + K * len(chain), K))
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
