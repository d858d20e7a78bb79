"""What a node reports about itself: typed, immutable events and the callbacks that take them.

Callbacks run on the thread that produced the event (the training thread for merges and
rebases, the communication threads for the rest); one that raises is logged and ignored, so a
metrics bug never stops a run.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

__all__ = [
    "Callback",
    "Claimed",
    "Clipped",
    "Committed",
    "Event",
    "Excluded",
    "Failed",
    "Joined",
    "JsonLines",
    "LeaseExpired",
    "Left",
    "Merged",
    "Published",
    "Rebased",
    "Rejected",
    "Retried",
    "Stalled",
    "TookOver",
    "combined",
    "log_events",
]

logger = logging.getLogger("gradientmail")


@attrs.frozen(kw_only=True)
class Joined:
    """``node`` joined (``created``: it created the run) holding commit ``rounds[k]`` of each
    fragment (-1: the initial parameters)."""

    node: str
    created: bool
    rounds: tuple[int, ...]


@attrs.frozen(kw_only=True)
class Published:
    """``node`` published its delta for ``round``: ``samples`` tokens over ``steps`` inner
    steps, ``bytes`` stored."""

    node: str
    round: int
    fragment: int
    samples: int
    steps: int
    bytes: int


@attrs.frozen(kw_only=True)
class Claimed:
    node: str
    round: int
    attempt: int


@attrs.frozen(kw_only=True)
class TookOver:
    """``node`` claimed a later attempt of ``round`` after attempt ``attempt - 1`` stalled."""

    node: str
    round: int
    attempt: int


@attrs.frozen(kw_only=True)
class Committed:
    """``node`` closed ``round``: ``included`` snapshots, ``samples`` tokens in all."""

    node: str
    round: int
    fragment: int
    attempt: int
    included: int
    samples: int
    seconds: float


@attrs.frozen(kw_only=True)
class Merged:
    """``node``'s model now holds the commit of ``round`` (``since``: snapshot or base);
    ``staleness``: the inner steps the node took between capturing the fragment's snapshot and
    this merge (the steps a commit overlaps); ``step``: the node's inner steps so far (its
    ``Session.step`` calls)."""

    node: str
    round: int
    fragment: int
    since: str
    staleness: int = 0
    step: int = 0


@attrs.frozen(kw_only=True)
class Stalled:
    """``node``'s ``step()`` waited ``seconds`` for the commit of ``round`` (the overlap
    bound) at its inner step ``step``: training time lost to communication."""

    node: str
    round: int
    fragment: int
    seconds: float
    step: int = 0


@attrs.frozen(kw_only=True)
class Rebased:
    """``node``'s snapshot of ``missed`` was not included; ``samples`` move to a later round."""

    node: str
    fragment: int
    missed: int
    samples: int


@attrs.frozen(kw_only=True)
class LeaseExpired:
    """``observer`` saw ``node``'s lease unchanged for the lease timeout."""

    observer: str
    node: str


@attrs.frozen(kw_only=True)
class Excluded:
    """A snapshot ``key`` of ``round`` was left out of the commit, with the reason."""

    node: str
    round: int
    key: str
    reason: str


@attrs.frozen(kw_only=True)
class Clipped:
    """``node``, closing ``round``, scaled the snapshot ``key``'s delta by ``factor`` (below 1)
    to the algorithm's norm clip before the weighted mean (``DiLoCo.clip``)."""

    node: str
    round: int
    key: str
    factor: float


@attrs.frozen(kw_only=True)
class Rejected:
    """An object under the run's keys is corrupt or foreign and was not used."""

    node: str
    key: str
    reason: str


@attrs.frozen(kw_only=True)
class Retried:
    """A transient mailbox error on ``operation`` of ``key``; retried after ``delay`` s."""

    node: str
    operation: str
    key: str
    attempt: int
    delay: float
    error: str


@attrs.frozen(kw_only=True)
class Left:
    node: str


@attrs.frozen(kw_only=True)
class Failed:
    """A background loop of ``node`` died of ``error``; the next ``step`` raises it."""

    node: str
    where: str
    error: str


Event = (
    Joined
    | Published
    | Claimed
    | TookOver
    | Committed
    | Merged
    | Stalled
    | Rebased
    | LeaseExpired
    | Excluded
    | Clipped
    | Rejected
    | Retried
    | Left
    | Failed
)
Callback = Callable[[Event], None]


def describe(event: Event) -> str:
    """One concise line: the event's name and its fields."""
    fields = " ".join(f"{k}={v}" for k, v in attrs.asdict(event).items())
    return f"{type(event).__name__} {fields}"


_LEVELS: dict[type, int] = {
    Excluded: logging.WARNING,
    Rejected: logging.WARNING,
    Retried: logging.WARNING,
    LeaseExpired: logging.WARNING,
    Failed: logging.ERROR,
}


def log_events(event: Event) -> None:
    """Log each event as one line through the ``gradientmail`` logger."""
    logger.log(_LEVELS.get(type(event), logging.INFO), describe(event))


def combined(*callbacks: Callback) -> Callback:
    """One callback that calls each of ``callbacks`` in turn; one that raises is logged."""

    def call(event: Event) -> None:
        for callback in callbacks:
            try:
                callback(event)
            except Exception:
                logger.exception("event callback %r failed on %s", callback, describe(event))

    return call


class JsonLines:
    """A callback that appends each event as one JSON object per line to ``path`` (for
    metrics), with its type under ``"event"`` and the wall-clock time (Unix seconds) it was
    logged at under ``"time"``. Thread-safe."""

    def __init__(self, path: str | Path) -> None:
        self._path = Path(path)
        self._lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        record: dict[str, Any] = {
            "event": type(event).__name__,
            "time": time.time(),
            **attrs.asdict(event),
        }
        line = json.dumps(record, sort_keys=True)
        with self._lock, self._path.open("a", encoding="utf-8") as out:
            out.write(line + "\n")
