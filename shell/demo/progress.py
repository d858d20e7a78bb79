"""The launcher's live view of its nodes, read from their progress files.

Each node appends JSON lines (``worker`` module); ``Follower`` reads what was appended since the
last look, and ``render`` turns the newest line of every node into one line of text.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

__all__ = ["Display", "Follower", "human_bytes", "render"]


def human_bytes(count: float) -> str:
    """``count`` bytes with a binary unit, e.g. ``'3.2 MiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


class Follower:
    """Reads a JSON-lines file as it grows; a partly written last line waits for its end."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        self._offset = 0
        self._partial = b""

    def poll(self) -> list[dict[str, Any]]:
        """The records appended since the previous call (none while the file does not exist)."""
        try:
            with self.path.open("rb") as file:
                file.seek(self._offset)
                chunk = file.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        new = [json.loads(line) for line in lines if line.strip()]
        self.records.extend(new)
        return new

    @property
    def latest(self) -> dict[str, Any] | None:
        return self.records[-1] if self.records else None


def _speed(records: Sequence[dict[str, Any]]) -> float:
    """Tokens per second over the last few progress lines."""
    if len(records) < 2:
        return 0.0
    first, last = records[max(0, len(records) - 6)], records[-1]
    seconds = last["time"] - first["time"]
    return (last["tokens"] - first["tokens"]) / seconds if seconds > 0 else 0.0


def render(name: str, records: Sequence[dict[str, Any]], *, steps: int, state: str) -> str:
    """One status line of a node: step, loss, tokens/s, newest round (of each fragment, when
    more than one), seconds ``step()`` stalled, bytes sent and received."""
    if not records:
        return f"{name:<8} {'starting' if state == 'running' else state}"
    last = records[-1]
    # The final record is the node's summary: held-out loss, no training loss.
    loss = next((r["loss"] for r in reversed(records) if "loss" in r), float("nan"))
    round_seen = last.get("rounds_seen", -1)
    fragments = last.get("fragments") or []
    rounds = "/".join(map(str, fragments)) if len(fragments) > 1 else None
    stalled = last.get("stalled")
    return (
        f"{name:<8} step {last['step']:>5}/{steps:<5} loss {loss:6.3f}  "
        f"{_speed(records):7.0f} tok/s  round {round_seen if round_seen >= 0 else '-':>4}  "
        + (f"(fragments {rounds})  " if rounds else "")
        + (f"stalled {stalled:6.1f} s  " if stalled is not None else "")
        + f"sent {human_bytes(last.get('bytes_out', 0)):>10}  "
        f"recv {human_bytes(last.get('bytes_in', 0)):>10}  {state}"
    )


class Display:
    """Rewrites a block of lines in place on a terminal; elsewhere prints it every ``every``
    calls, so a log file gets a snapshot every few seconds rather than one a second."""

    def __init__(self, stream: TextIO, *, tty: bool | None = None, every: int = 10) -> None:
        self._stream = stream
        self._tty = stream.isatty() if tty is None else tty
        self._every = every
        self._shown = 0
        self._calls = 0

    def show(self, lines: Sequence[str], *, force: bool = False) -> None:
        self._calls += 1
        if self._tty:
            # Move up over the previous block and clear each line before rewriting it; lines
            # are cut to the terminal's width, since a wrapped line would break the count, the
            # block to its height, and a shorter block is padded with cleared lines.
            columns, rows = shutil.get_terminal_size()
            width = columns - 1
            lines = list(lines)[: max(1, rows - 1)]
            lines += [""] * (self._shown - len(lines))
            up = f"\x1b[{self._shown}F" if self._shown else ""
            self._stream.write(up + "".join(f"\x1b[2K{line[:width]}\n" for line in lines))
            self._shown = len(lines)
        elif force or self._calls % self._every == 1:
            self._stream.write("".join(f"{line}\n" for line in lines))
        self._stream.flush()
