"""An in-process mailbox for tests and simulation, with seeded fault injection.

The store is guarded by a ``threading.Lock`` and holds no event-loop objects, so handles can be
awaited from many asyncio loops in different threads; waits go through a :class:`Clock`, so a
simulator on virtual time sees the injected delays on its own clock.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import random
import threading
from collections.abc import Callable
from typing import Literal

import attrs

from gradientmail._clock import Clock, MonotonicClock
from gradientmail.mailboxes._protocol import (
    ObjectInfo,
    RequestStats,
    TooLarge,
    TransientMailboxError,
    validate_key,
    validate_prefix,
)

__all__ = ["Faults", "MemoryMailbox"]

_Kind = Literal["get", "put", "create", "list", "delete"]
_WRITES = ("put", "create", "delete")


def _probability(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"Faults.{attribute.name} is a probability in [0, 1], got {value!r}")


def _delay_range(_: object, attribute: attrs.Attribute[tuple[float, float]], value: object) -> None:
    ok = isinstance(value, tuple) and len(value) == 2 and 0.0 <= value[0] <= value[1]
    if not ok:
        raise ValueError(
            f"Faults.delay is (low, high) seconds with 0 <= low <= high, got {value!r}"
        )


@attrs.frozen(kw_only=True)
class Faults:
    """What goes wrong, and how often, on a :class:`MemoryMailbox` handle.

    Every random choice comes from one ``random.Random(seed)`` in request order, so the same
    seed and the same sequence of requests replay the same faults.

    Attributes:
        seed: seeds the handle's random generator.
        delay: each request first waits a uniform draw from this range, in seconds of the clock.
        fail_before: probability a request raises :class:`TransientMailboxError` without effect.
        fail_after: probability a write (put, create, delete) takes effect but the caller gets
            :class:`TransientMailboxError` anyway.
        conflict: probability a create raises a 409-style :class:`TransientMailboxError`
            without effect (S3 answers 409 ConditionalRequestConflict to racing creates).
        stale_list: probability that a list omits each key written in the last
            ``stale_window`` seconds (so a newer key may show before an older one).
        stale_window: seconds of the clock during which a new key may be missing from lists.
        decide: whether each possible fault takes effect, given whether it was drawn: called as
            ``decide(fault, operation, key, drawn)`` for every fault kind with a probability
            above 0 that the request could have (``fault`` is ``"fail_before"``,
            ``"conflict"``, ``"fail_after"`` or, once per recent key a list could omit,
            ``"stale_list"``; ``key`` is the request's key or the listed key). The draws are
            made either way, so a hook that overrides some of them leaves the other random
            choices as they were (the simulator's delta debugging fires a chosen subset of a
            run's faults this way). None: every drawn fault takes effect.
    """

    seed: int = 0
    delay: tuple[float, float] = attrs.field(default=(0.0, 0.0), validator=_delay_range)
    fail_before: float = attrs.field(default=0.0, validator=_probability)
    fail_after: float = attrs.field(default=0.0, validator=_probability)
    conflict: float = attrs.field(default=0.0, validator=_probability)
    stale_list: float = attrs.field(default=0.0, validator=_probability)
    stale_window: float = attrs.field(default=1.0, validator=attrs.validators.ge(0.0))
    decide: Callable[[str, str, str, bool], bool] | None = attrs.field(default=None, eq=False)


@attrs.define
class _Entry:
    data: bytes
    version: int
    written_at: float
    md5: str | None = None  # of objects up to MD5_LIMIT bytes, as S3's etag says it
    info: ObjectInfo | None = None  # what a list reports of it, made once (entries never change)


MD5_LIMIT = 64 * 1024


class _Store:
    """The shared state behind one or more handles: the objects by key, and their keys in
    order (``keys``), so that a LIST visits only the keys under its prefix."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.objects: dict[str, _Entry] = {}
        self.keys: list[str] = []
        self.versions = itertools.count(1)

    def put(self, key: str, entry: _Entry) -> None:
        """Store ``entry`` at ``key`` (with the lock held)."""
        if key not in self.objects:
            bisect.insort(self.keys, key)
        self.objects[key] = entry

    def pop(self, key: str) -> None:
        """Remove ``key`` if present (with the lock held)."""
        if self.objects.pop(key, None) is not None:
            del self.keys[bisect.bisect_left(self.keys, key)]

    def under(self, prefix: str, after: str | None) -> list[str]:
        """The keys that start with ``prefix`` and sort after ``after``, in order (with the
        lock held)."""
        start = bisect.bisect_left(self.keys, prefix)
        if after is not None and after >= prefix:
            start = bisect.bisect_right(self.keys, after, lo=start)
        # Every key under the prefix sorts below the prefix followed by a character above
        # any a key may hold (keys are ASCII: ``validate_key``).
        end = bisect.bisect_left(self.keys, prefix + "\uffff", lo=start)
        return self.keys[start:end]


_named_lock = threading.Lock()
_named: dict[str, _Store] = {}
_anonymous = itertools.count()


@attrs.frozen
class _Draw:
    fail_before: bool
    fail_after: bool
    conflict: bool


class MemoryMailbox:
    """A mailbox held in this process's memory.

    Args:
        url: a ``memory://name`` label for messages. A new instance has its own empty store;
            use :meth:`named` (or ``mailbox_from_url("memory://name")``) to share a store by
            name within the process, and :meth:`handle` for another handle on this store.
        faults: what to inject on this handle; None injects nothing.
        clock: where injected delays are slept and write times read; the process's monotonic
            clock by default.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        faults: Faults | None = None,
        clock: Clock | None = None,
        _store: _Store | None = None,
    ) -> None:
        if url is None:
            url = f"memory://anonymous-{next(_anonymous)}"
        if not url.startswith("memory://"):
            raise ValueError(f"a MemoryMailbox url starts with 'memory://', got {url!r}")
        self.url = url
        self.stats = RequestStats()
        self.faults = faults or Faults()
        self._clock: Clock = clock or MonotonicClock()
        self._random = random.Random(self.faults.seed)
        self._store = _store or _Store()

    @classmethod
    def named(
        cls, name: str, *, faults: Faults | None = None, clock: Clock | None = None
    ) -> MemoryMailbox:
        """A handle on the process-wide store called ``name``, created empty on first use."""
        with _named_lock:
            store = _named.setdefault(name, _Store())
        return cls(f"memory://{name}", faults=faults, clock=clock, _store=store)

    def handle(self, *, faults: Faults | None = None, clock: Clock | None = None) -> MemoryMailbox:
        """Another handle on this store, with its own stats and faults, and ``clock`` (this
        handle's clock when not given)."""
        return MemoryMailbox(
            self.url, faults=faults, clock=clock or self._clock, _store=self._store
        )

    async def get(self, key: str, *, limit: int | None = None) -> bytes | None:
        validate_key(key, store=self.url, operation="get")
        await self._enter("get", key)
        with self._store.lock:
            entry = self._store.objects.get(key)
        data = None if entry is None else entry.data
        if data is not None and limit is not None and len(data) > limit:
            self.stats.count("get")
            raise TooLarge(store=self.url, key=key, size=len(data), limit=limit)
        self.stats.count("get", bytes_in=0 if data is None else len(data))
        return data

    async def put(self, key: str, data: bytes, *, durable: bool = True) -> None:
        validate_key(key, store=self.url, operation="put")
        await self._write("put", key, data, lambda: self._store_entry(key, data, replace=True))

    async def create(self, key: str, data: bytes, *, durable: bool = True) -> bool:
        validate_key(key, store=self.url, operation="create")
        return await self._write(
            "create", key, data, lambda: self._store_entry(key, data, replace=False)
        )

    async def delete(self, key: str) -> None:
        validate_key(key, store=self.url, operation="delete")
        await self._write("delete", key, b"", lambda: self._store.pop(key))

    async def list(self, prefix: str, *, after: str | None = None) -> list[ObjectInfo]:
        validate_prefix(prefix, store=self.url)
        await self._enter("list", prefix)
        now = self._clock.now()
        infos = []
        with self._store.lock:
            objects = self._store.objects
            for key in self._store.under(prefix, after):
                entry = objects[key]
                if self.faults.stale_list > 0 and self._hidden(key, entry, now):
                    continue
                info = entry.info
                if info is None:
                    info = entry.info = ObjectInfo(
                        key=key,
                        size=len(entry.data),
                        version=str(entry.version),
                        modified=entry.written_at,
                        md5=entry.md5,
                    )
                infos.append(info)
        self.stats.count("list")
        return infos

    async def close(self) -> None:
        """Nothing to release: the store lives as long as a handle or the name refers to it."""

    def __repr__(self) -> str:
        return f"MemoryMailbox({self.url!r})"

    def _hidden(self, key: str, entry: _Entry, now: float) -> bool:
        """Whether a list leaves out this recent entry (called with the store's lock held)."""
        faults = self.faults
        if faults.stale_list <= 0 or now - entry.written_at >= faults.stale_window:
            return False
        return self._decided("stale_list", "list", key, self._chance(faults.stale_list))

    def _store_entry(self, key: str, data: bytes, *, replace: bool) -> bool:
        """Write ``key`` (called with the store's lock held); False if it exists and not replace."""
        if not replace and key in self._store.objects:
            return False
        version = next(self._store.versions)
        blob = bytes(data)
        md5 = (
            hashlib.md5(blob, usedforsecurity=False).hexdigest() if len(blob) <= MD5_LIMIT else None
        )
        self._store.put(key, _Entry(blob, version, self._clock.now(), md5))
        return True

    async def _write(self, kind: _Kind, key: str, data: bytes, apply: Callable[[], object]) -> bool:
        draw = await self._enter(kind, key)
        if draw.conflict:
            self.stats.count(kind, bytes_out=len(data))
            raise self._fault(kind, key, "409 conflict: a concurrent write to this key (injected)")
        with self._store.lock:
            applied = apply()
        self.stats.count(kind, bytes_out=len(data))
        if draw.fail_after:
            raise self._fault(kind, key, "the write landed but the reply was lost (injected)")
        return applied is not False

    async def _enter(self, kind: _Kind, key: str) -> _Draw:
        """Draw this request's faults, wait its delay, and fail it early if so drawn."""
        faults = self.faults
        with self._store.lock:
            delay = self._random.uniform(*faults.delay) if faults.delay[1] > 0 else 0.0
            drawn = _Draw(
                fail_before=self._chance(faults.fail_before),
                fail_after=kind in _WRITES and self._chance(faults.fail_after),
                conflict=kind == "create" and self._chance(faults.conflict),
            )
        draw = drawn if faults.decide is None else self._decide(kind, key, drawn)
        if delay > 0:
            await self._clock.sleep(delay)
        if draw.fail_before:
            self.stats.count(kind)
            raise self._fault(kind, key, "the request failed before taking effect (injected)")
        return draw

    def _chance(self, probability: float) -> bool:
        # A zero probability draws nothing, so a handle without faults consumes no randomness.
        return probability > 0 and self._random.random() < probability

    def _decide(self, kind: _Kind, key: str, drawn: _Draw) -> _Draw:
        """``Faults.decide`` for each fault this request could have, in the order they act."""
        faults = self.faults
        fail_before = faults.fail_before > 0 and self._decided(
            "fail_before", kind, key, drawn.fail_before
        )
        conflict = (
            kind == "create"
            and faults.conflict > 0
            and self._decided("conflict", kind, key, drawn.conflict)
        )
        fail_after = (
            kind in _WRITES
            and faults.fail_after > 0
            and self._decided("fail_after", kind, key, drawn.fail_after)
        )
        return _Draw(fail_before=fail_before, fail_after=fail_after, conflict=conflict)

    def _decided(self, fault: str, kind: str, key: str, drawn: bool) -> bool:
        decide = self.faults.decide
        return drawn if decide is None else decide(fault, kind, key, drawn)

    def _fault(self, kind: str, key: str, message: str) -> TransientMailboxError:
        return TransientMailboxError(message, store=self.url, key=key, operation=kind)
