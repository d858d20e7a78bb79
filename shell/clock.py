"""Clocks: where the shell reads time and waits, so a simulator can swap in virtual time."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Protocol, runtime_checkable

__all__ = ["Bell", "Clock", "MonotonicClock", "nap"]


@runtime_checkable
class Clock(Protocol):
    """Monotonic time in seconds and a way to wait on it."""

    def now(self) -> float:
        """Seconds on a monotonic scale (the origin is arbitrary)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` of this clock's time."""
        ...


class MonotonicClock:
    """The process's monotonic clock with asyncio's sleep."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class Bell:
    """Cuts a loop's poll sleep short: ``ring`` from any thread, ``sleep`` on the loop's own.

    ``Session`` gives its learner and syncer loops one each, so a captured fragment is uploaded,
    a published snapshot considered and a commit fetched at once rather than at the next poll;
    the polls remain, for what other nodes do. Real time only (an ``asyncio`` loop under
    ``MonotonicClock``): a simulator's loops on virtual time run without bells.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rung = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    def ring(self) -> None:
        """Wake the sleeper now, or make its next ``sleep`` return at once."""
        with self._lock:
            self._rung = True
            loop, event = self._loop, self._event
        if loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody to wake
                loop.call_soon_threadsafe(event.set)

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds``, or until ``ring``; at once if it rang since the last sleep."""
        with self._lock:
            if self._event is None:
                self._loop, self._event = asyncio.get_running_loop(), asyncio.Event()
            event = self._event
            rung, self._rung = self._rung, False
            event.clear()
        if rung:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout=max(0.0, seconds))
        with self._lock:
            self._rung = False


async def nap(clock: Clock, bell: Bell | None, seconds: float) -> None:
    """A loop's poll sleep: ``seconds`` of ``clock``, cut short by ``bell`` where it has one."""
    if bell is not None:
        await bell.sleep(seconds)
    else:
        await clock.sleep(seconds)
