"""A node's events as TensorBoard scalars: ``TensorBoardEvents``.

::

    from torch.utils.tensorboard import SummaryWriter
    from gradientmail.integrations.tensorboard import TensorBoardEvents

    writer = SummaryWriter("runs/node-0")            # the one the training loop logs loss to
    session = Session(model, ..., callbacks=(log_events, TensorBoardEvents(writer)))

The loss stays the user's (``writer.add_scalar("loss", ...)``); gradientmail adds, under
``gradientmail/``, at x = the node's inner step (its ``Session.step`` calls, as the newest
merge or stall said; events of the communication threads take the step last said):

- ``round``: the newest round merged; ``staleness_steps``: inner steps between a fragment's
  capture and its merge (the overlap a commit arrived with);
- ``stall_seconds``: each wait of ``step()`` on the overlap bound, and ``stall_seconds_total``;
- ``published_bytes_total`` and ``published_steps``: this node's snapshots;
- ``commit_seconds`` and ``commit_included``: the rounds this node closed;
- ``rebased_total``, ``retried_total``, ``rejected_total``, ``excluded_total``,
  ``lease_expired_total``: how often each happened.

Needs ``tensorboard`` (the ``tensorboard`` extra); ``torch.utils.tensorboard`` writes the files.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

from gradientmail._events import (
    Committed,
    Event,
    Excluded,
    LeaseExpired,
    Merged,
    Published,
    Rebased,
    Rejected,
    Retried,
    Stalled,
)

__all__ = ["TensorBoardEvents"]

_COUNTED = {
    Rebased: "rebased_total",
    Retried: "retried_total",
    Rejected: "rejected_total",
    Excluded: "excluded_total",
    LeaseExpired: "lease_expired_total",
}


class TensorBoardEvents:
    """A ``Session`` callback writing its events as scalars to a TensorBoard ``SummaryWriter``.

    Args:
        writer: a ``torch.utils.tensorboard.SummaryWriter``, or a log directory to open one
            in (closed by ``close``).
        prefix: the scalars' tag prefix.

    The x axis is the node's inner step as ``Merged`` and ``Stalled`` events carry it, so the
    curves line up with a loss the training loop logs by its step count. Thread-safe (events
    come from the training and the communication threads).
    """

    def __init__(self, writer: Any, *, prefix: str = "gradientmail") -> None:
        if isinstance(writer, (str, Path)):
            from torch.utils.tensorboard import SummaryWriter

            writer, self._owned = SummaryWriter(str(writer)), True
        else:
            self._owned = False
        self.writer = writer
        self._prefix = prefix
        self._lock = threading.Lock()
        self._step = 0
        self._counts: Counter[str] = Counter()
        self._published = 0
        self._stalled = 0.0

    def __call__(self, event: Event) -> None:
        with self._lock:
            if isinstance(event, (Merged, Stalled)):
                self._step = max(self._step, event.step)
            for tag, value in self._scalars(event):
                self.writer.add_scalar(f"{self._prefix}/{tag}", value, self._step)

    def _scalars(self, event: Event) -> list[tuple[str, float]]:
        if isinstance(event, Published):
            # A snapshot captured after ``steps`` more inner steps of its fragment.
            self._published += event.bytes
            return [("published_bytes_total", self._published), ("published_steps", event.steps)]
        if isinstance(event, Merged):
            return [("round", event.round), ("staleness_steps", event.staleness)]
        if isinstance(event, Stalled):
            self._stalled += event.seconds
            return [("stall_seconds", event.seconds), ("stall_seconds_total", self._stalled)]
        if isinstance(event, Committed):
            return [("commit_seconds", event.seconds), ("commit_included", event.included)]
        tag = _COUNTED.get(type(event))
        if tag is None:
            return []
        self._counts[tag] += 1
        return [(tag, self._counts[tag])]

    def close(self) -> None:
        """Flush, and close the writer if this callback opened it."""
        with self._lock:
            self.writer.flush()
            if self._owned:
                self.writer.close()
