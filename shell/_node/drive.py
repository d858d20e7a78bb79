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
from typing import Any, Generic, TypeVar

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
) -> S:
    """Run ``rule`` from ``state`` until it is done; ``keep`` sees every state (for readers
    on other threads). Raises what a ``Fail`` effect carries."""
    results: list[Result] = []
    while True:
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
            else:
                result = await execute(effect)
                if result is not None:
                    results.append(result)
        if not results:
            await inbox.bell.wait(None if until == math.inf else until - clock.now())


class Executor:
    """Carries out effects: ``_handlers`` maps each effect type it takes to a method."""

    _handlers: dict[type, Callable[[Any], Awaitable[Result | None]]]

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
        )

    def _keep(self, state: S) -> None:
        self.state = state
