"""The learner: a node's training-thread side and its communication loop.

``advance`` and ``blocked`` run on the training thread: they apply ready commits at the step
boundary, count the step through the core rules, and capture a fragment's parameters when the
rules publish (a device-side copy; no I/O). ``run`` is the communication loop, a coroutine over
the node's clock: it encodes, quantizes, compresses and uploads what was captured, and polls the
next commit of each fragment with one GET, fetching and verifying its parameters before handing
them over. The only contact between the two is one lock-guarded handoff (Decision 1).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence

import attrs

from gradientmail.adapters.base import Adapter, Backend, Tensors
from gradientmail.clock import Bell, nap
from gradientmail.core import keys
from gradientmail.core import learner as rules
from gradientmail.core.algorithm import DiLoCo
from gradientmail.core.codecs import Compression, compress_parts
from gradientmail.core.envelope import payload_digest
from gradientmail.core.errors import FormatError, ProtocolError
from gradientmail.core.records import Commit, Manifest, Snapshot
from gradientmail.core.syncer import previous_round
from gradientmail.events import Callback, Merged, Published, Rebased, Rejected
from gradientmail.exchange import Exchange, new_nonce
from gradientmail.ledger import Ledger, OwnSnapshot
from gradientmail.run import newest_commit, read_fragment

__all__ = ["Learner"]


@attrs.frozen(kw_only=True)
class _Job:
    publish: rules.Publish
    nonce: str
    base: Tensors
    captured: Tensors


class Learner:
    """One node's learner over a joined run (``gradientmail.run.join`` builds it)."""

    def __init__(
        self,
        *,
        adapter: Adapter,
        backend: Backend,
        manifest: Manifest,
        exchange: Exchange,
        ledger: Ledger,
        node: str,
        merged: Sequence[Commit | None],
        base: Sequence[Tensors],
        compression: Compression,
        poll_interval: float,
        on_event: Callback,
        bell: Bell | None = None,
        uploaded: Callable[[], None] | None = None,
    ) -> None:
        self.node = node
        self.algorithm: DiLoCo = manifest.algorithm
        self._adapter = adapter
        self._backend = backend
        self._manifest = manifest
        self._exchange = exchange
        self._ledger = ledger
        self._compression = compression
        self._poll_interval = poll_interval
        self._on_event = on_event
        # Optional, for real time (Session): ``bell`` wakes the loop when a capture is queued,
        # ``uploaded`` tells the syncer a snapshot is out. Without them the loop just polls.
        self._bell = bell
        self._uploaded = uploaded
        K = self.algorithm.fragments
        rounds = tuple(c.round if c else -1 for c in merged)
        # Training-thread state.
        self._state = rules.join(self.algorithm, rounds)
        self._base = list(base)
        self._captured: list[Tensors | None] = [None] * K
        self._nonces: dict[int, str] = {}
        # The handoff, guarded by one lock.
        self._lock = threading.Condition()
        self._jobs: deque[_Job] = deque()
        # Commits to merge, with every (node, nonce) they and any commit skipped to reach them
        # counted: a node that jumps ahead must know whether its snapshot was counted.
        self._ready: deque[tuple[Commit, Tensors, frozenset[tuple[str, str]]]] = deque()
        self._drop_residual: set[int] = set()
        self._failure: BaseException | None = None
        self._stopping = False
        # Communication-loop state.
        self._next_poll = [rules.next_round(self.algorithm, k, r) for k, r in enumerate(rounds)]
        self._poll_due = [float("-inf")] * K  # clock time of each fragment's next GET
        self._residual: list[Tensors | None] = [None] * K
        self.rounds_seen = max(rounds)

    # -- training thread ----------------------------------------------------------------

    def advance(self, samples: int) -> None:
        """Apply ready commits, then count one inner step of ``samples`` tokens."""
        self._raise_failure()
        self._apply_ready()
        self._state, effects = rules.step(self._state, self.algorithm, samples)
        self._execute(effects, None)

    def blocked(self) -> rules.Blocked | None:
        """Apply ready commits; what ``step`` still waits for, or None."""
        self._raise_failure()
        self._apply_ready()
        return rules.waiting_on(self._state, self.algorithm)

    def wait(self, timeout: float) -> None:
        """Sleep the training thread until the loop hands something over, or ``timeout`` s."""
        with self._lock:
            if not self._ready and self._failure is None:
                self._lock.wait(timeout)

    def close(self) -> None:
        """Publish what every fragment trained since its last snapshot (Decision 11)."""
        self._raise_failure()
        self._apply_ready()
        self._state, effects = rules.close(self._state, self.algorithm)
        self._execute(effects, None)

    @property
    def done(self) -> bool:
        """Closing, nothing in flight and nothing left to publish."""
        self._raise_failure()
        self._apply_ready()
        return rules.done(self._state)

    def outstanding(self) -> list[int]:
        return [f.outstanding for f in self._state.fragments if f.outstanding is not None]

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _apply_ready(self) -> None:
        while True:
            with self._lock:
                if not self._ready:
                    return
                commit, tensors, counted = self._ready.popleft()
            k = commit.round % self.algorithm.fragments
            outstanding = self._state.fragments[k].outstanding
            nonce = self._nonces.get(outstanding) if outstanding is not None else None
            included = nonce is not None and (self.node, nonce) in counted
            if outstanding is not None and outstanding <= commit.round:
                self._nonces.pop(outstanding, None)
            self._state, effects = rules.on_commit(
                self._state, self.algorithm, round=commit.round, included=included
            )
            self._execute(effects, tensors)

    def _execute(self, effects: Sequence[rules.Effect], commit: Tensors | None) -> None:
        for effect in effects:
            if isinstance(effect, rules.Merge):
                assert commit is not None
                self._merge(effect, commit)
            elif isinstance(effect, rules.Rebased):
                with self._lock:
                    self._drop_residual.add(effect.fragment)
                self._on_event(
                    Rebased(
                        node=self.node,
                        fragment=effect.fragment,
                        missed=effect.missed,
                        samples=effect.samples,
                    )
                )
            else:
                self._capture(effect)

    def _merge(self, merge: rules.Merge, commit: Tensors) -> None:
        k = merge.fragment
        since = self._captured[k] if merge.since == "snapshot" else self._base[k]
        if merge.alpha is not None:
            since = None
        self._backend.merge(self._adapter, commit, since=since, alpha=merge.alpha)
        self._base[k] = commit
        self._captured[k] = None
        self.rounds_seen = max(self.rounds_seen, merge.round)
        self._on_event(Merged(node=self.node, round=merge.round, fragment=k, since=merge.since))

    def _capture(self, publish: rules.Publish) -> None:
        k = publish.fragment
        captured = self._backend.capture(self._adapter, self._manifest.fragments[k])
        self._captured[k] = captured
        nonce = new_nonce()
        self._nonces[publish.round] = nonce
        job = _Job(publish=publish, nonce=nonce, base=self._base[k], captured=captured)
        with self._lock:
            self._jobs.append(job)
            self._lock.notify_all()
        self.wake()

    # -- communication loop ---------------------------------------------------------------

    async def run(self) -> None:
        """Upload snapshots and poll commits until ``stop``; a failure is kept for ``step``."""
        try:
            while True:
                await self._upload()
                await self._poll()
                with self._lock:
                    if self._stopping and not self._jobs:
                        return
                await nap(self._exchange.clock, self._bell, self._poll_interval)
        except BaseException as exc:
            self.fail(exc)
            raise

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
        self.wake()

    def wake(self) -> None:
        """Cut the loop's poll sleep short (a commit may be waiting), where it has a bell."""
        if self._bell is not None:
            self._bell.ring()

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = exc
            self._lock.notify_all()

    async def _upload(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                for k in self._drop_residual:
                    self._residual[k] = None
                self._drop_residual.clear()
            await self._publish(job)

    async def _publish(self, job: _Job) -> None:
        publish, k = job.publish, job.publish.fragment
        self._backend.ready(job.captured)
        delta = self._backend.delta(job.base, job.captured, self._residual[k])
        payload, residual = self._backend.encode(delta, self.algorithm.quantization)
        if self.algorithm.quantization is not None:
            self._residual[k] = residual
        data = compress_parts(payload, self._compression)
        snapshot = Snapshot(
            node=self.node,
            nonce=job.nonce,
            round=publish.round,
            base_round=publish.base_round,
            samples=publish.samples,
            steps=publish.steps,
            digest=payload_digest(data),
        )
        ours = await self._exchange.publish(snapshot, data, self._compression, payload)
        exact = self.algorithm.quantization is None  # the payload holds the delta's F32 bytes
        own = OwnSnapshot(nonce=job.nonce, digest=snapshot.digest, delta=delta) if exact else None
        self._ledger.published(publish.round, own if ours else None)
        if self._uploaded is not None:
            self._uploaded()
        if not ours:
            self._on_event(
                Rejected(
                    node=self.node,
                    key=f"round {publish.round}",
                    reason="another incarnation's snapshot holds this node's key: round missed",
                )
            )
            return
        self._on_event(
            Published(
                node=self.node,
                round=publish.round,
                fragment=k,
                samples=publish.samples,
                steps=publish.steps,
                bytes=sum(len(part) for part in data),
            )
        )

    async def _poll(self) -> None:
        for k in range(self.algorithm.fragments):
            while await self._poll_fragment(k):
                pass

    async def _poll_fragment(self, k: int) -> bool:
        r = self._next_poll[k]
        known = self._ledger.commit(r)
        now = self._exchange.clock.now()
        if known is None:
            # Another node's commit is polled for once per interval (a bell that wakes the
            # loop sooner does not add GETs); one this node's syncer wrote or read is taken
            # from the ledger at once. The slack keeps a timer that fires a hair early on time.
            if now < self._poll_due[k] - self._poll_interval / 100:
                return False
            self._poll_due[k] = now + self._poll_interval
        try:
            found = await self._fetch(k, r, known)
        except ValueError as exc:
            # FormatError or SchemaMismatch: a corrupt, forged or replayed commit or params.
            # Reported and polled again later; never merged, never fatal to the loop.
            self._exchange.reject(getattr(exc, "key", None) or keys.commit(r), str(exc))
            return False
        if found is None:
            return False
        commit, tensors, counted = found
        self._ledger.committed(commit)
        with self._lock:
            self._ready.append((commit, tensors, counted))
            self._lock.notify_all()
        self._next_poll[k] = commit.round + self.algorithm.fragments
        if known is None:
            self._poll_due[k] = float("-inf")  # found in the store: a node catching up reads on
        return True

    async def _fetch(
        self, k: int, r: int, known: Commit | None = None
    ) -> tuple[Commit, Tensors, frozenset[tuple[str, str]]] | None:
        """Round ``r``'s commit of fragment ``k`` (``known``, or read from the store), its
        verified parameters and every snapshot it (and any commit skipped to reach it)
        counted; None when there is none yet."""
        commit = known or await self._exchange.commit(r)
        if commit is None:
            return None
        if commit.fragment != k or commit.base_round != previous_round(self.algorithm, r):
            reason = f"commit names fragment {commit.fragment}, base {commit.base_round}"
            raise FormatError(reason, key=keys.commit(r))
        counted = frozenset((i.node, i.nonce) for i in commit.included)
        # A commit this node wrote comes with its parameters as tensors: what loading them
        # from its payload would give.
        tensors = self._ledger.take_params(commit)
        if tensors is None:
            tensors = await self._load(commit)
        if tensors is None:
            # Collected before we read it: we are far behind. Jump to the newest commit,
            # remembering what this one counted (commit records are never deleted).
            newest = await newest_commit(self._exchange, self._manifest, k)
            if newest is None or newest.round <= r:
                raise ProtocolError(f"params of round {r} are gone and no newer commit exists")
            tensors = await self._load(newest)
            if tensors is None:
                return None  # collected again: try from the hint at the next poll
            # Every round of the fragment up to the newest is committed (each commit's base is
            # the one before): the syncer stops watching the skipped ones.
            self._ledger.committed(commit)
            for skipped in self._ledger.watched():
                if skipped % self.algorithm.fragments == k and skipped < newest.round:
                    self._ledger.unwatch(skipped)
            counted |= frozenset((i.node, i.nonce) for i in newest.included)
            commit = newest
        return commit, tensors, counted

    async def _load(self, commit: Commit) -> Tensors | None:
        schema = self._manifest.fragment_schema(commit.fragment)
        params = await read_fragment(self._exchange, commit.params, schema)
        if params is None:
            return None
        return self._backend.load(params)
