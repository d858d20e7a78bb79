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
import os
import re
import socket
import threading
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

from gradientmail._clock import MonotonicClock, run_sync
from gradientmail._events import Callback, Left, combined, log_events
from gradientmail._node import Node
from gradientmail._node.exchange import DEFAULT_OUTAGE, Exchange
from gradientmail._node.joining import Joiner
from gradientmail._node.node import adapter_of
from gradientmail._secrets import Secret, keyring_from
from gradientmail.adapters import Backend
from gradientmail.core import gc, join
from gradientmail.core.algorithm import DiLoCo
from gradientmail.core.codecs import Compression
from gradientmail.core.errors import ProtocolError
from gradientmail.core.leases import batch_share
from gradientmail.core.robust import DEFAULT_OUTLIER_FACTOR
from gradientmail.mailboxes._protocol import Mailbox

__all__ = ["Session", "align", "default_learner_id"]


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
        clock = MonotonicClock()
        adapter = adapter_of(model, backend)
        exchange = Exchange(mailbox, clock, keyring=keyring)
        settings = join.Settings(
            node="reader",
            process="0" * 16,
            schema=adapter.schema,
            algorithm=None,
            signed=keyring is not None,
            where=mailbox.url,
        )
        joiner = Joiner(exchange=exchange, adapter=adapter)
        state = await joiner.run(settings, clock)
        for k in sorted(joiner.loaded):
            adapter.write(joiner.loaded[k])
        return max((c.round for c in state.newest if c is not None), default=-1)

    return asyncio.run(read())


def default_learner_id() -> str:
    """The host name and process id, so two processes on one host never share an id."""
    pid = f"-{os.getpid()}"
    host = re.sub(r"[^a-z0-9-]", "-", socket.gethostname().lower()) or "node"
    return f"{host[: 64 - len(pid)]}{pid}"


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
        node that creates the run). Without it, a torch or MLX model's large parameters outside
        the layers (a token embedding) are cut into row blocks that even the fragments' bytes
        (``core.fragments``).
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
    outage_timeout
        Seconds one store request may keep failing transiently (refused connections,
        timeouts, 5xx, throttling) before the node stops with ``StoreUnavailable``; until
        then it is retried with capped backoff (``Retried`` events), and training goes on up
        to the overlap bound. 1800 by default.
    spill_base, spill_dir
        Whether the node keeps each fragment's base (the newest merged commit, which every
        delta is measured from: one F32 copy of the model) in an anonymous file in
        ``spill_dir`` (the system's temporary directory by default) instead of memory, and
        (as the closer of a round) each fragment's outer momentum when it exceeds the 64 MiB
        kept in memory, and with quantized deltas each fragment's error-feedback residual:
        up to twice the model's F32 bytes of disk, three times with quantized deltas (or with
        BF16 or F16 parameters, whose F32 master is kept too). The page cache holds the
        files while memory is free; each is unlinked at once, so nothing is left behind. None
        (the default) spills on the CPU (torch's CPU device, MLX) and keeps a CUDA base on its
        device. Put ``spill_dir`` on a disk, not a tmpfs, or the files stay in memory.
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
        keep_rounds: int | None = gc.DEFAULT_KEEP,
        gc_horizon: float = gc.DEFAULT_HORIZON,
        secret: Secret | None = None,
        secret_file: str | os.PathLike[str] | None = None,
        outlier_factor: float | None = DEFAULT_OUTLIER_FACTOR,
        outage_timeout: float = DEFAULT_OUTAGE,
        spill_base: bool | None = None,
        spill_dir: str | os.PathLike[str] | None = None,
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
            gc_horizon=gc_horizon,
            keyring=keyring_from(secret, secret_file),
            outlier_factor=outlier_factor,
            outage_timeout=outage_timeout,
            spill_base=spill_base,
            spill_dir=None if spill_dir is None else os.fspath(spill_dir),
        )
        self._lease_timeout = lease_timeout
        self._close_timeout = close_timeout
        asyncio.run(self._node.join())
        self._closed = False
        self._threads = [self._thread(name, loop) for name, loop in self._node.loops()]

    def _thread(self, name: str, loop: Coroutine[Any, Any, None]) -> threading.Thread:
        node = self._node

        def host() -> None:
            try:
                asyncio.run(loop)
            except BaseException as exc:  # what Node's own host lets through
                node.fail(name, exc)

        thread = threading.Thread(target=host, name=f"gradientmail-{name}-{node.node}", daemon=True)
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
        run_sync(self._node.step(samples))

    def wait_for_nodes(self, count: int, *, timeout: float = 600.0) -> list[str]:
        """Block until this node sees ``count`` active nodes in the run, itself included, and
        return their ids (sorted): a start barrier for a run launched as ``count`` nodes at
        once, so that every round, the first of each fragment too, expects all of them.

        Without it, a node that starts training before the others have joined closes its
        first rounds alone (a round waits only for the nodes its closer knows of). Returns
        about ``poll_interval`` seconds after the last node joined (the view is refreshed
        by the syncer's lease LIST, every ``poll_interval`` while the node waits); raises
        ``ProtocolError`` naming the nodes seen when ``timeout`` seconds pass first, and
        what a background loop died of.
        """
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"wait_for_nodes: count must be a positive integer, got {count!r}")
        if self._closed:
            raise ProtocolError("wait_for_nodes() after close()")
        return sorted(run_sync(self._node.wait_for_nodes(count, timeout)))

    def close(self) -> None:
        """Publish what was trained since the last rounds, release the lease once that is
        uploaded, wait for those rounds to commit and merge them, then stop (Decision 11).
        After ``close`` the model holds the final commits of the rounds this node took part
        in."""
        if self._closed:
            return
        self._closed = True
        try:
            run_sync(self._node.close(self._close_timeout))
        finally:
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
        assert self._node.trainer is not None
        return self._node.trainer.rounds_seen

    @property
    def batch_size(self) -> int | None:
        """This node's share of the algorithm's ``global_batch`` (tokens) over the live nodes,
        for the training loop to size its batches by; None when the algorithm sets none."""
        assert self._node.syncer is not None
        active = self._node.syncer.state.active(
            now=self._node.clock.now(), lease_timeout=self._lease_timeout
        )
        return batch_share(self._node.algorithm.global_batch, active)

    @property
    def stats(self) -> dict[str, int]:
        """The mailbox's request and byte counters (``RequestStats.snapshot``)."""
        return self._mailbox.stats.snapshot()
