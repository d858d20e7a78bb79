"""Liveness as a property of the explored graph: from every reachable state, on every fair
schedule once faults stop, every round a running node published commits.

``specs.liveness.settle`` follows one healed schedule from each state. This module checks them
all, on the graph ``specs.explore`` built (its states by fingerprint, and every enabled event
between them):

- **Healed edges**: the events that are no fault (a crash, a pause, a forgery, a create whose
  answer is lost or ambiguous). Only those are followed: the property is about what happens once
  faults stop, from any state faults led to.
- **Settled states**: no running node has a snapshot in flight (``outstanding``) in any
  fragment: whatever it published has committed (or been rebased) and merged. No node is
  still joining, and no node that began to close (``leave``) is still alive: its ``close``
  returned.
- **Open states**: not settled, and expanded with no event cut by the bounds. A state where an
  event would leave the explored bounds (a claim attempt past ``attempts``, training past the
  last round) may escape in a larger world, so it is not judged here (``settle`` runs the
  unbounded schedule from it).
- **Fairness** (strong, per node and loop): an event that is enabled infinitely often is taken
  infinitely often. The events it binds: each loop's ``step``, ``merge``, ``finish``,
  ``resume`` and ``tick`` (time passes only when no loop is due, so a fair schedule lets time
  pass), and the liveness assumptions about users: every node starts (``join`` of a node never
  started) and a running node trains on until it leaves or reaches the step bound (``train``;
  a quorum of two waits for the second node's snapshot). A restart of a crashed node
  (``join`` again), ``leave`` and clock drift are choices a schedule may skip: the survivors
  must commit without a crashed node coming back.

A violation is a set of open states from which a fair schedule never leaves: a terminal open
state (no healed step at all), or a strongly connected component of the open states whose every
bound event, enabled anywhere in it, is also taken inside it. An SCC that fails that test can
still hold a smaller one that passes it: the states where an untaken bound event is enabled are
removed and the rest searched again (Emerson and Lei's algorithm for strong fairness). Within a
component no round's commit can change (a commit and a merge are not undone), so a fair cycle
there is a round that never commits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

from specs.state import JOINING, Event, World

__all__ = ["BOUND", "RESTART", "Graph", "Stall", "settled"]

BOUND = frozenset({"step", "merge", "finish", "resume", "tick", "train", "join"})
"""Event kinds strong fairness binds (the rest are choices a schedule may skip), but for a
restart: a ``join`` labelled ``RESTART``."""
RESTART = "restart"
_FAULTS = frozenset({"crash", "pause", "forge"})

Label = tuple[str, int, str]


def _label(event: Event) -> Label:
    return (event.kind, event.node, event.loop)


def healed(event: Event) -> bool:
    """Whether ``event`` can happen once faults stop."""
    return event.kind not in _FAULTS and event.outcome == "ok"


def settled(world: World) -> bool:
    """No running node has a snapshot in flight (all it published committed and merged), no
    node is still joining, and no node that began to close is still alive (``Node.close``
    returns: Decision 11)."""
    return not any(
        node.status == JOINING
        or (node.leaving and node.alive)
        or (
            node.running
            and node.trainer is not None
            and any(f.outstanding is not None for f in node.trainer.fragments)
        )
        for node in world.nodes
    )


class Stall(NamedTuple):
    """A fair schedule that never settles: ``state`` (a fingerprint) is in it, and ``cycle``
    is a loop of healed events from ``state`` back to it (empty: no healed event at all)."""

    state: bytes
    cycle: tuple[Event, ...]


class Graph:
    """The explored states and their healed edges, built by ``specs.explore`` as it goes."""

    def __init__(self) -> None:
        self._index: dict[bytes, int] = {}
        self._fps: list[bytes] = []
        self._settled: list[bool] = []
        self._cut: list[bool] = []
        self._edges: list[list[tuple[int, int]]] = []
        self._labels: dict[Label, int] = {}
        self._label_list: list[Label] = []
        self.judged = 0
        """Open states the last ``stall`` judged."""

    def __len__(self) -> int:
        return len(self._fps)

    def add(self, fp: bytes, settled: bool) -> None:
        """A state reached (before it is expanded), and whether it is settled."""
        if fp not in self._index:
            self._index[fp] = len(self._fps)
            self._fps.append(fp)
            self._settled.append(settled)
            self._cut.append(False)
            self._edges.append([])

    def expand(self, fp: bytes, steps: Sequence[tuple[Event, bytes]], cut: bool) -> None:
        """The state ``fp``'s enabled events with the states they lead to (each added
        before); ``cut``: some event was left out because it would leave the bounds."""
        i = self._index[fp]
        self._cut[i] = cut
        edges = self._edges[i]
        for event, child in steps:
            if not healed(event):
                continue
            label = _label(event)
            code = self._labels.get(label)
            if code is None:
                code = self._labels[label] = len(self._label_list)
                self._label_list.append(label)
            edges.append((code, self._index[child]))

    def stall(self, depth: Callable[[bytes], int] | None = None) -> Stall | None:
        """A fair schedule of healed events that never settles, if there is one, from the
        state of its component that ``depth`` ranks first (the shallowest: the shortest
        trace to it)."""
        open_ = [not s and not c for s, c in zip(self._settled, self._cut, strict=True)]
        self.judged = sum(open_)
        for i, ok in enumerate(open_):
            if ok and not self._edges[i]:
                return Stall(self._fps[i], ())
        bound = {
            code
            for code, (kind, _, loop) in enumerate(self._label_list)
            if kind in BOUND and loop != RESTART
        }
        pending = [[i for i, ok in enumerate(open_) if ok]]
        while pending:
            members = pending.pop()
            for component in self._components(members):
                inside = set(component)
                taken = {code for i in component for code, j in self._edges[i] if j in inside}
                if not taken:
                    continue  # one state without a loop to itself: a schedule passes through
                unfair = [
                    i
                    for i in component
                    if any(code in bound and code not in taken for code, _ in self._edges[i])
                ]
                if not unfair:
                    if depth is not None:
                        first = min(component, key=lambda i: depth(self._fps[i]))
                        component = [first, *(i for i in component if i != first)]
                    return Stall(self._fps[component[0]], self._cycle(component))
                rest = inside - set(unfair)
                if rest:
                    pending.append(sorted(rest))
        return None

    def _components(self, members: list[int]) -> Iterator[list[int]]:
        """Tarjan's strongly connected components of the subgraph on ``members`` (iterative)."""
        inside = set(members)
        index: dict[int, int] = {}
        low: dict[int, int] = {}
        on_stack: set[int] = set()
        stack: list[int] = []
        counter = 0
        for root in members:
            if root in index:
                continue
            work = [(root, 0)]
            index[root] = low[root] = counter
            counter += 1
            stack.append(root)
            on_stack.add(root)
            while work:
                v, e = work[-1]
                edges = self._edges[v]
                while e < len(edges) and edges[e][1] not in inside:
                    e += 1
                if e < len(edges):
                    work[-1] = (v, e + 1)
                    w = edges[e][1]
                    if w not in index:
                        index[w] = low[w] = counter
                        counter += 1
                        stack.append(w)
                        on_stack.add(w)
                        work.append((w, 0))
                    elif w in on_stack:
                        low[v] = min(low[v], index[w])
                    continue
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    yield component

    def _cycle(self, component: list[int]) -> tuple[Event, ...]:
        """A loop of events inside ``component`` from its first state back to it, taking
        every event the component takes (a witness of the fair schedule)."""
        inside = set(component)
        start = here = component[0]
        wanted = {code for i in component for code, j in self._edges[i] if j in inside}
        path: list[int] = []
        while wanted:
            codes, here = self._shortest(here, inside, lambda code, w: code in wanted)
            path += codes
            wanted.difference_update(codes)
        if here != start:
            codes, here = self._shortest(here, inside, lambda code, w: w == start)
            path += codes
        return tuple(self._event(code) for code in path)

    def _shortest(
        self, here: int, inside: set[int], goal: Callable[[int, int], bool]
    ) -> tuple[list[int], int]:
        """The labels of a shortest path in ``inside`` from ``here`` whose last edge meets
        ``goal(label, state)``, and the state it ends in."""
        queue: list[tuple[int, list[int]]] = [(here, [])]
        seen = {here}
        while queue:
            nxt = []
            for v, path in queue:
                for code, w in self._edges[v]:
                    if w not in inside:
                        continue
                    if goal(code, w):
                        return [*path, code], w
                    if w not in seen:
                        seen.add(w)
                        nxt.append((w, [*path, code]))
            queue = nxt
        raise AssertionError("a strongly connected component reaches every state in it")

    def _event(self, code: int) -> Event:
        kind, node, loop = self._label_list[code]
        return Event(kind, node, loop=loop)
