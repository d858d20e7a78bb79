"""The values a world is made of: nodes' rule states, their volatile work, the mailbox, the clock.

Everything is immutable and ordered (named tuples, sorted tuples, attrs frozen core states), so
a world is a value: cheap to copy, comparable, and encodable byte for byte (``specs.view``).
"""

from __future__ import annotations

from typing import NamedTuple

from gradientmail.core.learner import LearnerState
from gradientmail.core.leases import Leases
from gradientmail.core.syncer import RoundWatch
from specs.config import Config
from specs.mailbox import CommitObj, Inc, Mailbox

__all__ = ["Event", "Job", "NodeState", "Work", "World"]

ABSENT, RUNNING, DOWN, GONE = "absent", "running", "down", "gone"


class Job(NamedTuple):
    """A captured snapshot waiting for upload (the learner's job queue). ``retried``: an earlier
    create of it failed with a transient error, so a taken key must be read back."""

    round: int
    base: int
    lo: int
    hi: int
    steps: int
    retried: bool = False


class Work(NamedTuple):
    """A closer's won claim with the snapshots it read, not yet committed (volatile)."""

    round: int
    attempt: int
    included: tuple[Inc, ...]
    retried: bool = False


class NodeState(NamedTuple):
    """One node id: its process status and, while running, that process's state.

    ``epoch`` counts the processes started under this id (its nonce). The learner side:
    ``learner`` (core rules), ``produced`` samples so far, ``jobs`` to upload, ``captured``
    rounds it holds a snapshot nonce for, ``ready`` commits read but not merged, ``next_poll``
    per fragment. Shared ledger: ``watched`` rounds, ``known`` commits as (round, included
    nodes). The syncer side: ``leases`` view, lease ``counter``, ``leaving``, per-round
    ``watches`` and cached ``views`` (reporters), and ``work`` of a won claim. ``synced``: its
    syncer made its pass of this tick; ``paused``: the whole process is frozen.
    """

    status: str = ABSENT
    epoch: int = 0
    clock: int = 0
    learner: LearnerState | None = None
    produced: int = 0
    jobs: tuple[Job, ...] = ()
    captured: tuple[int, ...] = ()
    ready: tuple[CommitObj, ...] = ()
    next_poll: tuple[int, ...] = ()
    watched: tuple[int, ...] = ()
    known: tuple[tuple[int, tuple[str, ...]], ...] = ()
    leases: Leases = Leases()
    counter: int = 0
    leaving: bool = False
    watches: tuple[RoundWatch, ...] = ()
    views: tuple[tuple[int, tuple[str, ...]], ...] = ()
    work: Work | None = None
    synced: bool = False
    paused: bool = False

    @property
    def running(self) -> bool:
        return self.status == RUNNING

    @property
    def active(self) -> bool:
        """Running and not paused: it can take steps."""
        return self.status == RUNNING and not self.paused

    def known_commit(self, r: int) -> tuple[str, ...] | None:
        for round_, nodes in self.known:
            if round_ == r:
                return nodes
        return None

    def watch(self, r: int) -> RoundWatch | None:
        for w in self.watches:
            if w.round == r:
                return w
        return None

    def view_of(self, r: int) -> tuple[str, ...] | None:
        for round_, reporters in self.views:
            if round_ == r:
                return reporters
        return None


class Event(NamedTuple):
    """One atomic step of the world. ``outcome`` of a write: "ok", "lost" (did not land, the
    writer was told it failed) or "ambiguous" (landed, the writer was told it failed)."""

    kind: str
    node: int = -1
    round: int = -1
    outcome: str = "ok"
    samples: int = 1

    def __str__(self) -> str:
        who = f"n{self.node} " if self.node >= 0 else ""
        what = self.kind
        if self.round >= 0:
            what += f" round {self.round}"
        if self.kind == "train" and self.samples != 1:
            what += f" ({self.samples} samples)"
        if self.outcome != "ok":
            what += f" [{self.outcome}]"
        return who + what


class World(NamedTuple):
    """The whole system: configuration, virtual time, nodes, mailbox and fault budgets.

    ``commit_writes`` counts, per round, the writes that made a commit record (history kept
    only to check that a round commits once); ``flags`` are transition invariants that failed
    (a rebase of an included snapshot, a merge of an older commit).
    """

    config: Config
    time: int
    nodes: tuple[NodeState, ...]
    mailbox: Mailbox
    crashes: int = 0
    faults: int = 0
    pauses: int = 0
    commit_writes: tuple[tuple[int, int], ...] = ()
    flags: tuple[str, ...] = ()

    def node(self, i: int) -> NodeState:
        return self.nodes[i]

    def with_node(self, i: int, node: NodeState) -> World:
        nodes = (*self.nodes[:i], node, *self.nodes[i + 1 :])
        return self._replace(nodes=nodes)

    def flag(self, message: str) -> World:
        if message in self.flags:
            return self
        return self._replace(flags=(*self.flags, message))

    def wrote_commit(self, r: int) -> World:
        counts = dict(self.commit_writes)
        counts[r] = counts.get(r, 0) + 1
        return self._replace(commit_writes=tuple(sorted(counts.items())))
