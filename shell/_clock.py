"""Clocks and bells: where the shell reads time and waits, so a simulator can swap in virtual
time and run the same code.

A ``Clock`` gives monotonic seconds, a way to sleep, ``bell()``: a ``Bell`` that cuts a wait
short, and ``gather``: coroutines run at once (requests in flight together). A node's loops
sleep on their bells until the earliest deadline their rules returned, and ring each other's
when they hand something over (a capture to upload, a snapshot to consider, a commit to merge),
so what a node does itself never waits for a poll.

The real clock's bells work across threads: a loop awaits ``wait`` on its ``asyncio`` event
loop, and the training thread awaits it in a coroutine that ``run_sync`` drives without any
event loop (``Session.step`` and ``Session.close`` are such coroutines, shared with the
simulator, whose virtual clock's bells are its scheduler's).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Coroutine, Generator, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

__all__ = ["Bell", "Clock", "MonotonicClock", "ThreadBell", "nap", "raise_first", "run_sync"]

T = TypeVar("T")

# Set while ``run_sync`` drives a coroutine on this thread: its bell waits block the thread.
_driving = threading.local()


@runtime_checkable
class Bell(Protocol):
    """Wakes a waiter early: ``ring`` from anywhere, ``await wait(seconds)`` where it waits."""

    def ring(self) -> None:
        """Wake the waiter now, or make its next ``wait`` return at once."""
        ...

    async def wait(self, seconds: float | None) -> None:
        """Wait ``seconds`` (None: until rung), or until ``ring``; at once if it rang since the
        last wait."""
        ...


@runtime_checkable
class Clock(Protocol):
    """Monotonic time in seconds, a way to wait on it, and bells."""

    def now(self) -> float:
        """Seconds on a monotonic scale (the origin is arbitrary)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` of this clock's time."""
        ...

    def bell(self) -> Bell:
        """A new bell whose waits run on this clock."""
        ...

    async def gather(self, *coroutines: Coroutine[Any, Any, T]) -> list[T]:
        """Run ``coroutines`` at once and return their results in order. Every one runs to its
        end; then the first (in order) that raised has its exception raised here."""
        ...


class _Block:
    """What a coroutine driven by ``run_sync`` yields to wait on a bell."""

    __slots__ = ("bell", "seconds")

    def __init__(self, bell: ThreadBell, seconds: float | None) -> None:
        self.bell = bell
        self.seconds = seconds

    def __await__(self) -> Generator[_Block, None, None]:
        yield self


class ThreadBell:
    """A bell rung from any thread. Awaited on an ``asyncio`` loop it waits on that loop; in a
    coroutine ``run_sync`` drives, it blocks the calling thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._condition = threading.Condition(self._lock)
        self._rung = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    def ring(self) -> None:
        with self._lock:
            self._rung = True
            self._condition.notify_all()
            loop, event = self._loop, self._event
        if loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody to wake
                loop.call_soon_threadsafe(event.set)

    async def wait(self, seconds: float | None) -> None:
        if getattr(_driving, "active", False):  # driven by run_sync: block this thread
            await _Block(self, seconds)
            return
        await self._wait_async(seconds)

    # ``sleep`` is the name the loops used before bells took a deadline.
    async def sleep(self, seconds: float | None) -> None:
        await self.wait(seconds)

    def block(self, seconds: float | None) -> None:
        """Block the calling thread for ``seconds`` or until rung."""
        with self._condition:
            if not self._rung:
                self._condition.wait(None if seconds is None else max(0.0, seconds))
            self._rung = False

    async def _wait_async(self, seconds: float | None) -> None:
        with self._lock:
            if self._event is None or self._loop is not asyncio.get_running_loop():
                self._loop, self._event = asyncio.get_running_loop(), asyncio.Event()
            event = self._event
            rung, self._rung = self._rung, False
            event.clear()
        if rung:
            return
        timeout = None if seconds is None else max(0.0, seconds)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout=timeout)
        with self._lock:
            self._rung = False


class MonotonicClock:
    """The process's monotonic clock, with ``asyncio``'s sleep and thread bells."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))

    def bell(self) -> ThreadBell:
        return ThreadBell()

    async def gather(self, *coroutines: Coroutine[Any, Any, T]) -> list[T]:
        if len(coroutines) <= 1:  # nothing to run beside: no task to make
            return [await c for c in coroutines]
        return raise_first(await asyncio.gather(*coroutines, return_exceptions=True))


def raise_first(outcomes: Sequence[T | BaseException]) -> list[T]:
    """``outcomes`` as results, or the first exception among them raised."""
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    return list(outcomes)  # type: ignore[arg-type]


async def nap(clock: Clock, bell: Bell | None, seconds: float) -> None:
    """Sleep ``seconds`` of ``clock``, cut short by ``bell`` where there is one."""
    if bell is not None:
        await bell.wait(seconds)
    else:
        await clock.sleep(seconds)


def run_sync(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` to its end on the calling thread, without an event loop: it may await
    only ``ThreadBell.wait`` (which blocks the thread until rung or timed out)."""
    was, _driving.active = getattr(_driving, "active", False), True
    try:
        request = coroutine.send(None)
        while True:
            if not isinstance(request, _Block):
                raise TypeError(f"run_sync cannot wait on {request!r}: only on thread bells")
            request.bell.block(request.seconds)
            request = coroutine.send(None)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    finally:
        _driving.active = was
        coroutine.close()
