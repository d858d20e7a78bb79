"""Virtual time: clocks, bells and one scheduler that run many nodes' coroutines in one thread.

A node's code awaits nothing but its clock's ``sleep`` and ``gather``, its bells' ``wait`` and
mailbox calls, so it needs no ``asyncio`` loop (a gather runs its coroutines as tasks of the
awaiting task's process): ``Scheduler`` steps each coroutine with ``send`` until it
waits, and moves time to the next wake-up only when every coroutine waits. Ties are broken by a
seeded random generator, so one seed is one interleaving, replayed bit for bit (``digest``).

Tasks belong to *processes* (one per node incarnation) that can be paused (every task of the
process is held until the pause ends, as a stopped VM or a long GC holds every thread) and
crashed (every task dropped where it stands). Each node may read its own drifting clock
(``NodeClock``): nodes never compare clocks, so a drifting rate tests exactly what the lease
rules claim. This is the one virtual clock and scheduler of the project: the tests' in-process
runs and the simulator both use it.
"""

from __future__ import annotations

import hashlib
import heapq
import random
import struct
from collections.abc import Callable, Coroutine, Generator
from typing import Any, TypeVar

from gradientmail._clock import raise_first

__all__ = ["Crashed", "NodeClock", "Process", "Scheduler", "Task", "VirtualBell", "VirtualClock"]

T = TypeVar("T")


class Crashed(BaseException):
    """Raised inside a task whose process crashed while that task was running (a fault
    injector crashed it from within a mailbox call). A ``BaseException``, so no retry loop or
    ``except Exception`` in the code under test swallows it."""


class _Sleep:
    __slots__ = ("until",)

    def __init__(self, until: float) -> None:
        self.until = until

    def __await__(self) -> Generator[_Sleep, None, None]:
        yield self


class _Wait:
    """Wait on ``bell`` until world time ``until`` (None: until rung)."""

    __slots__ = ("bell", "until")

    def __init__(self, bell: VirtualBell, until: float | None) -> None:
        self.bell = bell
        self.until = until

    def __await__(self) -> Generator[_Wait, None, None]:
        yield self


class _After:
    """Resume the awaiting task right after ``task`` next runs (at the same instant)."""

    __slots__ = ("task",)

    def __init__(self, task: Task) -> None:
        self.task = task

    def __await__(self) -> Generator[_After, None, None]:
        yield self


class _Gather:
    """Run ``coroutines`` as tasks of the awaiting task's process; resume when all are done."""

    __slots__ = ("coroutines", "tasks")

    def __init__(self, coroutines: tuple[Coroutine[Any, Any, Any], ...]) -> None:
        self.coroutines = coroutines
        self.tasks: list[Task] = []

    def __await__(self) -> Generator[_Gather | _After, None, list[Any]]:
        yield self  # the scheduler spawns ``tasks`` and resumes this task at the same instant
        for task in self.tasks:
            while not task.done:
                yield _After(task)
        outcomes = [t.result if t.error is None else t.error for t in self.tasks]
        for task in self.tasks:
            task.error = None  # handed to the awaiting task, no longer a task's own failure
        return raise_first(outcomes)


async def _gather(coroutines: tuple[Coroutine[Any, Any, T], ...]) -> list[T]:
    if len(coroutines) <= 1:  # nothing to run beside: no task to spawn
        return [await c for c in coroutines]
    return await _Gather(coroutines)


class VirtualClock:
    """World time in seconds: what the scheduler advances. Also a ``Clock`` of its own."""

    def __init__(self, start: float = 0.0) -> None:
        self.time = start

    def now(self) -> float:
        return self.time

    async def sleep(self, seconds: float) -> None:
        await _Sleep(self.time + max(0.0, seconds))

    def bell(self) -> VirtualBell:
        return VirtualBell(self, 1.0)

    async def gather(self, *coroutines: Coroutine[Any, Any, T]) -> list[T]:
        return await _gather(coroutines)


class NodeClock:
    """A node's monotonic clock: ``offset + rate * world time``."""

    def __init__(self, world: VirtualClock, *, offset: float = 0.0, rate: float = 1.0) -> None:
        if not rate > 0:
            raise ValueError(f"a clock rate must be positive, got {rate}")
        self.world = world
        self.offset = offset
        self.rate = rate

    def now(self) -> float:
        return self.offset + self.rate * self.world.time

    async def sleep(self, seconds: float) -> None:
        await _Sleep(self.world.time + max(0.0, seconds) / self.rate)

    def bell(self) -> VirtualBell:
        return VirtualBell(self.world, self.rate)

    async def gather(self, *coroutines: Coroutine[Any, Any, T]) -> list[T]:
        return await _gather(coroutines)


class VirtualBell:
    """A bell under virtual time: ``ring`` wakes the task waiting on it at the current instant
    (through its scheduler), or makes the next ``wait`` return at once."""

    __slots__ = ("_rate", "_rung", "_waiter", "_world")

    def __init__(self, world: VirtualClock, rate: float) -> None:
        self._world = world
        self._rate = rate
        self._rung = False
        self._waiter: tuple[Scheduler, Task] | None = None

    def ring(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is None:
            self._rung = True
            return
        scheduler, task = waiter
        scheduler.wake(task)

    async def wait(self, seconds: float | None) -> None:
        if self._rung:
            self._rung = False
            return
        until = None if seconds is None else self._world.time + max(0.0, seconds) / self._rate
        await _Wait(self, until)
        self._rung = False


class Process:
    """One node incarnation's tasks; ``paused_until`` holds them all (world seconds)."""

    __slots__ = ("alive", "ident", "name", "paused_until", "tasks")

    def __init__(self, name: str, ident: int) -> None:
        self.name = name
        self.ident = ident
        self.alive = True
        self.paused_until = 0.0
        self.tasks: list[Task] = []


class Task:
    __slots__ = (
        "coroutine",
        "done",
        "error",
        "followers",
        "ident",
        "name",
        "process",
        "result",
        "token",
        "waiting",
    )

    def __init__(
        self, name: str, ident: int, coroutine: Coroutine[Any, Any, Any], process: Process
    ) -> None:
        self.name = name
        self.ident = ident
        self.coroutine = coroutine
        self.process = process
        self.done = False
        self.error: BaseException | None = None
        self.result: Any = None
        self.token = 0  # a queue entry with another token is stale
        self.waiting: VirtualBell | None = None
        self.followers: list[Task] = []


class Scheduler:
    """Runs tasks on ``clock``; ``seed`` orders tasks that wake at the same instant."""

    def __init__(self, clock: VirtualClock, *, seed: int = 0) -> None:
        self.clock = clock
        self._random = random.Random(f"scheduler:{seed}")
        self._queue: list[tuple[float, float, int, int, Task]] = []
        self._counter = 0
        self._tasks = 0
        self.processes: list[Process] = []
        self.current: Task | None = None
        self.steps = 0
        self._digest = hashlib.blake2b(digest_size=16)
        self._pack = struct.Struct("<dI").pack
        self._main: Process | None = None

    def process(self, name: str) -> Process:
        process = Process(name, len(self.processes))
        self.processes.append(process)
        return process

    def spawn(
        self,
        name: str,
        coroutine: Coroutine[Any, Any, Any],
        *,
        process: Process | None = None,
        at: float | None = None,
    ) -> Task:
        """Run ``coroutine`` as task ``name`` of ``process`` (one shared process by default)
        from world time ``at`` (now by default)."""
        if process is None:
            if self._main is None:
                self._main = self.process("main")
            process = self._main
        self._tasks += 1
        task = Task(name, self._tasks, coroutine, process)
        process.tasks.append(task)
        if not process.alive:
            coroutine.close()
            task.done = True
            return task
        self._push(task, self.clock.time if at is None else at)
        return task

    def _push(self, task: Task, when: float) -> None:
        self._counter += 1
        heapq.heappush(self._queue, (when, self._random.random(), self._counter, task.token, task))

    def wake(self, task: Task) -> None:
        """Resume ``task`` (waiting on a bell) at the current instant."""
        if not task.done:
            task.token += 1
            task.waiting = None
            self._push(task, self.clock.time)

    def cancel(self, task: Task) -> None:
        """Drop ``task`` where it stands: its coroutine never runs again."""
        if not task.done:
            task.done = True
            task.coroutine.close()

    def crash(self, process: Process) -> None:
        """Drop every task of ``process`` where it stands. The running task, if it is one of
        them, is left to its caller, which must raise ``Crashed`` in it."""
        process.alive = False
        for task in process.tasks:
            if task is not self.current:
                self.cancel(task)

    def close(self) -> None:
        """Drop every task left (the run is over)."""
        for process in self.processes:
            for task in process.tasks:
                self.cancel(task)

    def pause(self, process: Process, until: float) -> None:
        """Hold every task of ``process`` until ``until`` (world seconds)."""
        process.paused_until = max(process.paused_until, until)

    async def after(self, task: Task) -> None:
        """Wait until ``task`` has run its next step (at once if it is done)."""
        await _After(task)

    def record(self, data: bytes) -> None:
        """Fold ``data`` (an event of the world) into the trace digest."""
        self._digest.update(data)

    @property
    def digest(self) -> str:
        return self._digest.hexdigest()

    def run(self, *, until: float, stop: Callable[[], bool] | None = None) -> None:
        """Run until no task is left, the next wake-up is after ``until``, or ``stop()``."""
        queue, clock, pack, update = self._queue, self.clock, self._pack, self._digest.update
        while queue:
            when, _, _, token, task = queue[0]
            if when > until or (stop is not None and stop()):
                break
            heapq.heappop(queue)
            if task.done or token != task.token:
                continue
            process = task.process
            if process.paused_until > when:
                self._push(task, process.paused_until)
                continue
            if when > clock.time:
                clock.time = when
            self._resume(task, when, pack, update)
        if queue and queue[0][0] > until:
            clock.time = max(clock.time, until)

    def _resume(self, task: Task, when: float, pack: Any, update: Any) -> None:
        task.token += 1
        if task.waiting is not None:  # woken by its timeout: the bell no longer holds it
            bell, task.waiting = task.waiting, None
            if bell._waiter is not None and bell._waiter[1] is task:
                bell._waiter = None
        self.steps += 1
        update(pack(when, task.ident))
        self.current = task
        request: object = None
        try:
            request = task.coroutine.send(None)
        except StopIteration as stop:
            task.done = True
            task.result = stop.value
        except BaseException as exc:  # a task's failure is data for its caller's checks
            task.done = True
            task.error = exc
        finally:
            self.current = None
        for follower in task.followers:
            self._push(follower, when)
        task.followers.clear()
        if task.done:
            return
        if type(request) is _Sleep:
            self._push(task, request.until)
        elif type(request) is _Wait:
            request.bell._waiter = (self, task)
            task.waiting = request.bell
            if request.until is not None:
                self._push(task, request.until)
        elif type(request) is _Gather:
            request.tasks = [
                self.spawn(f"{task.name}/{i}", coroutine, process=task.process)
                for i, coroutine in enumerate(request.coroutines)
            ]
            self._push(task, when)
        elif type(request) is _After:
            if request.task.done:
                self._push(task, when)
            else:
                request.task.followers.append(task)
        else:
            raise TypeError(
                f"task {task.name} awaited {request!r}: only clock sleeps and gathers, bell "
                "waits and mailbox calls may be awaited under virtual time"
            )

    @property
    def idle(self) -> bool:
        return not any(not t.done for p in self.processes for t in p.tasks)

    @property
    def errors(self) -> list[tuple[Task, BaseException]]:
        return [
            (t, t.error)
            for p in self.processes
            for t in p.tasks
            if t.error is not None and not isinstance(t.error, Crashed)
        ]
