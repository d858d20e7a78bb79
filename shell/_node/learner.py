"""The learner loop's executor: it carries out what ``core.polling`` decides.

Uploads encode, quantize, compress and create what the training thread captured; polls GET a
fragment's next commit; reads load and verify a commit's parameters (or take the ones this
node's closer handed over); deliveries hand them to the training thread. Every ``if`` here is
about I/O: which request, and how its outcome is reported back as a result.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from gradientmail._events import Callback, Published, Rejected
from gradientmail._node import spill
from gradientmail._node.drive import Inbox, Loop
from gradientmail._node.exchange import Exchange
from gradientmail._node.handoff import Handoff, Handover, Job, OwnSnapshot, Ready
from gradientmail._node.payloads import load_spending, read_fragment
from gradientmail._node.release import release_memory
from gradientmail.adapters.base import Backend, Tensors
from gradientmail.core import polling
from gradientmail.core.codecs import Compression, compress_parts
from gradientmail.core.effects import (
    CommitRead,
    Deliver,
    HeadRead,
    Missed,
    ParamsRead,
    PollCommit,
    ReadCommit,
    ReadHead,
    ReadParams,
    Result,
    Seen,
    Upload,
    Uploaded,
    Watch,
)
from gradientmail.core.effects import Rejected as Reject
from gradientmail.core.envelope import payload_digest
from gradientmail.core.errors import NonFinite, RejectedObject, SchemaMismatch
from gradientmail.core.records import Commit, Manifest, Snapshot
from gradientmail.core.robust import snapshot_bound
from gradientmail.core.tensors import TensorBytes, Tensorish
from gradientmail.mailboxes._protocol import data_size

__all__ = ["MERGE_BY_DIFFERENCE", "LearnerLoop", "read_commit", "read_params"]

UNTRUSTED = (RejectedObject, SchemaMismatch, NonFinite)
"""What reading another node's bytes may raise: the object is not used, never the loop's end."""


MERGE_BY_DIFFERENCE = True
"""Whether a merge since the snapshot adds ``commit - capture`` computed here (``_deliver``,
``Backend.shift``), or takes two passes on the training thread (``Backend.merge``)."""


async def read_commit(exchange: Exchange, r: int, *, verify: bool = True) -> CommitRead:
    """GET round ``r``'s commit record as a result (a record that does not verify, or names
    another round, comes back rejected)."""
    try:
        return CommitRead(round=r, commit=await exchange.commit(r, verify=verify))
    except RejectedObject as exc:
        return CommitRead(round=r, commit=None, rejected=str(exc))


async def read_params(
    exchange: Exchange, manifest: Manifest, k: int, commit: Commit | None
) -> tuple[ParamsRead, dict[str, TensorBytes] | None]:
    """Load and verify the parameters ``commit`` names (the initial ones when None)."""
    ref = commit.params if commit is not None else manifest.init[k]
    try:
        found = await read_fragment(exchange, ref, manifest.fragment_schema(k))
    except UNTRUSTED as exc:
        return ParamsRead(fragment=k, commit=commit, present=False, rejected=str(exc)), None
    if found is None:
        return ParamsRead(fragment=k, commit=commit, present=False), None
    return ParamsRead(fragment=k, commit=commit, present=True), found


class LearnerLoop(Loop[polling.PollState]):
    """Uploads captures and fetches commits until stopped (``Stop`` in the inbox): the
    executor of ``core.polling.step``."""

    def __init__(
        self,
        *,
        settings: polling.Settings,
        state: polling.PollState,
        exchange: Exchange,
        backend: Backend,
        compression: Compression,
        handoff: Handoff,
        handover: Handover,
        inbox: Inbox,
        syncer: Inbox,
        on_event: Callback,
        spill_base: bool = False,
        spill_dir: str | None = None,
    ) -> None:
        self.settings = settings
        self._spills = spill_base
        self._spill_dir = spill_dir
        self.state = state
        self.inbox = inbox
        self._exchange = exchange
        self._backend = backend
        self._compression = compression
        self._handoff = handoff
        self._handover = handover
        self._syncer = syncer
        self._on_event = on_event
        self._manifest = settings.manifest
        self._algorithm = settings.manifest.algorithm
        K = self._algorithm.fragments
        self._residual: list[spill.Base | None] = [None] * K
        self._params: dict[int, tuple[Commit, Tensors]] = {}
        self._uploaded: dict[int, tuple[int, Tensors]] = {}
        """Each fragment's capture uploaded last, by round, while its commit may come (a
        merge since it adds ``commit - capture``, computed here: ``_deliver``)."""
        self._sent: dict[int, tuple[Job, Snapshot, Tensors | None, int, str]] = {}
        self._handlers: dict[type, Callable[[Any], Awaitable[Result | None]]] = {
            Upload: self._upload,
            Watch: self._watch,
            Missed: self._missed,
            PollCommit: self._poll,
            ReadCommit: self._read_commit,
            ReadHead: self._read_head,
            ReadParams: self._read_params,
            Deliver: self._deliver,
            Seen: self._seen,
            Reject: self._reject,
        }

    name = "learner"
    rule = staticmethod(polling.step)

    async def _upload(self, upload: Upload) -> Result | None:
        job, drop = self._handoff.take_job(upload.round)
        for k in drop:  # rebased since: the error feedback of the missed snapshot goes
            self._residual[k] = None
        if job is None:
            return None
        publish, k = job.publish, job.publish.fragment
        self._backend.ready(job.captured)
        # A capture made once training ended is not needed after its delta (its merge sets
        # the commit): the delta takes its memory. Otherwise it is kept for the difference.
        final = job.final
        delta = spill.delta(self._backend, job.base, job.captured, self._residual[k], owned=final)
        self._residual[k] = None  # in the delta now: not held (nor spilled) twice
        if self._algorithm.alpha is None and MERGE_BY_DIFFERENCE and not final:
            self._uploaded[k] = (publish.round, job.captured)
        quantization = self._algorithm.quantization
        # An unquantized delta goes to this node's closer as tensors (``_watch``), so its
        # payload is lent (the delta is unchanged until written) and the exchange need not
        # remember its bytes; a quantized payload is remembered for this node's closer, and
        # the delta is spent on it (its memory may hold the residual: ``owned``).
        payload: Mapping[str, Tensorish]
        remembered: dict[str, TensorBytes] | None = None
        own: Tensors | None = delta  # what this node's closer is handed (``_watch``)
        if quantization is None:
            payload = self._backend.lend_plain(delta)
        else:
            remembered, residual = self._backend.encode(delta, quantization, owned=True)
            payload, own = remembered, None
            del delta  # its memory is the residual's now
            # The error feedback waits a whole fragment cycle for the fragment's next delta:
            # a node that keeps its base in a file keeps it there too (one file a fragment).
            self._residual[k] = (
                spill.spill(self._backend, residual, self._spill_dir) if self._spills else residual
            )
            del residual
        data = compress_parts(payload, self._compression)
        snapshot = Snapshot(
            node=self.settings.node,
            nonce=job.nonce,
            round=publish.round,
            base_round=publish.base_round,
            samples=publish.samples,
            steps=publish.steps,
            digest=payload_digest(data),
        )
        schema = self._manifest.fragment_schema(k)
        created = await self._exchange.publish(
            snapshot, data, self._compression, remembered, bound=snapshot_bound(schema)
        )
        self._sent[publish.round] = (job, snapshot, own, data_size(data), created.key)
        del payload, data, remembered, own
        release_memory()  # the capture's encoded bytes are spent
        return Uploaded(round=publish.round, created=created)

    async def _watch(self, watch: Watch) -> None:
        job, snapshot, delta, size, key = self._sent.pop(watch.round)
        if watch.ours:
            if delta is not None:  # unquantized: the payload holds the delta's F32 bytes
                own = OwnSnapshot(record=snapshot, key=key, delta=delta)
                self._handover.put_own(watch.round, own)
            publish = job.publish
            self._on_event(
                Published(
                    node=self.settings.node,
                    round=publish.round,
                    fragment=publish.fragment,
                    samples=publish.samples,
                    steps=publish.steps,
                    bytes=size,
                )
            )
        self._syncer.put(watch)

    async def _missed(self, missed: Missed) -> None:
        reason = "another incarnation's snapshot holds this node's key: round missed"
        self._on_event(
            Rejected(node=self.settings.node, key=f"round {missed.round}", reason=reason)
        )

    async def _poll(self, poll: PollCommit) -> Result:
        return await read_commit(self._exchange, poll.round)

    async def _read_commit(self, read: ReadCommit) -> Result:
        return await read_commit(self._exchange, read.round, verify=read.verify)

    async def _read_head(self, read: ReadHead) -> Result:
        return HeadRead(fragment=read.fragment, round=await self._exchange.head(read.fragment))

    async def _read_params(self, read: ReadParams) -> Result:
        k, commit = read.fragment, read.commit
        # A commit this node's closer wrote comes with its parameters: what the store holds.
        handed = self._handover.take_params(commit) if commit is not None else None
        if handed is not None and commit is not None:
            self._params[k] = (commit, handed)
            return ParamsRead(fragment=k, commit=commit, present=True)
        result, found = await read_params(self._exchange, self._manifest, k, commit)
        if found is not None and commit is not None:
            self._params[k] = (commit, load_spending(self._backend, found))
        return result

    async def _deliver(self, deliver: Deliver) -> None:
        commit, tensors = self._params.pop(deliver.commit.fragment)
        assert commit == deliver.commit
        base = spill.spill(self._backend, tensors, self._spill_dir) if self._spills else None
        if base is not None:
            self._handover.put_base(commit.fragment, commit, base)
        difference = None
        uploaded = self._uploaded.get(commit.fragment)
        if uploaded is not None and uploaded[0] <= commit.round:
            # The capture's last use: its delta is computed, and the training thread merges
            # since it only for this round (a newer commit merges since the base).
            del self._uploaded[commit.fragment]
            if uploaded[0] == commit.round:
                difference = self._backend.difference(tensors, uploaded[1], owned=True)
        ready = Ready(
            commit=commit,
            tensors=tensors,
            counted=deliver.counted,
            base=base,
            difference=difference,
        )
        self._handoff.deliver(ready)

    async def _seen(self, seen: Seen) -> None:
        self._syncer.put(seen)

    async def _reject(self, reject: Reject) -> None:
        self._exchange.reject(reject.key, reject.reason)
