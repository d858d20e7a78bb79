"""Nodes of a run in one thread on virtual time (imported by the shell tests)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import torch

from gradientmail import DiLoCo
from gradientmail.events import Committed, Event
from gradientmail.memory import Faults, MemoryMailbox
from gradientmail.session import Node
from gradientmail.testing.virtual import Scheduler, VirtualClock


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def run_nodes(
    algorithm: DiLoCo,
    *,
    nodes: int = 3,
    steps: int = 40,
    seed: int = 0,
    faults: Faults | None = None,
    before: Callable[[MemoryMailbox], Awaitable[None]] | None = None,
    **node_options: Any,
) -> tuple[MemoryMailbox, list[Event], list[torch.nn.Module], Scheduler]:
    """Run ``nodes`` nodes for ``steps`` steps each and close them; ``before`` may write to the
    mailbox first. Returns the (fault-free) mailbox, every event, the models and the scheduler."""
    clock = VirtualClock()
    scheduler = Scheduler(clock, seed=seed)
    mailbox = MemoryMailbox(f"memory://virtual-{seed}-{id(clock)}", clock=clock)
    events: list[Event] = []
    models = [make_model() for _ in range(nodes)]
    target = torch.randn(4, 1, generator=torch.Generator().manual_seed(seed))
    options = {"poll_interval": 0.5, "lease_every": 2.0, "lease_timeout": 5.0, **node_options}

    async def main(i: int) -> None:
        model = models[i]
        node = Node(
            model,
            algorithm=algorithm,
            mailbox=mailbox.handle(faults=faults, clock=clock) if faults else mailbox,
            clock=clock,
            learner_id=f"node-{i}",
            on_event=events.append,
            keep_rounds=None,
            **options,
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

    async def start() -> None:
        if before is not None:
            await before(mailbox)
        for i in range(nodes):
            scheduler.spawn(f"node-{i}", main(i))

    scheduler.spawn("start", start())
    scheduler.run(until=10_000)
    assert scheduler.errors == [], scheduler.errors
    return mailbox, events, models, scheduler


def committed_rounds(events: list[Event]) -> list[int]:
    return sorted(e.round for e in events if isinstance(e, Committed))
