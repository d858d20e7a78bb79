"""The training thread's side of a node: every ``step`` counts through the core learner rules,
captures a fragment when they publish it (a device-side copy; no I/O), and merges the commits
the learner loop delivered, at the step boundary (Decision 1: only the training thread writes
model parameters)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future

from gradientmail._events import Callback, Merged, Rebased
from gradientmail._node.drive import Inbox
from gradientmail._node.handoff import Handoff, Job, Ready
from gradientmail._node.release import WORTH_TRIMMING, release_memory_soon
from gradientmail._node.spill import Base, SpilledBase
from gradientmail.adapters.base import Adapter, Backend, Tensors
from gradientmail.core import learner
from gradientmail.core.effects import Captured, Leave, Merge, Publish
from gradientmail.core.effects import Rebased as Rebase
from gradientmail.core.records import Manifest
from gradientmail.core.rules import Rules

__all__ = ["RESERVE_BYTES", "Trainer"]

RESERVE_BYTES = WORTH_TRIMMING
"""A fragment of this many bytes or more has its capture's memory prepared off the training
thread (``_Reserved``); below it, fresh memory costs little and the allocator keeps it."""


class Trainer:
    """A node's training side over a joined run (``Node.join`` builds it)."""

    def __init__(
        self,
        *,
        adapter: Adapter,
        backend: Backend,
        manifest: Manifest,
        node: str,
        state: learner.LearnerState,
        base: Sequence[Base],
        handoff: Handoff,
        loop: Inbox,
        syncer: Inbox,
        on_event: Callback,
        rules: Rules,
    ) -> None:
        self.node = node
        self.algorithm = manifest.algorithm
        self.state = state
        self.rounds_seen = max(f.merged for f in state.fragments)
        self._adapter = adapter
        self._backend = backend
        self._manifest = manifest
        self._handoff = handoff
        self._loop = loop
        self._syncer = syncer
        self._on_event = on_event
        self._rules = rules
        self._base: list[Base] = list(base)
        self._captured: list[Tensors | None] = [None] * self.algorithm.fragments
        self.steps = 0  # inner steps counted by this process
        self._captured_at = [0] * self.algorithm.fragments
        self._calls = 0  # step() calls begun: the user trains between two
        self._captured_in = [0] * self.algorithm.fragments  # the call each capture was in
        self._final = [False] * self.algorithm.fragments  # captured once training ended
        self._reserved = _Reserved(backend, adapter)

    def advance(self, samples: int) -> None:
        """Apply ready commits, then count one inner step of ``samples`` tokens."""
        self._calls += 1
        self._apply_ready()
        self.steps += 1
        self.state, effects = learner.step(self.state, self.algorithm, samples)
        self._execute(effects, None)
        self._reserve_next()

    def blocked(self) -> learner.Blocked | None:
        """Apply ready commits; what ``step`` still waits for, or None."""
        self._apply_ready()
        return learner.waiting_on(self.state, self.algorithm)

    def close(self) -> None:
        """Publish what every fragment trained since its last snapshot (Decision 11)."""
        self._apply_ready()
        self.state, effects = learner.close(self.state, self.algorithm)
        self._execute(effects, None)

    @property
    def done(self) -> bool:
        """Closing, nothing in flight and nothing left to publish."""
        self._apply_ready()
        return learner.done(self.state)

    def outstanding(self) -> list[int]:
        return [f.outstanding for f in self.state.fragments if f.outstanding is not None]

    def _apply_ready(self) -> None:
        self._handoff.raise_failure()
        readies = self._handoff.take_ready()
        freed = sum(getattr(t, "nbytes", 0) for ready in readies for t in ready.tensors.values())
        for ready in readies:
            r = ready.commit.round
            included = learner.counted(
                self.state, self.algorithm, round=r, me=self.node, counted=ready.counted
            )
            self.state, effects = self._rules.on_commit(
                self.state, self.algorithm, round=r, included=included
            )
            self._execute(effects, ready)
        if freed >= WORTH_TRIMMING:
            # The commits' tensors, merged, are spent (and the captures they were merged
            # since): a thread of its own frees them and gives their pages back to the system
            # now, not at the next round's trim (they were allocated on the loops' threads).
            spent: list[object] = [readies]
            del ready, readies
            release_memory_soon(spent)

    def _execute(self, effects: Sequence[learner.Effect], ready: Ready | None) -> None:
        for effect in effects:
            if isinstance(effect, Merge):
                assert ready is not None
                self._merge(effect, ready)
            elif isinstance(effect, Rebase):
                self._handoff.drop_residual(effect.fragment)
                self._on_event(
                    Rebased(
                        node=self.node,
                        fragment=effect.fragment,
                        missed=effect.missed,
                        samples=effect.samples,
                    )
                )
            elif isinstance(effect, Leave):
                self._syncer.put(effect)
            else:
                self._capture(effect)

    def _merge(self, merge: Merge, ready: Ready) -> None:
        k, commit = merge.fragment, ready.tensors
        since = self._captured[k] if merge.since == "snapshot" else self._base[k]
        # With alpha the commit is mixed into the live parameters; ``since`` is not used.
        plain = merge.since == "snapshot" and merge.alpha is None
        if plain and (
            self._final[k] or (ready.difference is not None and self._calls == self._captured_in[k])
        ):
            # Merged in the step() call that captured (held at the bound), or after close()
            # with no step() since: nothing has trained since the capture (step() follows
            # every optimizer step), so the live parameters are the capture, and the merge is
            # the commit, bit for bit. (A capture close() made is spent on its delta: only
            # this merge is right for it, and no step() follows close().)
            self._backend.merge(self._adapter, commit, since=None, alpha=None)
        elif plain and ready.difference is not None:
            # commit - capture, computed by the learner loop in the capture's memory: one pass
            # over the live parameters here, not two.
            self._backend.shift(self._adapter, ready.difference)
        elif merge.alpha is not None:
            self._backend.merge(self._adapter, commit, since=None, alpha=merge.alpha)
        elif isinstance(since, SpilledBase):
            # A rebase onto a base kept in a file: one tensor of it in memory at a time.
            for name in commit:
                self._backend.merge(
                    self._adapter, {name: commit[name]}, since={name: since[name]}, alpha=None
                )
        else:
            self._backend.merge(self._adapter, commit, since=since, alpha=None)
        self._base[k] = ready.base if ready.base is not None else commit
        self._captured[k] = None
        self._final[k] = False
        self.rounds_seen = max(self.rounds_seen, merge.round)
        # Steps the commit overlapped: since this fragment's capture; none when it merges on
        # the base (a round this node's snapshot was not part of).
        staleness = self.steps - self._captured_at[k] if merge.since == "snapshot" else 0
        self._on_event(
            Merged(
                node=self.node,
                round=merge.round,
                fragment=k,
                since=merge.since,
                staleness=staleness,
                step=self.steps,
            )
        )

    def _reserve_next(self) -> None:
        """When the next step publishes a large fragment (``learner.next_publish``), prepare
        its capture's memory on another thread now: the capture then only copies."""
        forecast = learner.next_publish(self.state, self.algorithm)
        if forecast is None or forecast[0] != self.state.step + 1:
            return
        k = forecast[1]
        if self._manifest.fragment_schema(k).nbytes() >= RESERVE_BYTES:
            self._reserved.request(k, self._manifest.fragments[k])

    def _capture(self, publish: Publish) -> None:
        k = publish.fragment
        into = self._reserved.take(k)
        captured = self._backend.capture(self._adapter, self._manifest.fragments[k], into=into)
        del into
        # Once training has ended (close), the learner loop spends the capture on its delta
        # and the merge sets the commit: it is not kept here.
        final = self.state.closing
        self._captured[k] = None if final else captured
        self._final[k] = final
        self._captured_at[k] = self.steps
        self._captured_in[k] = self._calls
        nonce = self.state.fragments[k].nonce
        assert nonce is not None
        job = Job(publish=publish, nonce=nonce, base=self._base[k], captured=captured, final=final)
        del captured
        self._handoff.put_job(job)
        self._loop.put(Captured(round=publish.round, nonce=nonce))


class _Reserved:
    """The memory of one upcoming capture (``Backend.reserve``), made on a thread of its own
    while the training thread takes the step before it. Fresh memory costs its page faults
    (on a CPU, a 365 MB capture took 90 ms in fresh memory, 22 ms in touched memory); here
    they are paid off the training thread, and the memory is held one step at most."""

    def __init__(self, backend: Backend, adapter: Adapter) -> None:
        self._backend = backend
        self._adapter = adapter
        self._fragment: int | None = None
        self._made: Future[Tensors] | None = None

    def request(self, fragment: int, names: Sequence[str]) -> None:
        """Start reserving ``names`` for ``fragment``'s capture, dropping any other."""
        if self._fragment == fragment:
            return
        made: Future[Tensors] = Future()
        self._fragment, self._made = fragment, made

        def reserve() -> None:
            try:
                made.set_result(self._backend.reserve(self._adapter, names))
            except BaseException as exc:  # raised on the training thread by ``take``
                made.set_exception(exc)

        threading.Thread(target=reserve, name="gradientmail-reserve", daemon=True).start()

    def take(self, fragment: int) -> Tensors:
        """What was reserved for ``fragment`` (waiting for it to be made), or nothing when
        the reservation was for another fragment; either way the reservation is spent."""
        made, mine = self._made, self._fragment == fragment
        self._fragment, self._made = None, None
        if made is None or not mine:
            return {}
        return made.result()  # raises what ``reserve`` raised
