"""Clocks: where the shell reads time and waits, so a simulator can swap in virtual time."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "MonotonicClock"]


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
