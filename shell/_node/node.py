"""A node: its training side, learner loop and syncer loop over one mailbox, clock and nonce
source, without threads. ``Session`` hosts the loops on threads and drives ``step`` and
``close`` from the training thread; the simulator runs the very same coroutines on virtual
time, with only the clock, the mailbox and the nonce source swapped."""

from __future__ import annotations

import math
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from gradientmail._clock import Clock
from gradientmail._events import Callback, Failed, Joined, Stalled, log_events
from gradientmail._node import spill
from gradientmail._node.drive import Inbox
from gradientmail._node.exchange import DEFAULT_OUTAGE, Exchange, new_nonce
from gradientmail._node.handoff import Handoff, Handover
from gradientmail._node.joining import Joiner
from gradientmail._node.learner import LearnerLoop
from gradientmail._node.release import release_memory
from gradientmail._node.syncer import SyncerLoop
from gradientmail._node.training import Trainer
from gradientmail.adapters import Adapter, Backend, backend_for, default_backend
from gradientmail.adapters.base import Tensors
from gradientmail.core import gc, join, keys, leases, polling, syncer
from gradientmail.core.algorithm import DiLoCo
from gradientmail.core.codecs import Compression
from gradientmail.core.effects import Gather, Hurry, Stop
from gradientmail.core.errors import ProtocolError
from gradientmail.core.join import JoinState
from gradientmail.core.robust import DEFAULT_OUTLIER_FACTOR
from gradientmail.core.rules import RULES, Rules
from gradientmail.core.signing import Keyring
from gradientmail.mailboxes._protocol import Mailbox

__all__ = ["Node", "adapter_of"]

BARRIER_LOOK = 0.05
"""Seconds between looks at the lease view while ``wait_for_nodes`` waits (no request)."""


def adapter_of(model: object, backend: Backend | None) -> Adapter:
    if isinstance(model, Adapter):
        return model
    return (backend or backend_for(model)).adapter(model)


class Node:
    """One node of a run (``Session``'s parameters, plus what a simulator swaps: ``clock``,
    ``nonces`` (the source of every random nonce the node draws) and ``rules``, the protocol's
    rule functions, which a planted bug replaces)."""

    def __init__(
        self,
        model: object,
        *,
        algorithm: DiLoCo,
        mailbox: Mailbox,
        clock: Clock,
        learner_id: str,
        backend: Backend | None = None,
        compression: Compression = "off",
        poll_interval: float = 1.0,
        lease_every: float = 50.0,
        lease_timeout: float = 120.0,
        takeover: float | None = None,
        on_event: Callback = log_events,
        fragment_mapping: Mapping[str, int] | None = None,
        keep_rounds: int | None = gc.DEFAULT_KEEP,
        gc_horizon: float = gc.DEFAULT_HORIZON,
        keyring: Keyring | None = None,
        outlier_factor: float | None = DEFAULT_OUTLIER_FACTOR,
        outage_timeout: float = DEFAULT_OUTAGE,
        spill_base: bool | None = None,
        spill_dir: str | None = None,
        nonces: Callable[[], str] = new_nonce,
        rules: Rules = RULES,
    ) -> None:
        keys.check_node(learner_id)
        if poll_interval <= 0 or lease_every <= 0:
            raise ValueError("poll_interval and lease_every must be positive seconds")
        if lease_timeout < 2 * lease_every + poll_interval:
            raise ValueError(
                f"lease_timeout ({lease_timeout} s) must be at least 2 * lease_every + "
                f"poll_interval ({2 * lease_every + poll_interval} s), so one late renewal "
                "never expires a live node"
            )
        if takeover is not None and takeover < lease_timeout:
            raise ValueError(f"takeover ({takeover} s) must be at least lease_timeout")
        if compression not in ("off", "zstd"):
            raise ValueError(f"compression must be 'off' or 'zstd', got {compression!r}")
        if outlier_factor is not None and not outlier_factor > 1.0:
            raise ValueError(f"outlier_factor must be above 1 (or None: off), got {outlier_factor}")
        if keep_rounds is not None and keep_rounds < 1:
            raise ValueError(
                f"keep_rounds must be at least 1 (or None: keep all), got {keep_rounds}"
            )
        if not gc_horizon >= 0:
            raise ValueError(f"gc_horizon must be >= 0 seconds, got {gc_horizon}")
        if backend is None:
            backend = default_backend() if isinstance(model, Adapter) else backend_for(model)
        self.backend = backend
        self.adapter = adapter_of(model, backend)
        self._spills = spill.spills(backend) if spill_base is None else spill_base
        self._spill_dir = spill_dir
        self.algorithm = algorithm
        self.node = learner_id
        self.clock = clock
        if not outage_timeout >= 0:
            raise ValueError(f"outage_timeout must be >= 0 seconds, got {outage_timeout}")
        self.exchange = Exchange(
            mailbox,
            clock,
            node=learner_id,
            on_event=on_event,
            keyring=keyring,
            outage=outage_timeout,
        )
        self.on_event = on_event
        self.process = nonces()
        self._nonces = nonces
        self._rules = rules
        self._compression: Compression = compression
        self._poll_interval = poll_interval
        self._lease_every = lease_every
        self._lease_timeout = lease_timeout
        self._takeover = takeover if takeover is not None else lease_timeout
        self._mapping = fragment_mapping
        self._keep = keep_rounds
        self._horizon = gc_horizon
        self._outlier_factor = outlier_factor
        self.handoff = Handoff(clock.bell())
        self.trainer: Trainer | None = None
        self.learner: LearnerLoop | None = None
        self.syncer: SyncerLoop | None = None

    async def join(self) -> None:
        """Create or join the run, check identity, load the newest commits into the model."""
        settings = join.Settings(
            node=self.node,
            process=self.process,
            schema=self.adapter.schema,
            algorithm=self.algorithm,
            mapping=self._mapping,
            split=bool(getattr(self.adapter, "row_blocks", False)),
            signed=self.exchange.keyring is not None,
            lease_every=self._lease_every,
            rules=self._rules,
        )
        joiner = Joiner(
            exchange=self.exchange,
            adapter=self.adapter,
            compression=self._compression,
            nonces=self._nonces,
        )
        state = await joiner.run(settings, self.clock)
        manifest = state.manifest
        assert manifest is not None
        loaded = [joiner.loaded.pop(k) for k in range(self.algorithm.fragments)]
        for found in loaded:
            self.adapter.write(found)
        base = [self._base_of(self.backend.load(found)) for found in loaded]
        del loaded, found
        self._build(state, base)
        release_memory()  # the join's payloads, read back and loaded, are spent
        self.on_event(
            Joined(
                node=self.node,
                created=state.created,
                rounds=tuple(c.round if c else -1 for c in state.newest),
            )
        )

    def _base_of(self, tensors: Tensors) -> spill.Base:
        """A fragment's base as this node keeps it: in a file when it spills (``spill``)."""
        if not self._spills:
            return tensors
        return spill.spill(self.backend, tensors, self._spill_dir)

    def _build(self, state: JoinState, base: list[Any]) -> None:
        manifest = state.manifest
        assert manifest is not None
        trained, polled, synced = join.started(state, process=self.process)
        learner_inbox, syncer_inbox = Inbox(self.clock.bell()), Inbox(self.clock.bell())
        handover = Handover()
        for k, kept in enumerate(base):  # the closer's master of each fragment's next round
            if isinstance(kept, spill.SpilledBase):
                handover.put_base(k, state.newest[k], kept)
        self.trainer = Trainer(
            adapter=self.adapter,
            backend=self.backend,
            manifest=manifest,
            node=self.node,
            state=trained,
            base=base,
            handoff=self.handoff,
            loop=learner_inbox,
            syncer=syncer_inbox,
            on_event=self.on_event,
            rules=self._rules,
        )
        self.learner = LearnerLoop(
            settings=polling.Settings(
                node=self.node,
                manifest=manifest,
                poll_interval=self._poll_interval,
                rules=self._rules,
            ),
            state=polled,
            exchange=self.exchange,
            backend=self.backend,
            compression=self._compression,
            handoff=self.handoff,
            handover=handover,
            inbox=learner_inbox,
            syncer=syncer_inbox,
            on_event=self.on_event,
            spill_base=self._spills,
            spill_dir=self._spill_dir,
        )
        self.syncer = SyncerLoop(
            settings=syncer.Settings(
                node=self.node,
                process=self.process,
                manifest=manifest,
                poll_interval=self._poll_interval,
                lease_every=self._lease_every,
                lease_timeout=self._lease_timeout,
                takeover=self._takeover,
                keep=self._keep,
                horizon=self._horizon,
                outlier_factor=self._outlier_factor,
                rules=self._rules,
                keyring=self.exchange.keyring,
            ),
            state=synced,
            exchange=self.exchange,
            backend=self.backend,
            compression=self._compression,
            handover=handover,
            inbox=syncer_inbox,
            learner=learner_inbox,
            nonces=self._nonces,
            on_event=self.on_event,
            learner_spills=self._spills,
            spill_dir=self._spill_dir,
        )

    # -- the loops ----------------------------------------------------------------------

    def loops(self) -> list[tuple[str, Coroutine[Any, Any, None]]]:
        """The learner and syncer loops, each ending the node's training (``step`` raises
        what it died of) and its lease renewals if it fails (Decision 2)."""
        learner, syncer = self.learner, self.syncer
        assert learner is not None and syncer is not None
        return [
            ("learner", self._hosted("learner", lambda: learner.run(self.clock))),
            ("syncer", self._hosted("syncer", lambda: syncer.run(self.clock))),
        ]

    async def _hosted(self, where: str, loop: Callable[[], Coroutine[Any, Any, None]]) -> None:
        try:
            await loop()
        except Exception as exc:
            self.fail(where, exc)

    def fail(self, where: str, exc: BaseException) -> None:
        """A loop died of ``exc``: stop the syncer (its last lease says ``left``), make the
        training side raise it, and report it."""
        assert self.syncer is not None
        self.syncer.inbox.put(Stop())
        self.handoff.fail(exc)
        self.on_event(Failed(node=self.node, where=where, error=repr(exc)))

    # -- the training side --------------------------------------------------------------

    async def step(self, samples: int) -> None:
        """Count one training step of ``samples`` tokens; never does I/O. Blocks only while
        the overlap bound holds (``learner.waiting_on``), until a commit arrives; meanwhile
        the learner loop polls that commit more often (``Hurry``)."""
        assert self.trainer is not None
        self.trainer.advance(samples)
        blocked = self.trainer.blocked()
        if blocked is None:
            return
        start = self.clock.now()
        hurried: int | None = None
        while (waiting := self.trainer.blocked()) is not None:
            if waiting.round != hurried:  # at first, and when the bound holds on another round
                hurried = waiting.round
                self._hurry(hurried)
            await self.handoff.bell.wait(self._poll_interval)
        seconds = self.clock.now() - start
        stalled = Stalled(
            node=self.node,
            round=blocked.round,
            fragment=blocked.fragment,
            seconds=seconds,
            step=self.trainer.steps,
        )
        self.on_event(stalled)

    def _hurry(self, r: int) -> None:
        """The training side waits for round ``r``'s commit: both loops read for it more often
        (``Hurry``)."""
        assert self.learner is not None and self.syncer is not None
        self.learner.inbox.put(Hurry(round=r))
        self.syncer.inbox.put(Hurry(round=r))

    async def wait_for_nodes(self, count: int, timeout: float) -> frozenset[str]:
        """Return the active nodes once this node's lease view lists at least ``count`` of
        them (itself included); ``ProtocolError`` after ``timeout`` seconds. The view is the
        one rounds are closed by, so every round after this wait expects those nodes."""
        assert self.syncer is not None
        deadline = self.clock.now() + timeout
        # The leases are listed every poll meanwhile (lease_every / 2 once all are seen).
        self.syncer.inbox.put(Gather(count=count))
        while True:
            self.handoff.raise_failure()
            now = self.clock.now()
            view = self.syncer.state.keeper.view
            active = leases.gathered(view, now=now, lease_timeout=self._lease_timeout, count=count)
            if active is not None:
                return active
            if now > deadline:
                active = view.active(now=now, lease_timeout=self._lease_timeout)
                raise ProtocolError(
                    f"wait_for_nodes: {len(active)} of {count} nodes active after {timeout} s "
                    f"({', '.join(sorted(active))}); are the others started on this run?"
                )
            # The view is memory the syncer updates: looked at often, so the barrier opens
            # as soon as a LIST shows the last node, not up to a poll later.
            await self.handoff.bell.wait(min(self._poll_interval, BARRIER_LOOK))

    async def close(self, timeout: float = math.inf) -> None:
        """Publish what was trained since the last rounds, release the lease once that is
        uploaded, wait for those rounds to commit and merge them (Decision 11), then stop both
        loops. Raises ``ProtocolError`` when they do not commit within ``timeout`` seconds."""
        assert self.trainer is not None
        try:
            # The last progress; the learner rules tell the syncer to release the lease once
            # nothing is left to publish, and it does once those snapshots are uploaded
            # (Decision 11, ``core.effects.Leave``).
            self.trainer.close()
            for r in self.trainer.outstanding():
                self._hurry(r)
            deadline = self.clock.now() + timeout
            while not self.trainer.done:
                if self.clock.now() > deadline:
                    raise ProtocolError(
                        f"close: rounds {self.trainer.outstanding()} did not commit within "
                        f"{timeout} s (is a quorum of nodes still running?)"
                    )
                await self.handoff.bell.wait(min(self._poll_interval, timeout))
        finally:
            self.finish()

    def finish(self) -> None:
        """Stop both loops; the syncer writes its last lease, marked left."""
        assert self.learner is not None and self.syncer is not None
        self.learner.inbox.put(Stop())
        self.syncer.inbox.put(Stop())
