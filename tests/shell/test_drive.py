"""The loop every node loop runs (``drive``): effects carried out in order, and *aside* effects
(the syncer's lease requests) carried out beside the loop, so that neither holds up the other.

Run under virtual time with effects of the test's own, so each request's duration is exact.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import attrs
import pytest

from gradientmail._clock import MonotonicClock
from gradientmail._node.drive import Executor, Inbox, drive
from gradientmail.core.effects import Done, Wait
from gradientmail.testing import Scheduler, VirtualClock


@attrs.frozen
class Renew:
    name: str


@attrs.frozen
class List:
    pass


@attrs.frozen
class Read:
    pass


class Requests(Executor):
    """Renewals take 5 s, a LIST 1 s and a read none; each logs when it ends."""

    def __init__(self, clock: VirtualClock, *, failing: bool = False) -> None:
        self.clock = clock
        self.log: list[tuple[float, str]] = []
        self.failing = failing
        self._handlers = {Renew: self._renew, List: self._list, Read: self._read}

    async def _renew(self, renew: Renew) -> None:
        await self.clock.sleep(5.0)
        if self.failing:
            raise RuntimeError(f"the store refused {renew.name}")
        self.log.append((self.clock.now(), renew.name))

    async def _list(self, _: List) -> str:
        await self.clock.sleep(1.0)
        self.log.append((self.clock.now(), "list"))
        return "listed"

    async def _read(self, _: Read) -> str:
        return "read"


def rule_of(views: list[tuple[float, list[Any]]], clock: VirtualClock) -> Any:
    def rule(view: Sequence[Any], state: int, *, now: float, settings: Any) -> Any:
        views.append((now, list(view)))
        if state == 0:
            return 1, [Renew("renew 1"), List(), Read(), Wait(until=None, reason="")], "start"
        if state == 1:
            return 2, [Renew("renew 2"), Renew("renew 3"), Wait(until=None, reason="")], "renew"
        if "listed" in view:
            return 3, [Done(reason="over")], "over"
        return state, [Wait(until=None, reason="")], "wait"

    return rule


def run(executor: Requests, clock: VirtualClock) -> tuple[list[Any], list[Any]]:
    scheduler = Scheduler(clock)
    views: list[tuple[float, list[Any]]] = []
    ended: list[Any] = []

    async def loop() -> None:
        final = await drive(
            "test",
            rule_of(views, clock),
            0,
            executor.execute,
            clock=clock,
            inbox=Inbox(clock.bell()),
            settings=None,
            aside=frozenset({Renew, List}),
            latest=frozenset({Renew}),
        )
        ended.append((clock.now(), final))

    task = scheduler.spawn("loop", loop())
    scheduler.run(until=100)
    if task.error is not None:
        raise task.error
    return views, ended


def test_aside_effects_run_beside_the_loop_in_order_and_only_the_newest_renewal_waits() -> None:
    clock = VirtualClock()
    executor = Requests(clock)
    views, ended = run(executor, clock)
    # The read's result came back at once, while the LIST was under way; the LIST's came back
    # as a message when it ended.
    assert views == [(0.0, []), (0.0, ["read"]), (1.0, ["listed"])]
    # Renewal 3 replaced renewals 1 and 2 while they were queued, and went after the LIST
    # (in order); the loop ended only once its queue was carried out (the last renewal must
    # reach the store).
    assert executor.log == [(1.0, "list"), (6.0, "renew 3")]
    assert ended == [(6.0, 3)]


def test_an_aside_effect_that_fails_fails_the_loop() -> None:
    clock = VirtualClock()
    with pytest.raises(RuntimeError, match="the store refused renew 3"):
        run(Requests(clock, failing=True), clock)


def test_the_real_clock_gathers_at_once_and_raises_the_first_error() -> None:
    clock = MonotonicClock()

    async def wait_for(event: asyncio.Event, then: asyncio.Event | None) -> str:
        if then is not None:
            then.set()
        await event.wait()
        return "done"

    async def both() -> list[str]:
        first, second = asyncio.Event(), asyncio.Event()
        # Each waits on what the other sets: only coroutines run at once can both end.
        return await clock.gather(wait_for(first, second), wait_for(second, first))

    assert asyncio.run(both()) == ["done", "done"]

    async def failing() -> None:
        async def boom(message: str) -> None:
            raise ValueError(message)

        await clock.gather(boom("first"), boom("second"))

    with pytest.raises(ValueError, match="first"):
        asyncio.run(failing())
