"""The simulator's invariant checks, run at every commit, claim, merge and rebase as it happens
(from the writes that land in the mailbox and the nodes' events), and at the end of a run.

Ground truth is what only a simulator has: which incarnation wrote what, when each write landed
on the world clock, each node's clock rate. The checks are the design brief's invariants:

- a round commits at most once; a commit's base is the fragment's previous commit (an unbroken
  chain r, r+K, ...); it lists exactly snapshots that landed, unchanged, each counted once;
- its params are recomputed from the listed snapshots and the previous outer state with the
  run's backend and must match bit for bit;
- Decision 3: an observer calls a lease expired only after its listings showed it unchanged
  for lease_timeout on its own clock;
- a node merges only committed rounds, each fragment's in increasing order; it never rebases a
  snapshot the commit included; it never has more samples counted than it trained;
- Decision 11: a leaving node's lease says ``left`` only once each round it captured a
  snapshot for holds that snapshot or is committed (checked as the syncer makes the write;
  the republished progress of a missed round is the explorer's to check);
- Decision 2: attempt a+1 is claimed only ``takeover * 2**a`` seconds (claimer's clock) after
  attempt a's claim landed, or once its claimant could be seen expired: the claimer's own
  lease listings (recorded as they executed) showed that lease unchanged for lease_timeout.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import attrs

from gradientmail._node.exchange import Exchange
from gradientmail._node.payloads import outer_gradient, read_base, read_fragment
from gradientmail.adapters.base import Backend
from gradientmail.core import chain, closing, keys
from gradientmail.core.algorithm import DiLoCo
from gradientmail.core.envelope import unseal
from gradientmail.core.errors import FormatError
from gradientmail.core.records import Claim, Commit, Lease, Manifest, Snapshot, read_record
from gradientmail.mailboxes._memory import MemoryMailbox
from gradientmail.testing._virtual import NodeClock, Process, VirtualClock
from sim.sim_mailbox import run_now

__all__ = ["Checker", "Incarnation", "Violation"]


@attrs.frozen(kw_only=True)
class Violation:
    """An invariant broken at world time ``time`` (seconds); ``kind`` is a short stable name
    (shrinking keeps a run only while it shows the same kind)."""

    kind: str
    time: float
    message: str
    round: int | None = None
    nodes: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"[{self.kind}] t={self.time:.3f}s {self.message}"


@attrs.define(eq=False)
class Incarnation:
    """One process of node ``node`` (restarts get a new ``number``), as the world tracks it."""

    node: str
    number: int
    process: Process
    clock: NodeClock
    mailbox: Any = None
    model: Any = None
    session: Any = None
    status: str = "starting"
    trained: int = 0
    included: dict[int, int] = attrs.Factory(dict)
    merged: dict[int, int] = attrs.Factory(dict)
    snapshots: dict[int, Snapshot] = attrs.Factory(dict)
    publishing: dict[int, float] = attrs.Factory(dict)
    # per node: when each change of its lease was first listed, the version listed last, and
    # the highest counter of each process (nonce) among the lease records listed
    lease_seen: dict[str, list[float]] = attrs.Factory(dict)
    lease_last: dict[str, str] = attrs.Factory(dict)
    lease_highest: dict[str, dict[str, int]] = attrs.Factory(dict)
    claim_started: dict[str, float] = attrs.Factory(dict)
    join_floor: dict[int, int] = attrs.Factory(dict)
    left_written: bool = False  # its lease said ``left`` in a write it made
    republished: set[int] = attrs.Factory(set)  # rounds holding a missed round's progress
    crash_after_write: bool = False
    pause_after_write: bool = False

    @property
    def label(self) -> str:
        return f"{self.node}#{self.number}"

    @property
    def alive(self) -> bool:
        return self.process.alive


class Checker:
    """Checks one run; ``violations`` collects what it found, in order."""

    def __init__(
        self,
        *,
        algorithm: DiLoCo,
        backend: Backend,
        oracle: MemoryMailbox,
        clock: VirtualClock,
        lease_timeout: float,
        takeover: float,
        recompute: bool = True,
    ) -> None:
        self.algorithm = algorithm
        self.backend = backend
        self.exchange = Exchange(oracle, clock, node="checker")
        self.clock = clock
        self.lease_timeout = lease_timeout
        self.takeover = takeover
        self.recompute = recompute
        self.violations: list[Violation] = []
        self.commits: dict[int, Commit] = {}
        self.commit_times: dict[int, float] = {}
        self.snapshots: dict[tuple[int, str], tuple[Incarnation, Snapshot]] = {}
        self.counted: dict[tuple[str, str], int] = {}
        self.claims: dict[tuple[int, int], tuple[float, Claim]] = {}
        self.manifest: Manifest | None = None
        self.node_rounds = 0
        self.recomputed = 0

    def fail(
        self, kind: str, message: str, *, round: int | None = None, nodes: Sequence[str] = ()
    ) -> None:
        self.violations.append(
            Violation(
                kind=kind, time=self.clock.time, message=message, round=round, nodes=tuple(nodes)
            )
        )

    # -- writes -----------------------------------------------------------------------

    def leases_listed(self, inc: Incarnation, versions: dict[str, str]) -> None:
        """``inc``'s LIST of ``leases/`` executed now and showed ``versions`` (a lease record
        as ``nonce.counter.left``, or the listing's version of an object that is none). A
        renewal is a record ``inc`` has not seen before with a later counter of its process, or
        of a process not seen before: a replayed record renews nothing (``core.leases``)."""
        for node, version in versions.items():
            if inc.lease_last.get(node) == version:
                continue
            nonce, _, rest = version.partition(".")
            counter = rest.partition(".")[0]
            record = version.count(".") == 2 and counter.isdigit()
            highest = inc.lease_highest.setdefault(node, {})
            if record and highest.get(nonce, -1) >= int(counter):
                continue  # an older (or the same) record of a process it has seen
            inc.lease_seen.setdefault(node, []).append(self.clock.time)
            inc.lease_last[node] = version
            if record:
                highest[nonce] = int(counter)

    def landed(self, inc: Incarnation, key: str, data: bytes, before: bytes | None) -> None:
        """A write of ``inc`` changed ``key`` (``before``: what it held)."""
        if not key.startswith("rounds/") or not data:
            return
        parsed = keys.parse(key)
        if parsed.kind == "snapshot":
            record = read_record(unseal(data).record, Snapshot, key=key)
            assert parsed.round is not None and parsed.node is not None
            self.snapshots[(parsed.round, parsed.node)] = (inc, record)
            inc.snapshots[parsed.round] = record
        elif parsed.kind == "claim":
            claim = read_record(unseal(data).record, Claim, key=key)
            self.claims[(claim.round, claim.attempt)] = (self.clock.time, claim)
            self._check_takeover(inc, key, claim)
        elif parsed.kind == "commit":
            self._commit_landed(inc, key, data, before)

    def lease_issued(self, inc: Incarnation, key: str, data: bytes) -> None:
        """Decision 11, as ``inc`` writes the lease that first says it ``left`` (checked as the
        syncer makes the write, as it decided): each round it has a snapshot in flight for is
        committed or holds that snapshot, so a closer that sees the lease ``left`` finds it. (A
        missed round's progress published after this is not waited for.)"""
        lease = _lease(key, data)
        if lease is None or not lease.left or lease.node != inc.node or inc.left_written:
            return
        inc.left_written = True
        if inc.status == "failed":
            return  # the loops failed: Decision 11 lets the lease go with an upload in flight
        trainer = getattr(inc.session, "trainer", None)
        if trainer is None:
            return
        for fragment in trainer.state.fragments:
            r = fragment.outstanding
            if r is None or r in self.commits:
                continue
            if r in inc.republished:
                # The progress of a missed round, published again: the syncer may have decided
                # before it heard (its loops run beside the training side's); the explorer,
                # which runs them one at a time, checks these too.
                continue
            found = self.snapshots.get((r, inc.node))
            if found is None or found[0] is not inc or found[1].nonce != fragment.nonce:
                self.fail(
                    "left-before-upload",
                    f"{inc.label}'s lease says left before its snapshot of round {r} landed, "
                    "and the round is not committed",
                    round=r,
                    nodes=(inc.node,),
                )
                return

    def _commit_landed(self, inc: Incarnation, key: str, data: bytes, before: bytes | None) -> None:
        commit = read_record(unseal(data).record, Commit, key=key)
        r = commit.round
        if before is not None or r in self.commits:
            self.fail(
                "commit-twice",
                f"round {r} committed again, by {inc.label}",
                round=r,
                nodes=(inc.node,),
            )
            return
        self.commits[r] = commit
        self.commit_times[r] = self.clock.time
        for problem in chain.links(self.algorithm, [commit], self.commits.__contains__):
            self.fail("chain", problem, round=r)
        for i in commit.included:
            self._check_included(r, i.node, i.nonce, commit)
        if self.recompute:
            self._recompute(commit)

    def _check_included(self, r: int, node: str, nonce: str, commit: Commit) -> None:
        found = self.snapshots.get((r, node))
        listed = next(i for i in commit.included if i.node == node)
        if found is None:
            self.fail(
                "included",
                f"round {r} lists {node}'s snapshot, which never landed",
                round=r,
                nodes=(node,),
            )
            return
        writer, record = found
        if attrs.astuple(listed) != attrs.astuple(attrs.evolve(listed, **_fields(record))):
            self.fail(
                "included",
                f"round {r} lists {node}'s snapshot unlike the one that landed",
                round=r,
                nodes=(node,),
            )
        if (node, nonce) in self.counted:
            self.fail(
                "double-count",
                f"{node}'s snapshot {nonce} counted in rounds "
                f"{self.counted[(node, nonce)]} and {r}",
                round=r,
                nodes=(node,),
            )
        self.counted[(node, nonce)] = r
        k = commit.fragment
        writer.included[k] = writer.included.get(k, 0) + listed.samples
        self.node_rounds += 1
        if writer.included[k] > writer.trained:
            self.fail(
                "double-count",
                f"{writer.label} has {writer.included[k]} samples of "
                f"fragment {k} counted but trained {writer.trained}",
                round=r,
                nodes=(node,),
            )

    def _recompute(self, commit: Commit) -> None:
        """The committed params must be the outer step over exactly the listed snapshots."""
        manifest = self.manifest_record()
        backend, exchange = self.backend, self.exchange
        k = commit.fragment
        schema = manifest.fragment_schema(k)
        deltas = []
        for i in commit.included:
            found = run_now(exchange.node_snapshot(commit.round, i.node, limit=1 << 30))
            if found is None or found[0].nonce != i.nonce:
                return  # the planted overwrite can leave inputs that no longer match
            deltas.append(backend.decode(found[1], schema))
        base = commit.base_round
        before = self.commits[base] if base >= 0 else None
        state = run_now(read_base(exchange, backend, manifest, k, before))
        if state is None:
            return
        master, momentum = state
        weights, scale = closing.outer_sum(self.algorithm, commit.included)
        gradient = outer_gradient(backend, deltas, weights, scale)
        a = self.algorithm
        master, _ = backend.outer_step(
            master, momentum, gradient, lr=a.outer_lr, beta=a.outer_momentum, nesterov=a.nesterov
        )
        expected = backend.dump(backend.cast(master, schema))
        actual = run_now(read_fragment(exchange, commit.params, schema))
        self.recomputed += 1
        if actual is None or any(expected[n].data != actual[n].data for n in schema.names):
            self.fail(
                "params",
                f"round {commit.round}: params do not derive from the snapshots its record lists",
                round=commit.round,
                nodes=(commit.closer,),
            )

    def manifest_record(self) -> Manifest:
        if self.manifest is None:
            self.manifest = run_now(self.exchange.manifest())
            if self.manifest is None:
                raise FormatError("a commit landed before the manifest", key=keys.MANIFEST)
        return self.manifest

    def _check_takeover(self, claimer: Incarnation, key: str, claim: Claim) -> None:
        """Decision 2, from ground truth: see the module docstring."""
        if claim.attempt == 0:
            return
        previous = self.claims.get((claim.round, claim.attempt - 1))
        if previous is None:
            return  # the previous attempt's claim was never seen by anyone either
        seen_at, before = previous
        decided = claimer.claim_started.pop(key, self.clock.time)
        rate = claimer.clock.rate
        waited = (decided - seen_at) * rate
        if waited >= self.takeover * 2 ** (claim.attempt - 1) - 1e-6:
            return
        # The expiry path: the claimer's own lease listings up to its decision must have shown
        # the claimant's lease unchanged for lease_timeout (what a stale LIST hid, it could not
        # know; what it saw, it must not forget).
        times = claimer.lease_seen.get(before.node, [])
        i = bisect.bisect_right(times, decided)
        if i == 0:
            return  # never listed: unknown to the claimer, hence expired
        first_seen = times[i - 1]
        if (decided - first_seen) * rate >= self.lease_timeout - 1e-6:
            return
        self.fail(
            "takeover-early",
            f"{claimer.label} claimed attempt {claim.attempt} of round {claim.round} "
            f"{waited:.3f}s (its clock) after attempt {claim.attempt - 1}'s claim by "
            f"{before.node}, whose lease it had seen renewed {(decided - first_seen) * rate:.3f}s "
            f"before (lease_timeout {self.lease_timeout}, takeover {self.takeover})",
            round=claim.round,
            nodes=(claimer.node, before.node),
        )

    # -- events -----------------------------------------------------------------------

    def newest_rounds(self) -> tuple[int, ...]:
        """Each fragment's newest committed round now (-1: none), from ground truth."""
        newest = [-1] * self.algorithm.fragments
        for r in self.commits:
            k = r % self.algorithm.fragments
            newest[k] = max(newest[k], r)
        return tuple(newest)

    def joined(self, inc: Incarnation, rounds: tuple[int, ...]) -> None:
        """A join loads each fragment's newest commit: at least the newest that existed when
        its chain walk of the fragment began (it must not skip one)."""
        for k, got in enumerate(rounds):
            floor = inc.join_floor.get(k, -1)
            if got < floor:
                self.fail(
                    "join-newest",
                    f"{inc.label} joined holding round {got} of fragment {k}, but round "
                    f"{floor} was committed before its join began",
                    round=floor,
                    nodes=(inc.node,),
                )

    def lease_expired(self, observer: Incarnation, node: str) -> None:
        """Decision 3: ``observer`` may call ``node`` expired only once its own listings have
        shown that lease unchanged for lease_timeout (on its clock)."""
        times = observer.lease_seen.get(node, [])
        if not times:
            return
        seen_for = (self.clock.time - times[-1]) * observer.clock.rate
        if seen_for < self.lease_timeout - 1e-6:
            self.fail(
                "lease-expired-early",
                f"{observer.label} called {node} expired {seen_for:.3f}s (its clock) after its "
                f"listing showed that lease renewed (lease_timeout {self.lease_timeout})",
                nodes=(observer.node, node),
            )

    def merged(self, inc: Incarnation, round: int, fragment: int) -> None:
        if round not in self.commits:
            self.fail(
                "merge",
                f"{inc.label} merged round {round}, which has no commit",
                round=round,
                nodes=(inc.node,),
            )
        last = inc.merged.get(fragment, -1)
        if round <= last:
            self.fail(
                "merge",
                f"{inc.label} merged round {round} of fragment {fragment} after round {last}",
                round=round,
                nodes=(inc.node,),
            )
        inc.merged[fragment] = max(last, round)

    def rebased(self, inc: Incarnation, missed: int, samples: int) -> None:
        trainer = getattr(inc.session, "trainer", None)
        if trainer is not None:  # the round the missed progress goes to, if it went already
            again = trainer.state.fragments[missed % self.algorithm.fragments].outstanding
            if again is not None and again > missed:
                inc.republished.add(again)
        commit = self.commits.get(missed)
        if commit is None:
            self.fail(
                "rebase",
                f"{inc.label} rebased round {missed}, which has no commit",
                round=missed,
                nodes=(inc.node,),
            )
            return
        mine = inc.snapshots.get(missed)
        if mine is not None and commit.includes(inc.node, mine.nonce):
            self.fail(
                "rebased-included",
                f"{inc.label} rebased its snapshot of round {missed}, "
                "which the commit included: its samples count twice",
                round=missed,
                nodes=(inc.node,),
            )


def _fields(record: Snapshot) -> dict[str, Any]:
    return {
        "node": record.node,
        "nonce": record.nonce,
        "samples": record.samples,
        "steps": record.steps,
        "base_round": record.base_round,
        "digest": record.digest,
    }


def _lease(key: str, data: bytes | None) -> Lease | None:
    """The lease record ``data`` holds, None for none (or for what is no lease record)."""
    if not data:
        return None
    try:
        return read_record(unseal(data).record, Lease, key=key)
    except FormatError:
        return None
