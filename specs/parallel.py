"""``explore`` on several cores: a breadth-first frontier shared among worker processes.

The search is level by level, as ``specs.explore``'s is, so every violation it reports has a
shortest trace, and a complete exploration reaches the same distinct states, generates the same
successors and reaches the same depth (a level may overshoot ``max_states``). Each worker (a
spawned process) holds its share of the frontier as worlds and expands it: it computes every
successor, its fingerprint and the graph's edge labels, checks each state new to it (the
invariants, deadlock, the healed schedule where the settings ask for it), and sends back
fingerprints, events and findings only. The coordinator (this process) keeps what ``explore``
keeps, the parent pointers and the graph, so traces and the fair-schedule check are the
sequential ones. A state that two workers reach in one level is kept by the first (in worker
order); the others drop it. Worlds move between workers only to even out their shares, since a
moved world loses the fingerprint encodings its worker had cached for its parts.

Every process keeps the set of fingerprints reached so far (16 bytes a state, several times
over in Python's sets), so memory grows with the workers.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import pickle
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from specs.config import Config
from specs.explore import (
    Finding,
    Result,
    Violation,
    begin,
    deadlock,
    finish,
    healed,
    heals_at,
    judge,
    labelled,
    resolve,
    without_gc,
)
from specs.fairness import settled
from specs.state import Event, World
from specs.view import fingerprint
from specs.world import successors

__all__ = ["explore_parallel"]

# One expanded state: its fingerprint, its edges (label, child), whether an event was cut by a
# bound, and what it broke (deadlock, the healed schedule at a bound).
Expanded = tuple[bytes, list[tuple[Event, bytes]], bool, Finding | None]
# One state new to the worker that reached it: fingerprint, parent, event, settled, finding.
Reached = tuple[bytes, bytes, Event, bool, Finding | None]


def explore_parallel(
    config: Config,
    *,
    workers: int,
    liveness: bool = True,
    settle: str = "bounds",
    max_states: int | None = None,
    progress: Callable[[int, int, int], None] | None = None,
) -> Result:
    """``specs.explore.explore`` with ``workers`` processes expanding the frontier (``settle``
    "bounds" or "none"; "all" runs in one process)."""
    if settle not in ("bounds", "none"):
        raise ValueError(f"settle={settle!r}: the parallel explorer runs 'bounds' or 'none'")
    if workers < 2:
        raise ValueError(f"workers={workers}: at least two (one runs specs.explore.explore)")
    started = time.perf_counter()
    # Spawned, not forked: a process with threads (a test session's worker pool) may not fork.
    context = multiprocessing.get_context("spawn")
    pipes: list[Connection] = []
    processes = []
    for _ in range(workers):
        here, there = context.Pipe()
        process = context.Process(
            target=_work, args=(there, config, liveness, settle == "bounds"), daemon=True
        )
        process.start()
        there.close()
        pipes.append(here)
        processes.append(process)
    try:
        with without_gc():
            return _coordinate(config, pipes, liveness, max_states, progress, started)
    finally:
        for pipe in pipes:
            with contextlib.suppress(OSError):
                pipe.send(("stop",))
        deadline = time.monotonic() + 5
        for process in processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()


def _coordinate(
    config: Config,
    pipes: list[Connection],
    liveness: bool,
    max_states: int | None,
    progress: Callable[[int, int, int], None] | None,
    started: float,
) -> Result:
    world, root, graph, parents = begin(config, liveness)
    deferred: list[Violation] = []
    violation = resolve(judge(world, False, {}), root, parents, deferred)
    for pipe in pipes:
        pipe.send(("visited", [root]))
    pipes[0].send(("take", [(root, world)]))
    shares = [1] + [0] * (len(pipes) - 1)
    generated = depth = 0
    report = 25_000
    while violation is None and sum(shares) > 0:
        if max_states is not None and len(parents) >= max_states:
            break
        for pipe, share in zip(pipes, shares, strict=True):
            if share:
                pipe.send(("expand",))
        results: list[tuple[int, list[Expanded], list[Reached]]] = [
            _receive(pipe) if share else (0, [], [])
            for pipe, share in zip(pipes, shares, strict=True)
        ]
        # What the level's states broke comes before what their successors break: a finding
        # at this depth has the shorter trace.
        for _, expanded, _ in results:
            for fp, _, _, finding in expanded:
                violation = violation or resolve(finding, fp, parents, deferred)
        kept: list[list[bytes]] = [[] for _ in pipes]
        for w, (count, _, reached) in enumerate(results):
            generated += count
            for child, parent, event, done, finding in reached:
                if child in parents:
                    continue
                parents[child] = (parent, event)
                if graph is not None:
                    graph.add(child, done)
                kept[w].append(child)
                violation = violation or resolve(finding, child, parents, deferred)
        for _, expanded, _ in results:
            for fp, edges, cut, _ in expanded:
                if graph is not None:
                    graph.expand(fp, edges, cut)
        new = [fp for share in kept for fp in share]
        if new:
            depth += 1
        shares = _balance(pipes, kept, new)
        if progress is not None and len(parents) >= report:
            progress(generated, len(parents), depth)
            report = (len(parents) // 25_000 + 1) * 25_000
    complete = sum(shares) == 0 and violation is None
    return finish(config, graph, parents, deferred, violation, complete, generated, depth, started)


def _receive(pipe: Connection) -> Any:
    message = pipe.recv()
    if isinstance(message, tuple) and message and message[0] == "error":
        raise RuntimeError(f"an explorer worker failed:\n{message[1]}")
    return message


def _balance(pipes: list[Connection], kept: list[list[bytes]], new: list[bytes]) -> list[int]:
    """Tell each worker the level's new states and which of its own it keeps; move worlds
    from the workers with the most to those with the fewest, so the shares differ by at most
    one. Returns each worker's share of the next level."""
    target = len(new) // len(pipes)
    extra = len(new) - target * len(pipes)
    wanted = [target + (w < extra) for w in range(len(pipes))]
    give: list[list[bytes]] = []
    for w, share in enumerate(kept):
        surplus = max(0, len(share) - wanted[w])
        give.append(share[len(share) - surplus :] if surplus else [])
    visited = pickle.dumps(("visited", new), protocol=pickle.HIGHEST_PROTOCOL)
    for pipe, share, out in zip(pipes, kept, give, strict=True):
        pipe.send_bytes(visited)  # pickled once: what ``send`` would send
        pipe.send(("level", share[: len(share) - len(out)], out))
    moving: list[tuple[bytes, World]] = []
    for pipe, out in zip(pipes, give, strict=True):
        if out:
            moving += _receive(pipe)
    shares = [len(share) - len(out) for share, out in zip(kept, give, strict=True)]
    for w, pipe in enumerate(pipes):
        need = wanted[w] - shares[w]
        if need > 0:
            pipe.send(("take", moving[:need]))
            moving = moving[need:]
            shares[w] += need
    assert not moving
    for pipe in pipes:  # a worker sends nothing unasked but its failure
        if pipe.poll():
            _receive(pipe)
            raise RuntimeError("an explorer worker sent what it was not asked for")
    return shares


def _work(pipe: Connection, config: Config, liveness: bool, at_bounds: bool) -> None:
    """A worker: expands its share of each level on ``expand``, keeps and hands over states on
    ``level``, takes states on ``take``, and ends on ``stop``."""
    visited: set[bytes] = set()
    frontier: list[tuple[bytes, World]] = []
    reached: dict[bytes, World] = {}
    memo: dict[bytes, bool] = {}
    try:
        with without_gc():
            _serve(pipe, visited, frontier, reached, memo, liveness, at_bounds)
    except Exception:  # the coordinator raises it, with the worker's traceback
        pipe.send(("error", traceback.format_exc()))


def _serve(
    pipe: Connection,
    visited: set[bytes],
    frontier: list[tuple[bytes, World]],
    reached: dict[bytes, World],
    memo: dict[bytes, bool],
    liveness: bool,
    at_bounds: bool,
) -> None:
    while True:
        message: Any = pipe.recv()
        kind = message[0]
        if kind == "stop":
            return
        if kind == "visited":
            visited.update(message[1])
        elif kind == "take":
            frontier.extend(message[1])
        elif kind == "expand":
            pipe.send(_expand(frontier, visited, reached, memo, liveness, at_bounds))
            frontier.clear()
        elif kind == "level":
            _, keep, give = message
            frontier[:] = [(fp, reached[fp]) for fp in keep]
            if give:
                pipe.send([(fp, reached[fp]) for fp in give])
            reached.clear()


def _expand(
    frontier: list[tuple[bytes, World]],
    visited: set[bytes],
    reached: dict[bytes, World],
    memo: dict[bytes, bool],
    liveness: bool,
    at_bounds: bool,
) -> tuple[int, list[Expanded], list[Reached]]:
    generated = 0
    expanded: list[Expanded] = []
    new: list[Reached] = []
    for fp, world in frontier:
        cut: list[Event] | None = [] if liveness else None
        steps = successors(world, cut=cut)
        finding = deadlock(world, steps)
        if finding is None and at_bounds and heals_at(world, cut):
            finding = healed(world, memo)
        edges: list[tuple[Event, bytes]] = []
        for event, after in steps:
            generated += 1
            child = fingerprint(after)
            edges.append((labelled(world, event), child))
            if child in visited or child in reached:
                continue
            reached[child] = after
            done = settled(after) if liveness else False
            new.append((child, fp, event, done, judge(after, False, memo)))
        expanded.append((fp, edges, bool(cut), finding))
    return generated, expanded, new
