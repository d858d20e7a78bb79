"""The one loop every node loop runs: gather the view, call the rule with ``now``, carry out
the effects, sleep until the earliest deadline or a bell (Decision 14).

The view is what the loop's inbox received (messages from the node's other loops) and the
results of the effects it carried out last. Effects are carried out in order; one that reads
returns a result, so the rule is called again at once with it; when a step returns none, the
loop sleeps until the step's ``Wait.until`` or until its bell rings (a message arrived).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar, cast

from gradientmail._clock import Bell, Clock
from gradientmail.core.effects import Done, Effect, Fail, Result, Wait

__all__ = ["Executor", "Inbox", "Loop", "drive"]

logger = logging.getLogger("gradientmail.rules")

S = TypeVar("S")
Rule = Callable[..., tuple[S, list[Effect], str]]
Execute = Callable[[Effect], Awaitable[Result | None]]


class Inbox:
    """Messages for one loop from the node's other threads, and the bell that wakes it."""

    def __init__(self, bell: Bell) -> None:
        self.bell = bell
        self._lock = threading.Lock()
        self._items: list[Result] = []

    def put(self, *items: Result) -> None:
        with self._lock:
            self._items.extend(items)
        self.bell.ring()

    def take(self) -> list[Result]:
        with self._lock:
            items, self._items = self._items, []
        return items


class _Aside:
    """The effects a loop carries out beside itself: a queue, run one at a time by ``run``
    until ``close`` (and the queue is empty); results go to the loop's inbox, and an error
    ends the queue and is raised by the loop (``check``)."""

    def __init__(self, execute: Execute, inbox: Inbox, bell: Bell, latest: frozenset[type]) -> None:
        self._execute = execute
        self._inbox = inbox
        self._bell = bell
        self._latest = latest
        self._queue: list[Effect] = []
        self._closed = False
        self._error: BaseException | None = None

    def add(self, effect: Effect) -> None:
        if type(effect) in self._latest:
            self._queue = [e for e in self._queue if type(e) is not type(effect)]
        self._queue.append(effect)
        self._bell.ring()

    def close(self) -> None:
        self._closed = True
        self._bell.ring()

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    async def run(self) -> None:
        while True:
            while self._queue and self._error is None:
                effect = self._queue.pop(0)
                try:
                    result = await self._execute(effect)
                except Exception as exc:  # raised by the loop, at its next step
                    self._error = exc
                    self._inbox.bell.ring()
                    break
                if result is not None:
                    self._inbox.put(result)
            if self._closed or self._error is not None:
                return
            await self._bell.wait(None)


async def drive(
    name: str,
    rule: Rule[S],
    state: S,
    execute: Execute,
    *,
    clock: Clock,
    inbox: Inbox,
    settings: Any,
    keep: Callable[[S], None] | None = None,
    aside: frozenset[type] = frozenset(),
    latest: frozenset[type] = frozenset(),
) -> S:
    """Run ``rule`` from ``state`` until it is done; ``keep`` sees every state (for readers
    on other threads); effects of the types in ``aside`` are carried out beside the loop
    (``latest``: those a newer one replaces while queued). Raises what a ``Fail`` effect
    carries, or what an aside effect raised."""
    beside = _Aside(execute, inbox, clock.bell(), latest) if aside else None

    async def loop(state: S) -> S:
        results: list[Result] = []
        while True:
            if beside is not None:
                beside.check()
            view: Sequence[Result] = [*inbox.take(), *results]
            state, effects, reason = rule(view, state, now=clock.now(), settings=settings)
            if keep is not None:
                keep(state)
            logger.debug("%s: %s", name, reason)
            results, until = [], math.inf
            for effect in effects:
                if isinstance(effect, Wait):
                    until = math.inf if effect.until is None else effect.until
                elif isinstance(effect, Done):
                    return state
                elif isinstance(effect, Fail):
                    raise effect.error
                elif beside is not None and type(effect) in aside:
                    beside.add(effect)
                else:
                    result = await execute(effect)
                    if result is not None:
                        results.append(result)
            if not results:
                await inbox.bell.wait(None if until == math.inf else until - clock.now())

    if beside is None:
        return await loop(state)

    async def beside_loop(state: S) -> S:
        try:
            return await loop(state)
        finally:
            beside.close()

    final, _ = await clock.gather(beside_loop(state), beside.run())
    beside.check()  # an effect queued before the loop ended may have failed after it
    return cast(S, final)


class Executor:
    """Carries out effects: ``_handlers`` maps each effect type it takes to a method."""

    _handlers: dict[type, Callable[[Any], Awaitable[Result | None]]]

    aside: frozenset[type] = frozenset()
    """Effect types carried out beside the loop (``drive``)."""
    latest: frozenset[type] = frozenset()
    """Aside effect types of which only the newest queued one is carried out."""

    async def execute(self, effect: Effect) -> Result | None:
        return await self._handlers[type(effect)](effect)


class Loop(Executor, Generic[S]):
    """One of a node's long-running loops: ``rule`` driven from ``state`` on its own inbox,
    the state kept after every call for readers on other threads."""

    name: str
    state: S
    inbox: Inbox
    settings: Any

    def rule(self, view: Sequence[Result], state: S, *, now: float, settings: Any) -> Any:
        raise NotImplementedError

    async def run(self, clock: Clock) -> None:
        await drive(
            self.name,
            self.rule,
            self.state,
            self.execute,
            clock=clock,
            inbox=self.inbox,
            settings=self.settings,
            keep=self._keep,
            aside=self.aside,
            latest=self.latest,
        )

    def _keep(self, state: S) -> None:
        self.state = state
