"""What a node's threads hand each other: the training thread's captures and merges (the one
lock-guarded handoff of Decision 1), and the tensors its two loops pass along so that a node
never reads back from the store what it has just computed.
"""

from __future__ import annotations

import threading
from collections import deque

import attrs

from gradientmail._clock import Bell
from gradientmail._node.spill import Base, SpilledBase
from gradientmail.adapters.base import Tensors
from gradientmail.core.effects import Publish
from gradientmail.core.records import Commit, Snapshot

__all__ = ["Handoff", "Handover", "Job", "OwnSnapshot", "Ready"]

WINDOW = 64
"""Rounds of handed-over parameters kept behind the newest (``syncer.COMMIT_WINDOW``)."""


@attrs.frozen(kw_only=True, eq=False)
class Job:
    """A capture to upload: the effect, its snapshot's nonce, the base the delta is measured
    from, the copy."""

    publish: Publish
    nonce: str
    base: Base
    captured: Tensors
    final: bool = False
    """Captured once training had ended (``close``): its commit is merged with nothing
    trained since, so it sets the commit and needs no ``commit - capture``, and the delta
    may be computed in the capture's memory."""


@attrs.frozen(kw_only=True, eq=False)
class Ready:
    """A commit to merge at the next step boundary, its parameters, every ``(node, nonce)``
    it, or a commit skipped to reach it, counted, and its parameters as the next base."""

    commit: Commit
    tensors: Tensors
    counted: frozenset[tuple[str, str]]
    base: SpilledBase | None = None
    """The commit's parameters as the fragment's next base, when the node keeps its base in a
    file (``spill``): written there on the learner loop's thread, so the training thread only
    swaps which file it points to."""
    difference: Tensors | None = None
    """``commit - capture`` (``Backend.difference``, in the capture's memory) when the commit
    is of the round this node's capture was uploaded for and the merge mixes no ``alpha``:
    a merge since the snapshot adds it (``Backend.shift``). The capture itself is spent."""


class Handoff:
    """The training thread's side of a node: captures out to the learner loop, ready commits
    in, residuals to drop, and a failure of a loop that ``step`` raises. ``bell`` wakes the
    training thread when something comes in."""

    def __init__(self, bell: Bell) -> None:
        self.bell = bell
        self._lock = threading.Lock()
        self._jobs: dict[int, Job] = {}
        self._ready: deque[Ready] = deque()
        self._drop: set[int] = set()
        self._failure: BaseException | None = None

    def put_job(self, job: Job) -> None:
        with self._lock:
            self._jobs[job.publish.round] = job

    def take_job(self, r: int) -> tuple[Job | None, set[int]]:
        """The capture of round ``r``, and the fragments whose residual to drop first."""
        with self._lock:
            drop, self._drop = self._drop, set()
            return self._jobs.pop(r, None), drop

    def drop_residual(self, fragment: int) -> None:
        with self._lock:
            self._drop.add(fragment)

    def deliver(self, ready: Ready) -> None:
        with self._lock:
            self._ready.append(ready)
        self.bell.ring()

    def take_ready(self) -> list[Ready]:
        with self._lock:
            ready = list(self._ready)
            self._ready.clear()
        return ready

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = exc
        self.bell.ring()

    def raise_failure(self) -> None:
        with self._lock:
            failure = self._failure
        if failure is not None:
            raise failure


@attrs.frozen(kw_only=True, eq=False)
class OwnSnapshot:
    """This node's snapshot of a round as its learner published it: the ``record``, the
    ``key`` it was created at (create-only: the object there is this one), and the F32
    ``delta`` that decoding the payload gives back (an unquantized payload holds exactly its
    bytes)."""

    record: Snapshot
    key: str
    delta: Tensors


class Handover:
    """Tensors the learner loop and the syncer pass along, each the very tensors reading the
    store would give: this node's own unquantized snapshots (for its closer), the parameters
    of the commits its closer wrote (for its learner, once), and the newest commit's
    parameters of each fragment as the learner keeps them in a file (for its closer: the F32
    master an outer step starts from)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._own: dict[int, OwnSnapshot] = {}
        self._params: dict[int, tuple[str, Tensors]] = {}
        self._bases: dict[int, tuple[Commit | None, SpilledBase]] = {}

    def put_own(self, r: int, own: OwnSnapshot) -> None:
        with self._lock:
            self._own[r] = own

    def own(self, r: int) -> OwnSnapshot | None:
        with self._lock:
            return self._own.get(r)

    def drop_own(self, r: int) -> None:
        with self._lock:
            self._own.pop(r, None)

    def put_params(self, commit: Commit, tensors: Tensors) -> None:
        with self._lock:
            self._params[commit.round] = (commit.nonce, tensors)
            # A learner that skipped ahead never takes older ones: keep a bounded window.
            for old in [r for r in self._params if r < commit.round - WINDOW]:
                del self._params[old]

    def drop_params(self, r: int, nonce: str) -> None:
        """Forget the parameters handed over for round ``r`` under ``nonce`` (a lost race)."""
        with self._lock:
            held = self._params.get(r)
            if held is not None and held[0] == nonce:
                del self._params[r]

    def put_base(self, fragment: int, commit: Commit | None, base: SpilledBase) -> None:
        """``commit``'s parameters of ``fragment`` in a file (``spill``; None: the run's initial
        parameters), replacing an older commit's (whose file closes once no one else holds
        it)."""
        with self._lock:
            held = self._bases.get(fragment)
            if held is None or _round(held[0]) <= _round(commit):
                self._bases[fragment] = (commit, base)

    def base(self, fragment: int, commit: Commit | None) -> SpilledBase | None:
        """The file of ``commit``'s parameters of ``fragment`` (same round and nonce; None: the
        initial parameters), if held."""
        with self._lock:
            held = self._bases.get(fragment)
        if held is None or _identity(held[0]) != _identity(commit):
            return None
        return held[1]

    def take_params(self, commit: Commit) -> Tensors | None:
        """The parameters handed over with ``commit`` (same round and nonce), once."""
        with self._lock:
            held = self._params.get(commit.round)
            if held is None or held[0] != commit.nonce:
                return None
            del self._params[commit.round]
            return held[1]


def _round(commit: Commit | None) -> int:
    return -1 if commit is None else commit.round


def _identity(commit: Commit | None) -> tuple[int, str] | None:
    return None if commit is None else (commit.round, commit.nonce)
