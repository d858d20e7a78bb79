"""The public facade: one object wraps a training loop from join to close.

``Session`` resolves the framework backend from the model, names the node after the host and
process when the caller does not, joins the run before returning (so the model holds the newest
global parameters when training starts), then runs the learner's communication loop and the
syncer on two daemon threads, each an ``asyncio`` loop over the node's clock. Every session takes
part in closing rounds; which one does the work is settled through the mailbox, so a run has no
process to operate besides its nodes.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import socket
import threading
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

from gradientmail.adapters import Adapter, Backend, backend_for, default_backend
from gradientmail.clock import Bell, Clock, MonotonicClock
from gradientmail.core import keys
from gradientmail.core.algorithm import DiLoCo
from gradientmail.core.codecs import Compression
from gradientmail.core.errors import FormatError, ProtocolError
from gradientmail.core.records import Lease
from gradientmail.core.robust import DEFAULT_OUTLIER_FACTOR
from gradientmail.core.signing import Keyring
from gradientmail.events import Callback, Failed, Joined, Left, combined, log_events
from gradientmail.exchange import Exchange
from gradientmail.learner import Learner
from gradientmail.ledger import Ledger
from gradientmail.mailbox import Mailbox
from gradientmail.run import (
    Secret,
    check_schema,
    create_or_join,
    keyring_from,
    load_newest,
    read_manifest,
)
from gradientmail.syncer import Syncer

__all__ = ["Node", "Session", "align"]


def align(
    model: object,
    *,
    mailbox: Mailbox,
    backend: Backend | None = None,
    secret: Secret | None = None,
    secret_file: str | os.PathLike[str] | None = None,
) -> int:
    """Load the run's newest committed parameters into ``model`` without joining the run.

    For evaluation or inference: nothing is written to the mailbox, so read access suffices.
    Returns the newest committed round the model now holds, -1 when the run has committed none
    yet; raises ``ProtocolError`` when ``mailbox`` holds no run and ``SchemaMismatch`` (naming
    the parameters) when ``model`` does not match it. A signed run needs its secret, as for
    ``Session`` (``secret``, ``secret_file`` or ``GRADIENTMAIL_SECRET``), to verify what it
    loads; ``ProtocolError`` says so when it is missing.
    """
    keyring = keyring_from(secret, secret_file)

    async def read() -> int:
        exchange = Exchange(mailbox, MonotonicClock(), keyring=keyring)
        manifest = await read_manifest(exchange)
        if manifest is None:
            raise ProtocolError(f"{mailbox.url} holds no run (no manifest)")
        adapter = _adapter(model, backend)
        check_schema(manifest.schema, adapter.schema)
        newest = await load_newest(exchange, manifest)
        for _, tensors in newest:
            adapter.write(tensors)
        return max((c.round for c, _ in newest if c is not None), default=-1)

    return asyncio.run(read())


def _adapter(model: object, backend: Backend | None) -> Adapter:
    if isinstance(model, Adapter):
        return model
    return (backend or backend_for(model)).adapter(model)


def default_learner_id() -> str:
    """The host name and process id, so two processes on one host never share an id."""
    pid = f"-{os.getpid()}"
    host = re.sub(r"[^a-z0-9-]", "-", socket.gethostname().lower()) or "node"
    return f"{host[: 64 - len(pid)]}{pid}"


class Node:
    """A node's learner and syncer over one mailbox and clock, without threads: the part of a
    ``Session`` a simulator drives directly (``join``, then the ``learner.run`` and
    ``syncer.run`` coroutines, and ``advance``/``blocked`` for the training side). ``bells``
    (real time on an ``asyncio`` loop only, as in ``Session``) lets the two loops wake each
    other: a capture is uploaded, an upload considered and a commit fetched at once."""

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
        keep_rounds: int | None = 2,
        keyring: Keyring | None = None,
        outlier_factor: float | None = DEFAULT_OUTLIER_FACTOR,
        bells: bool = False,
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
        if backend is None:
            backend = default_backend() if isinstance(model, Adapter) else backend_for(model)
        self.backend = backend
        self.adapter = _adapter(model, backend)
        self.algorithm = algorithm
        self.node = learner_id
        self.exchange = Exchange(
            mailbox, clock, node=learner_id, on_event=on_event, keyring=keyring
        )
        self.on_event = on_event
        self._settings: dict[str, Any] = {
            "compression": compression,
            "poll_interval": poll_interval,
            "lease_every": lease_every,
            "lease_timeout": lease_timeout,
            "takeover": takeover if takeover is not None else lease_timeout,
            "mapping": fragment_mapping,
            "keep_rounds": keep_rounds,
            "outlier_factor": outlier_factor,
        }
        # Real time only (Bell): the loops wake each other instead of waiting for a poll.
        self._bells = (Bell(), Bell()) if bells else None
        self.learner: Learner | None = None
        self.syncer: Syncer | None = None

    async def join(self) -> None:
        """Create or join the run, check identity, load the newest commits into the model."""
        s = self._settings
        manifest, created = await create_or_join(
            self.exchange,
            self.adapter,
            self.algorithm,
            node=self.node,
            compression=s["compression"],
            mapping=s["mapping"],
        )
        await self._check_identity()
        newest = await load_newest(self.exchange, manifest)
        for _, tensors in newest:
            self.adapter.write(tensors)
        learner_bell, syncer_bell = self._bells or (None, None)
        ledger = Ledger()
        for commit, _ in newest:
            if commit is not None:
                ledger.committed(commit)
        self.learner = Learner(
            adapter=self.adapter,
            backend=self.backend,
            manifest=manifest,
            exchange=self.exchange,
            ledger=ledger,
            node=self.node,
            merged=[c for c, _ in newest],
            base=[self.backend.load(t) for _, t in newest],
            compression=s["compression"],
            poll_interval=s["poll_interval"],
            on_event=self.on_event,
            bell=learner_bell,
            uploaded=syncer_bell.ring if syncer_bell is not None else None,
        )
        self.syncer = Syncer(
            exchange=self.exchange,
            backend=self.backend,
            manifest=manifest,
            ledger=ledger,
            node=self.node,
            compression=s["compression"],
            poll_interval=s["poll_interval"],
            lease_every=s["lease_every"],
            lease_timeout=s["lease_timeout"],
            takeover=s["takeover"],
            keep_rounds=s["keep_rounds"],
            outlier_factor=s["outlier_factor"],
            on_event=self.on_event,
            bell=syncer_bell,
            committed=self.learner.wake,
        )
        await self.syncer.tick()
        self.on_event(
            Joined(
                node=self.node,
                created=created,
                rounds=tuple(c.round if c else -1 for c, _ in newest),
            )
        )

    def begin_close(self) -> None:
        """Publish the last progress and release the lease at once (Decision 11)."""
        assert self.learner is not None and self.syncer is not None
        self.learner.close()
        self.syncer.leaving = True
        self.syncer.force_renewal()

    def finish(self) -> None:
        """Stop both loops; the syncer writes its last lease, marked left."""
        assert self.learner is not None and self.syncer is not None
        self.learner.stop()
        self.syncer.stop()

    async def _check_identity(self) -> None:
        """Decision 9: refuse to join under an id whose lease another live process renews."""
        lease = await self._own_lease()
        if lease is None or lease.left:
            return
        s = self._settings
        await self.exchange.clock.sleep(s["lease_every"] * 1.5)
        again = await self._own_lease()
        if again is not None and not again.left and again.counter != lease.counter:
            raise ProtocolError(
                f"learner id {self.node!r} is in use by a live process (nonce {again.nonce}); "
                "choose another learner_id or stop that process"
            )

    async def _own_lease(self) -> Lease | None:
        """The lease under this node's id; one that does not verify (garbage, a forgery, or
        signed under a retired secret) is reported and counts as absent: no live process of
        this run wrote it, and this node's first renewal overwrites it."""
        try:
            return await self.exchange.lease(self.node)
        except FormatError as exc:
            self.exchange.reject(keys.lease(self.node), str(exc))
            return None


class Session:
    """One node of a run, wrapped around the caller's own training loop.

    Construction joins the run, creating it from the model's parameters when it does not exist
    yet, and returns only once the model holds the newest committed version of every fragment.
    Call ``step`` after every optimizer step and ``close`` when training ends, or use the
    instance as a context manager.

    Parameters
    ----------
    model
        A torch or MLX module, or any ``Adapter``.
    algorithm
        The run's algorithm (``DiLoCo``); it must equal the one the run was created with.
    mailbox
        The store the run lives in (``mailbox_from_url``).
    learner_id
        ``[a-z0-9-]{1,64}``; defaults to the host name and process id.
    poll_interval
        Seconds between polls for commits, snapshots and claims.
    backend
        Where deltas and outer steps are computed; defaults to the model's framework.
    compression
        ``"off"`` or ``"zstd"`` (byte-shuffled zstandard, the ``zstd`` extra) for this node's
        payloads; every node reads every codec.
    lease_every, lease_timeout
        Seconds between lease renewals, and seconds without one after which others stop
        waiting for this node. ``lease_timeout >= 2 * lease_every + poll_interval``.
    takeover
        Seconds (at least ``lease_timeout``, its default) before another node may take over a
        closer that stays silent; doubles with every attempt.
    close_timeout
        Seconds ``close`` waits for this node's last rounds to commit before raising.
    callbacks
        What receives the node's events; one that raises is logged and ignored.
    fragment_mapping
        Parameter name to fragment index, overriding the strided partition (used only by the
        node that creates the run).
    keep_rounds
        Rounds of each fragment whose payloads stay in the mailbox after a newer commit
        (garbage collection, Decision 7); None keeps everything (for audits).
    secret, secret_file
        The run secret (bytes or text, at least 16 bytes; or two during a key rotation, the
        signing one first), or a file holding it. Without either, ``GRADIENTMAIL_SECRET`` or
        the file named by ``GRADIENTMAIL_SECRET_FILE``. A node with a secret creates a signed
        run, signs every record it writes and rejects records that do not verify; it cannot
        join an unsigned run, nor a node without one a signed run (docs/security.md).
    outlier_factor
        When closing a round of at least 3 deltas, exclude a delta whose L2 norm (normalized
        to ``inner_steps`` steps) exceeds this many times the round's median; None turns the
        rule off. Above 1; 10 by default.
    """

    def __init__(
        self,
        model: object,
        *,
        algorithm: DiLoCo,
        mailbox: Mailbox,
        learner_id: str | None = None,
        poll_interval: float = 1.0,
        backend: Backend | None = None,
        compression: Compression = "off",
        lease_every: float = 50.0,
        lease_timeout: float = 120.0,
        takeover: float | None = None,
        close_timeout: float = 600.0,
        callbacks: Sequence[Callback] = (log_events,),
        fragment_mapping: Mapping[str, int] | None = None,
        keep_rounds: int | None = 2,
        secret: Secret | None = None,
        secret_file: str | os.PathLike[str] | None = None,
        outlier_factor: float | None = DEFAULT_OUTLIER_FACTOR,
    ) -> None:
        self._mailbox = mailbox
        self._on_event = combined(*callbacks)
        self._node = Node(
            model,
            algorithm=algorithm,
            mailbox=mailbox,
            clock=MonotonicClock(),
            learner_id=learner_id or default_learner_id(),
            backend=backend,
            compression=compression,
            poll_interval=poll_interval,
            lease_every=lease_every,
            lease_timeout=lease_timeout,
            takeover=takeover,
            on_event=self._on_event,
            fragment_mapping=fragment_mapping,
            keep_rounds=keep_rounds,
            keyring=keyring_from(secret, secret_file),
            outlier_factor=outlier_factor,
            bells=True,
        )
        self._poll_interval = poll_interval
        self._close_timeout = close_timeout
        asyncio.run(self._node.join())
        assert self._node.learner is not None and self._node.syncer is not None
        self._learner: Learner = self._node.learner
        self._syncer: Syncer = self._node.syncer
        self._closed = False
        self._threads = [
            self._thread("learner", self._learner.run()),
            self._thread("syncer", self._syncer.run()),
        ]

    def _thread(self, name: str, coroutine: Coroutine[Any, Any, None]) -> threading.Thread:
        node = self._node.node

        def host() -> None:
            try:
                asyncio.run(coroutine)
            except BaseException as exc:
                # Decision 2: a node whose loop died stops renewing its lease; step() raises.
                self._syncer.renewing = False
                self._syncer.stop()
                self._learner.fail(exc)
                self._on_event(Failed(node=node, where=name, error=repr(exc)))

        thread = threading.Thread(target=host, name=f"gradientmail-{name}-{node}", daemon=True)
        thread.start()
        return thread

    @property
    def learner_id(self) -> str:
        return self._node.node

    def step(self, *, samples: int) -> None:
        """Account for one training step of ``samples`` tokens; never does I/O.

        Applies commits that arrived (at this step boundary) and captures a fragment when a
        sync is due. Blocks only when ``overlap_steps`` bounds the overlap and a round published
        that many steps ago is still open. Raises what a background loop died of.
        """
        if self._closed:
            raise ProtocolError("step() after close()")
        self._learner.advance(samples)
        while self._learner.blocked() is not None:
            self._learner.wait(self._poll_interval)

    def close(self) -> None:
        """Publish what was trained since the last rounds, release the lease at once, wait for
        those rounds to commit and merge them, then stop (Decision 11). After ``close`` the
        model holds the final commits of the rounds this node took part in."""
        if self._closed:
            return
        self._closed = True
        try:
            self._node.begin_close()
            deadline = MonotonicClock().now() + self._close_timeout
            while not self._learner.done:
                if MonotonicClock().now() > deadline:
                    raise ProtocolError(
                        f"close: rounds {self._learner.outstanding()} did not commit within "
                        f"{self._close_timeout} s (is a quorum of nodes still running?)"
                    )
                self._learner.wait(self._poll_interval)
        finally:
            self._node.finish()
            for thread in self._threads:
                thread.join(timeout=60)
            self._on_event(Left(node=self._node.node))

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def rounds_seen(self) -> int:
        """The newest round whose commit the model holds; -1 on a fresh run."""
        return self._learner.rounds_seen

    @property
    def batch_size(self) -> int | None:
        """This node's share of the algorithm's ``global_batch`` (tokens) over the live nodes,
        for the training loop to size its batches by; None when the algorithm sets none."""
        total = self._node.algorithm.global_batch
        if total is None:
            return None
        return max(1, math.ceil(total / max(1, self._syncer.active_nodes())))

    @property
    def stats(self) -> dict[str, int]:
        """The mailbox's request and byte counters (``RequestStats.snapshot``)."""
        return self._mailbox.stats.snapshot()
