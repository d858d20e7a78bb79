"""Virtual time: a clock and a scheduler that run many nodes' coroutines in one thread.

The shell's loops await nothing but ``Clock.sleep`` and mailbox calls, so they need no
``asyncio`` loop: ``Scheduler`` steps each coroutine with ``send`` until it sleeps, and advances
the clock to the next wake-up only when every coroutine waits. Ties are broken by a seeded
random generator, so one seed is one interleaving, replayed bit for bit.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Coroutine, Generator
from typing import Any

import attrs

__all__ = ["Scheduler", "VirtualClock"]


@attrs.frozen
class _Sleep:
    until: float

    def __await__(self) -> Generator[_Sleep, None, None]:
        yield self


class VirtualClock:
    """A ``Clock`` whose time moves only when its ``Scheduler`` says so."""

    def __init__(self, start: float = 0.0) -> None:
        self.time = start

    def now(self) -> float:
        return self.time

    async def sleep(self, seconds: float) -> None:
        await _Sleep(self.time + max(0.0, seconds))


@attrs.define
class _Task:
    name: str
    coroutine: Coroutine[Any, Any, Any]
    error: BaseException | None = None
    done: bool = False


class Scheduler:
    """Runs coroutines on a ``VirtualClock``; ``seed`` orders tasks that wake together."""

    def __init__(self, clock: VirtualClock, *, seed: int = 0) -> None:
        self.clock = clock
        self._random = random.Random(seed)
        self._queue: list[tuple[float, float, int, _Task]] = []
        self._counter = 0
        self.tasks: list[_Task] = []
        self.steps = 0

    def spawn(
        self, name: str, coroutine: Coroutine[Any, Any, Any], *, at: float | None = None
    ) -> _Task:
        task = _Task(name=name, coroutine=coroutine)
        self.tasks.append(task)
        self._push(task, self.clock.time if at is None else at)
        return task

    def _push(self, task: _Task, when: float) -> None:
        self._counter += 1
        heapq.heappush(self._queue, (when, self._random.random(), self._counter, task))

    def cancel(self, task: _Task) -> None:
        """Drop ``task`` where it stands (a crash): its coroutine never runs again."""
        if not task.done:
            task.done = True
            task.coroutine.close()

    def run(self, *, until: float) -> None:
        """Run until no task is left or the next wake-up is after ``until`` seconds."""
        while self._queue:
            when, _, _, task = self._queue[0]
            if when > until:
                break
            heapq.heappop(self._queue)
            if task.done:
                continue
            self.clock.time = max(self.clock.time, when)
            self.steps += 1
            try:
                request = task.coroutine.send(None)
            except StopIteration:
                task.done = True
                continue
            except BaseException as exc:
                task.done = True
                task.error = exc
                continue
            if not isinstance(request, _Sleep):
                raise TypeError(
                    f"task {task.name} awaited {request!r}: only Clock.sleep and mailbox calls "
                    "may be awaited under virtual time"
                )
            self._push(task, request.until)
        self.clock.time = max(
            self.clock.time, min(until, self._queue[0][0]) if self._queue else until
        )

    @property
    def errors(self) -> list[tuple[str, BaseException]]:
        return [(t.name, t.error) for t in self.tasks if t.error is not None]
