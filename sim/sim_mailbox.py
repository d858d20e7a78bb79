"""One node incarnation's view of the simulated mailbox: latency, process faults, accounting.

``SimMailbox`` implements the ``Mailbox`` protocol over a ``MemoryMailbox`` handle (whose
``Faults`` inject transient errors, lost responses, 409 conflicts and stale listings) and adds
what a store cannot know about: the network's latency on the way there and back, the node's
process pausing or crashing just before or after a write (so a crash can fall between a claim
and its commit, or between a commit's payloads and its record), and, for the world's checks,
which writes landed. ``naive=True`` swaps the polling design for the one the request plan
avoids (Decision 8): every poll of a round's commit first LISTs the round.
"""

from __future__ import annotations

import math
import random
from collections.abc import Coroutine
from typing import Any, Protocol

from gradientmail.mailboxes._memory import MemoryMailbox
from gradientmail.mailboxes._protocol import ObjectInfo, RequestStats, TransientMailboxError
from gradientmail.testing._virtual import VirtualClock
from sim.sim_config import LatencyKind

__all__ = ["Latency", "SimMailbox", "WriteObserver", "run_now"]


def run_now(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that never sleeps (a fault-free ``MemoryMailbox`` call) to its end."""
    try:
        coroutine.send(None)
    except StopIteration as stop:
        return stop.value
    coroutine.close()
    raise RuntimeError("run_now: the coroutine waited; only non-sleeping calls may run here")


class Latency:
    """One-way request latency in seconds, drawn from ``kind`` with mean ``mean``.

    ``pareto`` (shape 1.5) has the long tail real stores show; draws are capped at 100x the
    mean so one request cannot stall a run forever.
    """

    def __init__(self, kind: LatencyKind, mean: float, rng: random.Random) -> None:
        if mean < 0 or not math.isfinite(mean):
            raise ValueError(f"latency mean must be finite seconds >= 0, got {mean}")
        self.kind = kind
        self.mean = mean
        self._rng = rng

    def draw(self) -> float:
        kind, mean, rng = self.kind, self.mean, self._rng
        if kind == "none" or mean == 0:
            return 0.0
        if kind == "uniform":
            value = rng.uniform(0.0, 2 * mean)
        elif kind == "exponential":
            value = rng.expovariate(1 / mean)
        else:
            value = mean / 3 * rng.paretovariate(1.5)
        return min(value, 100 * mean)


class WriteObserver(Protocol):
    """What the world does around each request of an incarnation's mailbox."""

    def issued(self, mailbox: SimMailbox, kind: str, key: str, data: bytes) -> None:
        """Called as the process makes a write, before it travels to the store."""
        ...

    def before_write(self, mailbox: SimMailbox, kind: str, key: str, started: float) -> bool:
        """Called as a write reaches the store; may raise ``Crashed``. True: the process was
        just paused, so the request must yield before it executes."""
        ...

    def after_write(
        self,
        mailbox: SimMailbox,
        kind: str,
        key: str,
        data: bytes,
        before: bytes | None,
        landed: bool,
    ) -> None:
        """Called once the store has executed a write (``before``: what the key held;
        ``landed``: whether this write changed it); may raise ``Crashed``."""
        ...

    def listed(self, mailbox: SimMailbox, prefix: str, infos: list[ObjectInfo]) -> None:
        """Called as a LIST executes, with what it returns."""
        ...

    def read(self, mailbox: SimMailbox, key: str) -> None:
        """Called as a GET executes."""
        ...

    def delay(self, mailbox: SimMailbox, leg: str, kind: str, key: str, drawn: float) -> float:
        """The latency a ``leg`` (``"to"`` the store or ``"from"`` it) of a request of ``kind``
        at ``key`` waits, given the ``drawn`` one (> 0)."""
        ...


class SimMailbox:
    """The mailbox as incarnation ``owner`` sees it (see the module docstring)."""

    def __init__(
        self,
        *,
        owner: Any,
        faulty: MemoryMailbox,
        clean: MemoryMailbox,
        oracle: MemoryMailbox,
        clock: VirtualClock,
        latency: Latency,
        observer: WriteObserver,
        naive: bool = False,
    ) -> None:
        self.owner = owner
        self.url = faulty.url
        self.stats = RequestStats()
        self._inner = faulty
        self._clean = clean
        self._oracle = oracle
        self.oracle = oracle  # the store itself, for the checker's reads (counted nowhere)
        self._clock = clock
        self._latency = latency
        self._observer = observer
        self.naive = naive
        self.purposes: dict[str, int] = {}

    def heal(self) -> None:
        """From now on, requests reach the store without injected errors."""
        self._inner = self._clean

    def _count(self, kind: str, key: str, *, bytes_out: int = 0) -> None:
        self.stats.count(kind, bytes_out=bytes_out)
        purpose = f"{kind} {_purpose(key)}"
        self.purposes[purpose] = self.purposes.get(purpose, 0) + 1

    async def _travel(self, leg: str, kind: str, key: str) -> None:
        """One leg (``"to"`` the store or ``"from"`` it) of a request: its drawn latency, as
        the observer lets it (``WriteObserver.delay``)."""
        delay = self._latency.draw()
        if delay > 0:
            delay = self._observer.delay(self, leg, kind, key, delay)
            if delay > 0:
                await self._clock.sleep(delay)

    async def get(self, key: str, *, limit: int | None = None) -> bytes | None:
        if self.naive and key.endswith("/commit") and key.startswith("rounds/"):
            listed = await self.list(key[: -len("commit")])
            if all(info.key != key for info in listed):
                return None
        await self._travel("to", "get", key)
        self._count("get", key)
        self._observer.read(self, key)
        data = await self._inner.get(key, limit=limit)
        await self._travel("from", "get", key)
        return data

    async def list(self, prefix: str, *, after: str | None = None) -> list[ObjectInfo]:
        await self._travel("to", "list", prefix)
        self._count("list", prefix)
        infos = await self._inner.list(prefix, after=after)
        self._observer.listed(self, prefix, infos)
        await self._travel("from", "list", prefix)
        return infos

    async def put(self, key: str, data: bytes, *, durable: bool = True) -> None:
        await self._write("put", key, data)

    async def create(self, key: str, data: bytes, *, durable: bool = True) -> bool:
        return bool(await self._write("create", key, data))

    async def delete(self, key: str) -> None:
        await self._write("delete", key, b"")

    async def close(self) -> None:
        """Nothing to release."""

    async def _write(self, kind: str, key: str, data: bytes) -> bool | None:
        started = self._clock.time
        self._observer.issued(self, kind, key, data)
        await self._travel("to", kind, key)
        if self._observer.before_write(self, kind, key, started):
            await self._clock.sleep(0.0)  # the pause holds the request here
        self._count(kind, key, bytes_out=len(data))
        before = run_now(self._oracle.get(key))
        error: TransientMailboxError | None = None
        result: bool | None = None
        try:
            if kind == "put":
                await self._inner.put(key, data)
            elif kind == "create":
                result = await self._inner.create(key, data)
            else:
                await self._inner.delete(key)
        except TransientMailboxError as exc:
            error = exc
        now = run_now(self._oracle.get(key))
        if kind == "delete":
            landed = before is not None and now is None
        else:
            landed = now == data and before != data
        self._observer.after_write(self, kind, key, data, before, landed)
        await self._travel("from", kind, key)
        if error is not None:
            raise error
        return result


def _purpose(key: str) -> str:
    """What a request is for, from its key: lease, commit, snapshot, claim, payload, round
    (a LIST of a whole round), head, manifest: the request plan's cost, by part."""
    if key.startswith("leases/"):
        return "lease"
    if key.startswith("rounds/"):
        if key.count("/") == 2 and key.endswith("/"):
            return "round"  # the naive plan's LIST of a whole round
        for part in ("snapshot", "claim", "commit"):
            if f"/{part}" in key:
                return part
        return "payload"
    if key.startswith("init/"):
        return "payload"
    return key.split("/", 1)[0].rstrip("s") or "other"
