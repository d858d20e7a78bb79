"""Worker processes of the demo and the benchmark: start them, watch their progress, stop them.

Also the directory rules both share: a directory is wiped only when an earlier demo made it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import unquote, urlsplit

import attrs

from gradientmail.demo.progress import Display, Follower, render
from gradientmail.demo.worker import node_name

__all__ = [
    "MARKER",
    "DemoError",
    "Job",
    "Node",
    "allreduce_bytes",
    "local_path",
    "prepare_directory",
    "run_nodes",
]

MARKER = "~gradientmail-demo"
"""Marks a directory the demo created, so a later demo may wipe it. ``~`` is outside the
mailbox key charset, so mailboxes skip the file."""

WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


class DemoError(Exception):
    """A demo that cannot start or did not finish; the message is one line for the user."""


def allreduce_bytes(parameters: int, nodes: int, steps: int, *, itemsize: int = 4) -> int:
    """Bytes one node sends in ``steps`` ring all-reduces of F32 gradients (and receives as
    many): ``2 (N-1)/N * parameters * itemsize`` per step."""
    return round(2 * (nodes - 1) / nodes * parameters * itemsize * steps)


def prepare_directory(path: Path) -> None:
    """Create ``path`` empty, wiping it first only if an earlier demo made it (``MARKER``)."""
    if path.exists() and not path.is_dir():
        raise DemoError(f"{path} exists and is not a directory")
    if path.exists() and any(path.iterdir()):
        if not (path / MARKER).exists():
            raise DemoError(
                f"refusing to wipe {path}: it is not empty and no earlier demo made it; "
                "choose another --mailbox/--out or empty it"
            )
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / MARKER).write_text("made by `gradientmail demo`; the next demo may wipe it\n")


def local_path(url: str) -> Path | None:
    """The directory a ``file://`` URL or a plain path names; ``None`` for other stores."""
    if "://" not in url:
        return Path(url).resolve()
    parts = urlsplit(url)
    if parts.scheme == "memory":
        raise DemoError("memory:// mailboxes live in one process; the demo runs one per node")
    return Path(unquote(parts.path)).resolve() if parts.scheme == "file" else None


@attrs.frozen(kw_only=True)
class Job:
    """One worker process to run: its label on screen, node index, options and steps, and
    the module it runs (the demo worker, or ``gradientmail.demo.reference``)."""

    label: str
    node: int
    argv: tuple[str, ...]
    out: Path
    steps: int
    module: str = "gradientmail.demo.worker"


@attrs.define(kw_only=True)
class Node:
    """A running worker process, its log file and its progress file."""

    job: Job
    process: subprocess.Popen[bytes]
    log: Path
    progress: Follower

    def last_log_line(self) -> str:
        lines = self.log.read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else "(no output)"

    def state(self) -> str:
        code = self.process.poll()
        return "running" if code is None else ("done" if code == 0 else f"failed ({code})")


def _start(job: Job) -> Node:
    name = node_name(job.node)
    log = job.out / f"{name}.log"
    argv = ["--node", str(job.node), "--out", str(job.out), *job.argv]
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", job.module, *argv],
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **WORKER_ENV},
        )
    progress = Follower(job.out / f"progress-{name}.jsonl")
    return Node(job=job, process=process, log=log, progress=progress)


def _stop(nodes: Sequence[Node]) -> None:
    for node in nodes:
        if node.process.poll() is None:
            node.process.terminate()
    for node in nodes:
        try:
            node.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            node.process.kill()
            node.process.wait()


def run_nodes(
    jobs: Sequence[Job], *, stream: TextIO, refresh: float = 1.0, every: int = 10
) -> dict[str, list[dict[str, Any]]]:
    """Run one worker process per job until all exit, showing their progress on ``stream``.

    Returns every job's progress records by label. A worker that fails stops the others and
    raises ``DemoError`` with the last line of its log. Off a terminal, the progress is printed
    every ``every`` refreshes.
    """
    nodes = [_start(job) for job in jobs]
    display = Display(stream, every=every)
    # A plain SIGTERM would end this process without stopping its workers; exiting runs the
    # ``finally`` below instead.
    previous = _on_sigterm(lambda *_: sys.exit(143))
    try:
        while True:
            for node in nodes:
                node.progress.poll()
            failed = [n for n in nodes if n.process.poll() not in (None, 0)]
            finished = all(n.process.poll() is not None for n in nodes)
            display.show(
                [
                    render(n.job.label, n.progress.records, steps=n.job.steps, state=n.state())
                    for n in nodes
                ],
                force=finished or bool(failed),
            )
            if failed:
                node = failed[0]
                raise DemoError(
                    f"{node.job.label} failed (exit {node.process.returncode}): "
                    f"{node.last_log_line()} (log: {node.log})"
                )
            if finished:
                return {n.job.label: n.progress.records for n in nodes}
            time.sleep(refresh)
    finally:
        _stop(nodes)
        _on_sigterm(previous)


def _on_sigterm(handler: Any) -> Any:
    """Install ``handler`` for SIGTERM when this is the main thread; returns the previous one."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, handler) if handler is not None else None
