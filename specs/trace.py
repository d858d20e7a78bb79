"""Counterexamples in readable form: each step with what it did to the mailbox and the node."""

from __future__ import annotations

import re
from collections.abc import Sequence

from gradientmail.core.records import Commit, Lease
from specs.config import Config
from specs.mailbox import SnapObj
from specs.state import Event, World
from specs.world import apply, initial

__all__ = ["describe", "format_trace"]


def short(key: str) -> str:
    """A key with its round's zero padding dropped: ``rounds/3/snapshots/n1``."""
    return re.sub(r"rounds/0*(\d)", r"rounds/\1", key)


def describe(before: World, event: Event, after: World) -> str:
    """What ``event`` changed: mailbox writes and deletes, and the node's visible state."""
    notes = []
    old, new = dict(before.mailbox.items()), dict(after.mailbox.items())
    for key in sorted(set(old) | set(new)):
        was, now = old.get(key), new.get(key)
        if isinstance(was, Lease) and isinstance(now, Lease) and was.left == now.left:
            continue  # a renewal: not worth a line
        if key not in old:
            notes.append("+" + short(key) + _detail(new[key]))
        elif key not in new:
            notes.append("-" + short(key))
        elif old[key] != new[key]:
            notes.append("~" + short(key) + _detail(new[key]))
    if event.node >= 0:
        notes += _node_notes(before, after, event.node)
    notes += [
        f"FLAG {message}"
        for flag in after.flags
        if flag not in before.flags
        for message in flag[1:]
    ]
    return "; ".join(notes)


def _detail(obj: object) -> str:
    if isinstance(obj, SnapObj):
        return f" (samples {obj.lo}..{obj.hi - 1}, base {obj.record.base_round})"
    if isinstance(obj, Commit):
        inc = ", ".join(i.node for i in obj.included)
        return f" (by {obj.closer}#{obj.attempt}: {inc})"
    return ""


def _node_notes(before: World, after: World, i: int) -> list[str]:
    b, a = before.node(i), after.node(i)
    notes = []
    if a.status != b.status:
        notes.append(f"n{i} {a.status}")
    if a.trainer is not None and b.trainer is not None:
        for fb, fa in zip(b.trainer.fragments, a.trainer.fragments, strict=True):
            if fa.merged != fb.merged:
                notes.append(f"n{i} merged round {fa.merged}")
    for job in [j for j in a.jobs if j not in b.jobs]:
        notes.append(f"n{i} captures round {job.round} (samples {job.lo}..{job.hi - 1})")
    return notes


def format_trace(config: Config, events: Sequence[Event], tail: Sequence[Event] = ()) -> str:
    """The trace, one numbered step a line; ``tail`` (a healed schedule) follows, with its
    silent loop steps dropped and runs of ticks folded into one line."""
    lines: list[str] = []
    world = initial(config)
    ticks: list[int] = []

    def flush() -> None:
        if ticks:
            label = "tick" if len(ticks) == 1 else f"tick x{len(ticks)}"
            number = f"{ticks[0]}." if len(ticks) == 1 else f"{ticks[0]}-{ticks[-1]}."
            lines.append(f"  {number:>9} {label}")
            ticks.clear()

    for n, event in enumerate((*events, *tail), start=1):
        if n == len(events) + 1:
            flush()
            lines.append("  -- then faults heal, every node closes, and the fair schedule runs:")
        after = apply(world, event)
        what = describe(world, event, after)
        if event.kind == "tick":
            ticks.append(n)
        elif not (n > len(events) and event.kind == "step" and not what):
            flush()
            lines.append(f"  {n:>8}. {event!s:<22} {what}".rstrip())
        world = after
    flush()
    return "\n".join(_fold(lines, keep=len(events) + 1))


def _fold(lines: list[str], *, keep: int, head: int = 40, foot: int = 12) -> list[str]:
    """A long healed schedule (a livelock runs to the tick bound) keeps its start and end."""
    tail = lines[keep:]
    if len(tail) <= head + foot:
        return lines
    skipped = len(tail) - head - foot
    return [*lines[:keep], *tail[:head], f"  {'':>9} ... {skipped} lines ...", *tail[-foot:]]
