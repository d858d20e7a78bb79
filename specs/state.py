"""The values a world is made of: each node's core states, what its loops have to take in, its
training side, the mailbox, the clock, and the ghost state the invariants read.

Everything is immutable and ordered (named tuples, sorted tuples, the core's attrs frozen
states), so a world is a value: cheap to copy, comparable, and encodable byte for byte
(``specs.view``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from gradientmail.core.effects import Result
from gradientmail.core.learner import LearnerState
from gradientmail.core.records import Commit
from specs.config import Config
from specs.mailbox import Mailbox

__all__ = ["ABSENT", "DOWN", "GONE", "JOINING", "RUNNING", "Event", "Job", "Loop", "NodeState",
           "Ready", "World"]  # fmt: skip

ABSENT, JOINING, RUNNING, DOWN, GONE = "absent", "joining", "running", "down", "gone"
LOOPS = ("join", "learner", "syncer")


class Loop(NamedTuple):
    """One loop of a node, as ``gradientmail._node.drive`` runs it: its core ``state``, the
    view it takes in at its next call (``inbox``: results of its effects and messages of the
    node's other loops), the time (node's clock) its last step waits until (``wake``; inf:
    until something arrives), and whether it is done."""

    state: Any
    inbox: tuple[Result, ...] = ()
    wake: float = float("-inf")
    done: bool = False


class Job(NamedTuple):
    """A capture waiting for its upload: the round, its nonce, its base round, the samples
    ``lo .. hi - 1`` it covers and its inner steps."""

    round: int
    nonce: str
    base: int
    lo: int
    hi: int
    steps: int


class Ready(NamedTuple):
    """A commit the learner loop delivered, with what it (and any skipped commit) counted."""

    commit: Commit
    counted: frozenset[tuple[str, str]]


class NodeState(NamedTuple):
    """One node id: its process status and, while joining or running, that process's state.

    ``epoch`` counts the processes started under this id (its process nonce, ``specs.mailbox.
    nonce``); ``clock`` is its own clock (integer seconds). The loops ``join``, ``learner``
    and ``syncer``; the training side: ``trainer`` (the core learner state), ``produced``
    samples so far, ``jobs`` captured for upload, ``ready`` commits delivered and not merged;
    ``leaving`` once it began to close, ``finished`` once it told its loops to stop. Ghost
    state: ``floor``, each fragment's newest commit when its join began (``join-newest``);
    ``writes``, payload writes so far (nonces)."""

    status: str = ABSENT
    epoch: int = 0
    clock: int = 0
    paused: bool = False
    join: Loop | None = None
    learner: Loop | None = None
    syncer: Loop | None = None
    trainer: LearnerState | None = None
    produced: int = 0
    jobs: tuple[Job, ...] = ()
    ready: tuple[Ready, ...] = ()
    leaving: bool = False
    finished: bool = False
    floor: tuple[int, ...] = ()
    writes: int = 0

    @property
    def running(self) -> bool:
        return self.status == RUNNING

    @property
    def alive(self) -> bool:
        """Joining or running: it has loops."""
        return self.status in (JOINING, RUNNING)

    @property
    def active(self) -> bool:
        """Alive and not paused: it can take steps."""
        return self.alive and not self.paused

    def loop(self, name: str) -> Loop | None:
        found: Loop | None = getattr(self, name)
        return found

    def with_loop(self, name: str, loop: Loop) -> NodeState:
        """This node with its loop ``name`` replaced (``_replace``, without its keyword
        machinery: the explorer does this several times a step)."""
        fields = list(self)
        fields[_LOOP_FIELDS[name]] = loop
        return _new(NodeState, fields)


class Event(NamedTuple):
    """One atomic step of the world. ``loop``: which of a node's loops a ``step`` runs;
    ``samples``: the inner steps a ``train`` makes, or the round whose next commit key (or,
    with ``node``, that node's next snapshot key; -1: the next manifest key) a ``forge``
    squats; ``outcome`` of the first create in a step: "ok", "lost" (did not land: the retry
    goes on) or "ambiguous" (landed, and the answer was lost); "ambiguous@commit" and the like
    fault only the first create of that kind of record."""

    kind: str
    node: int = -1
    loop: str = ""
    outcome: str = "ok"
    samples: int = 1

    def __str__(self) -> str:
        if self.kind == "forge":
            if self.samples < 0:
                return "forger squats the next manifest key"
            if self.node >= 0:
                return f"forger squats n{self.node}'s next snapshot key of round {self.samples}"
            return f"forger squats round {self.samples}'s next commit key"
        who = f"n{self.node} " if self.node >= 0 else ""
        what = self.kind if not self.loop else f"{self.loop}"
        if self.kind == "train" and self.samples != 1:
            what += f" ({self.samples} samples)"
        if self.outcome != "ok":
            what += f" [{self.outcome}]"
        return who + what


class World(NamedTuple):
    """The whole system: configuration, virtual time, nodes, mailbox, fault budgets and ghost
    state. ``commit_writes`` counts, per round, the writes that made a commit record;
    ``spans`` maps each snapshot nonce to its writer, incarnation and samples; ``flags`` are
    the transition invariants that failed, as ``(name, message)``."""

    config: Config
    time: int
    nodes: tuple[NodeState, ...]
    mailbox: Mailbox
    crashes: int = 0
    faults: int = 0
    pauses: int = 0
    forgeries: int = 0
    commit_writes: tuple[tuple[int, int], ...] = ()
    spans: tuple[tuple[str, tuple[str, int, int, int]], ...] = ()
    flags: tuple[tuple[str, str], ...] = ()

    def node(self, i: int) -> NodeState:
        return self.nodes[i]

    def with_node(self, i: int, node: NodeState) -> World:
        nodes = self.nodes
        return _new(World, (self.config, self.time, (*nodes[:i], node, *nodes[i + 1 :]), *self[3:]))

    def flag(self, name: str, message: str) -> World:
        """Record that the transition invariant ``name`` failed, saying how."""
        if (name, message) in self.flags:
            return self
        return self._replace(flags=(*self.flags, (name, message)))

    def wrote_commit(self, r: int) -> World:
        counts = dict(self.commit_writes)
        counts[r] = counts.get(r, 0) + 1
        return self._replace(commit_writes=tuple(sorted(counts.items())))


_new = tuple.__new__
_LOOP_FIELDS = {name: NodeState._fields.index(name) for name in LOOPS}
assert World._fields[:3] == ("config", "time", "nodes")
