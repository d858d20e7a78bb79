"""The simulator's clocks and scheduler: many nodes' processes in one thread, on virtual time.

Like ``gradientmail.testing.virtual`` (whose design this follows), coroutines await nothing but
a clock's ``sleep``; the scheduler resumes the earliest, breaking ties with a seeded generator,
and moves time to the next wake-up only when every coroutine waits. On top of it this module
groups tasks into *processes* (one per node incarnation) that can be paused (every task of the
process is held until the pause ends, as a stopped VM or a long GC holds every thread) and
crashed (every task dropped where it stands), gives each node its own drifting monotonic clock,
and folds every step into a trace digest so that a replay can be compared bit for bit.
"""

from __future__ import annotations

import hashlib
import heapq
import random
import struct
from collections.abc import Callable, Coroutine, Generator
from typing import Any

__all__ = ["Crashed", "NodeClock", "Process", "Scheduler", "SimClock", "Task"]


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


class _After:
    """Resume the awaiting task right after ``task`` next runs (at the same instant)."""

    __slots__ = ("task",)

    def __init__(self, task: Task) -> None:
        self.task = task

    def __await__(self) -> Generator[_After, None, None]:
        yield self


class SimClock:
    """World time in seconds: what the scheduler advances and the mailbox's latency uses."""

    def __init__(self) -> None:
        self.time = 0.0

    def now(self) -> float:
        return self.time

    async def sleep(self, seconds: float) -> None:
        await _Sleep(self.time + max(0.0, seconds))


class NodeClock:
    """A node's monotonic clock: ``offset + rate * world time``. Nodes never compare clocks,
    so a drifting ``rate`` tests exactly what the lease rules claim (Decision 3)."""

    def __init__(self, world: SimClock, *, offset: float = 0.0, rate: float = 1.0) -> None:
        if not rate > 0:
            raise ValueError(f"a clock rate must be positive, got {rate}")
        self.world = world
        self.offset = offset
        self.rate = rate

    def now(self) -> float:
        return self.offset + self.rate * self.world.time

    async def sleep(self, seconds: float) -> None:
        await _Sleep(self.world.time + max(0.0, seconds) / self.rate)


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
    __slots__ = ("coroutine", "done", "error", "followers", "ident", "name", "process")

    def __init__(
        self, name: str, ident: int, coroutine: Coroutine[Any, Any, Any], process: Process
    ) -> None:
        self.name = name
        self.ident = ident
        self.coroutine = coroutine
        self.process = process
        self.done = False
        self.error: BaseException | None = None
        self.followers: list[Task] = []


class Scheduler:
    """Runs tasks on ``clock``; ``seed`` orders tasks that wake at the same instant."""

    def __init__(self, clock: SimClock, *, seed: int) -> None:
        self.clock = clock
        self._random = random.Random(f"scheduler:{seed}")
        self._queue: list[tuple[float, float, int, Task]] = []
        self._counter = 0
        self._tasks = 0
        self.processes: list[Process] = []
        self.current: Task | None = None
        self.steps = 0
        self._digest = hashlib.blake2b(digest_size=16)
        self._pack = struct.Struct("<dI").pack

    def process(self, name: str) -> Process:
        process = Process(name, len(self.processes))
        self.processes.append(process)
        return process

    def spawn(
        self,
        process: Process,
        name: str,
        coroutine: Coroutine[Any, Any, Any],
        *,
        at: float | None = None,
    ) -> Task:
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
        heapq.heappush(self._queue, (when, self._random.random(), self._counter, task))

    def crash(self, process: Process) -> None:
        """Drop every task of ``process`` where it stands. The running task, if it is one of
        them, is left to its caller, which must raise ``Crashed`` in it."""
        process.alive = False
        for task in process.tasks:
            if not task.done and task is not self.current:
                task.done = True
                task.coroutine.close()

    def close(self) -> None:
        """Drop every task left (the run is over)."""
        for process in self.processes:
            for task in process.tasks:
                if not task.done:
                    task.done = True
                    task.coroutine.close()

    def pause(self, process: Process, until: float) -> None:
        """Hold every task of ``process`` until ``until`` (world seconds)."""
        process.paused_until = max(process.paused_until, until)

    async def after(self, task: Task) -> None:
        """Wait until ``task`` has run its next step (at once if it is done): how a training
        thread's ``wait`` on the learner's handoff condition is woken."""
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
            when, _, _, task = queue[0]
            if when > until or (stop is not None and stop()):
                break
            heapq.heappop(queue)
            if task.done:
                continue
            process = task.process
            if process.paused_until > when:
                self._push(task, process.paused_until)
                continue
            if when > clock.time:
                clock.time = when
            self.steps += 1
            update(pack(when, task.ident))
            self.current = task
            try:
                request = task.coroutine.send(None)
            except StopIteration:
                task.done = True
                request = None
            except BaseException as exc:  # a task's failure is data for the world's checks
                task.done = True
                task.error = exc
                request = None
            finally:
                self.current = None
            if task.followers:
                for follower in task.followers:
                    self._push(follower, when)
                task.followers.clear()
            if request is None:
                continue
            if type(request) is _Sleep:
                self._push(task, request.until)
            elif type(request) is _After:
                target = request.task
                if target.done:
                    self._push(task, when)
                else:
                    target.followers.append(task)
            else:
                raise TypeError(
                    f"task {task.name} awaited {request!r}: only clock sleeps and mailbox calls "
                    "may be awaited under simulation"
                )
        if queue and queue[0][0] > until:
            clock.time = max(clock.time, until)

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
