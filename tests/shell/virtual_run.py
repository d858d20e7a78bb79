"""Nodes of a run in one thread on virtual time (imported by the shell and security tests).

The nodes run the real learner and syncer coroutines under a seeded ``Scheduler``; only the
clock and the mailbox are swapped. Optional hooks: ``faults`` gives each node its own faulty
handle on the store; ``wrap`` puts one wrapper (a hostile writer, a tampering proxy) between
every node and the store, so that it acts from inside the nodes' own mailbox calls and never as
a task of its own (a task would draw from the scheduler's shared tie-breaking random generator
and change the honest interleaving by its mere existence); ``keyring`` or ``keyrings`` sign the
run.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple

import torch

from gradientmail import DiLoCo
from gradientmail._events import Committed, Event
from gradientmail._node import Node
from gradientmail.core.signing import Keyring
from gradientmail.mailboxes._memory import Faults, MemoryMailbox
from gradientmail.mailboxes._protocol import Mailbox
from gradientmail.testing import Scheduler, VirtualClock

ALGORITHM = DiLoCo(inner_steps=10, fragments=2, overlap_steps=1, grace=5.0)


class VirtualRun(NamedTuple):
    """What a run leaves: the store (without faults or wrapper), every event, the models."""

    store: MemoryMailbox
    events: list[Event]
    models: list[torch.nn.Module]
    scheduler: Scheduler


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def lone_session(
    model: torch.nn.Module,
    url: str,
    *,
    overlap_steps: int,
    quantization: Any = None,
    **settings: Any,
) -> Any:
    """A real ``Session`` of one node on ``url`` with quick timers, K=2 and H=4."""
    from gradientmail import Session, mailbox_from_url

    algorithm = DiLoCo(
        inner_steps=4, fragments=2, overlap_steps=overlap_steps, quantization=quantization
    )
    return Session(
        model,
        algorithm=algorithm,
        mailbox=mailbox_from_url(url),
        poll_interval=0.05,
        lease_every=1.0,
        lease_timeout=3.0,
        callbacks=(),
        **settings,
    )


def drift(model: torch.nn.Module, session: Any, steps: int) -> None:
    """``steps`` stand-in training steps through ``session``: every parameter moves by 0.01."""
    for _ in range(steps):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        session.step(samples=1)


def run_nodes(
    algorithm: DiLoCo = ALGORITHM,
    *,
    nodes: int = 3,
    steps: int = 40,
    seed: int = 0,
    faults: Faults | None = None,
    wrap: Callable[[MemoryMailbox], Mailbox] | None = None,
    keyring: Keyring | None = None,
    keyrings: Sequence[Keyring | None] | None = None,
    store: MemoryMailbox | None = None,
    before: Callable[[MemoryMailbox], Awaitable[None]] | None = None,
    lrs: Sequence[float] | None = None,
    **node_options: Any,
) -> VirtualRun:
    """Run ``nodes`` nodes for ``steps`` steps each and close them; ``before`` may write to the
    store first. ``keyrings`` gives each node its own keyring (else all hold ``keyring``);
    ``store`` continues the run in an existing store; ``lrs`` gives each node's inner SGD
    learning rate (else 0.05 each)."""
    if faults is not None and wrap is not None:
        raise ValueError("pass faults= or wrap=, not both")
    clock = VirtualClock()
    scheduler = Scheduler(clock, seed=seed)
    if store is None:
        store = MemoryMailbox(f"memory://virtual-{seed}-{id(clock)}", clock=clock)
    else:
        store = store.handle(clock=clock)
    shared: Mailbox = wrap(store) if wrap is not None else store
    events: list[Event] = []
    models = [make_model() for _ in range(nodes)]
    target = torch.randn(4, 1, generator=torch.Generator().manual_seed(seed))
    options = {"poll_interval": 0.5, "lease_every": 2.0, "lease_timeout": 5.0, **node_options}

    async def main(i: int) -> None:
        model = models[i]
        node = Node(
            model,
            algorithm=algorithm,
            mailbox=store.handle(faults=faults, clock=clock) if faults else shared,
            clock=clock,
            learner_id=f"node-{i}",
            on_event=events.append,
            keep_rounds=None,
            keyring=keyring if keyrings is None else keyrings[i],
            **options,
        )
        await clock.sleep(0.1 * i)
        await node.join()
        for name, loop in node.loops():
            scheduler.spawn(f"{name}-{i}", loop)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05 if lrs is None else lrs[i])
        generator = torch.Generator().manual_seed(100 + i)
        for _ in range(steps):
            await clock.sleep(0.2 + 0.05 * i)
            x = torch.randn(16, 4, generator=generator)
            loss = ((model(x) - x @ target) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            await node.step(16)
        await node.close()

    async def start() -> None:
        if before is not None:
            await before(store)
        for i in range(nodes):
            scheduler.spawn(f"node-{i}", main(i))

    scheduler.spawn("start", start())
    scheduler.run(until=10_000)
    assert scheduler.errors == [], scheduler.errors
    return VirtualRun(store, events, models, scheduler)


def committed_rounds(events: list[Event]) -> list[int]:
    return sorted(e.round for e in events if isinstance(e, Committed))


def assert_chains(rounds: list[int], fragments: int) -> None:
    """Each round committed once, and every fragment's commits an unbroken chain r, r+K, ...
    from its first round (a fragment that trained nothing since its last snapshot publishes
    nothing at close, so the run's last rounds need not be contiguous across fragments)."""
    assert rounds == sorted(set(rounds)), "a round committed twice"
    for k in range(fragments):
        chain = [r for r in rounds if r % fragments == k]
        assert chain == list(range(k, k + fragments * len(chain), fragments)), chain


def parameters(models: list[torch.nn.Module]) -> list[list[Any]]:
    """Every model's parameters as nested lists, for exact comparison."""
    return [[p.tolist() for p in model.parameters()] for model in models]
