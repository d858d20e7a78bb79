"""The syncer: every node runs one. It keeps the node's lease, watches the other leases, and
closes the rounds the core rules assign it, taking over abandoned ones.

Requests (Decision 8): one LIST of ``leases/`` every ``lease_every / 2`` seconds (and a GET for
each lease whose version changed); for each round this node reported to, one LIST of its
snapshots per poll until the round is closable, then one LIST of its claims per poll while it
waits; commits are learned from the learner's GET polls (the ``Ledger``), never polled twice.
"""

from __future__ import annotations

import time as _wall  # only for the Committed event's duration; never for decisions
from collections import OrderedDict
from collections.abc import Callable

import attrs

from gradientmail.adapters.base import Backend, Tensors
from gradientmail.clock import Bell, nap
from gradientmail.core import keys, robust
from gradientmail.core import syncer as rules
from gradientmail.core.codecs import Compression
from gradientmail.core.errors import FormatError
from gradientmail.core.leases import Leases, observe
from gradientmail.core.records import Claim, Commit, Included, Lease, Manifest, Snapshot
from gradientmail.core.tensors import Schema
from gradientmail.events import (
    Callback,
    Claimed,
    Clipped,
    Committed,
    Excluded,
    LeaseExpired,
    TookOver,
)
from gradientmail.exchange import Exchange, new_nonce
from gradientmail.ledger import Ledger
from gradientmail.run import outer_state, payload_limit, read_base

__all__ = ["Syncer"]


@attrs.frozen(kw_only=True)
class _Kept:
    """The F32 master parameters and momentum of a commit this node wrote, as its outer step
    left them: the next outer step of the fragment starts from them when it is this node's."""

    round: int
    nonce: str
    master: Tensors
    momentum: Tensors
    size: int  # bytes: both in F32


@attrs.frozen(kw_only=True)
class _Known:
    """A lease as this node last read it, and the listing entry it was read at."""

    version: str
    size: int
    left: bool
    nonce: str


class Syncer:
    def __init__(
        self,
        *,
        exchange: Exchange,
        backend: Backend,
        manifest: Manifest,
        ledger: Ledger,
        node: str,
        compression: Compression,
        poll_interval: float,
        lease_every: float,
        lease_timeout: float,
        takeover: float,
        on_event: Callback,
        keep_rounds: int | None = 2,
        outlier_factor: float | None = robust.DEFAULT_OUTLIER_FACTOR,
        bell: Bell | None = None,
        committed: Callable[[], None] | None = None,
    ) -> None:
        if outlier_factor is not None and not outlier_factor > 1.0:
            raise ValueError(f"outlier_factor must be above 1 (or None: off), got {outlier_factor}")
        self.node = node
        self.lease_nonce = new_nonce()
        self._exchange = exchange
        self._clock = exchange.clock
        self._backend = backend
        self._manifest = manifest
        self._algorithm = manifest.algorithm
        self._ledger = ledger
        self._compression = compression
        self._poll_interval = poll_interval
        self._lease_every = lease_every
        self._lease_timeout = lease_timeout
        self._takeover = takeover
        self._on_event = on_event
        self._keep_rounds = keep_rounds
        self._outlier_factor = outlier_factor
        # Optional, for real time (Session): ``bell`` wakes the loop (the learner uploaded, the
        # node is leaving), ``committed`` tells the learner this node committed a round.
        self._bell = bell
        self._committed = committed
        self._leases = Leases()
        # fragment -> the outer state of the last commit of it this node wrote, oldest first,
        # within the exchange's budget for what this node wrote (``Exchange.written_limit``).
        self._kept: OrderedDict[int, _Kept] = OrderedDict()
        self._known: dict[str, _Known] = {}  # node -> its lease as last read
        self._rejected_leases: dict[str, str] = {}  # node -> version: not read again
        self._watches: dict[int, rules.RoundWatch] = {}
        self._views: dict[int, tuple[str, ...]] = {}
        self._counter = 0
        self._next_renewal = float("-inf")
        self._next_observation = float("-inf")
        self._expired: set[str] = set()
        self.leaving = False
        self._stopping = False
        self.renewing = True

    def stop(self) -> None:
        self._stopping = True
        self.wake()

    def force_renewal(self) -> None:
        """Renew at the next tick (a leaving node releases its lease at once)."""
        self._next_renewal = float("-inf")
        self.wake()

    def wake(self) -> None:
        """Tick now rather than at the next poll, where the loop has a bell."""
        if self._bell is not None:
            self._bell.ring()

    def active_nodes(self) -> int:
        """Live nodes that have not left, as this node last saw them."""
        now = self._clock.now()
        return len(self._leases.active(now=now, lease_timeout=self._lease_timeout))

    async def run(self) -> None:
        while not self._stopping:
            await self.tick()
            await nap(self._clock, self._bell, self._poll_interval)
        await self.renew(left=True)

    async def tick(self) -> None:
        now = self._clock.now()
        if now >= self._next_renewal and self.renewing:
            await self.renew(left=self.leaving)
            self._next_renewal = now + self._lease_every
        if now >= self._next_observation:
            await self._observe_leases()
            self._next_observation = now + self._lease_every / 2
        for r in self._ledger.watched():
            await self._round(r)

    async def renew(self, *, left: bool) -> None:
        self._counter += 1
        lease = Lease(node=self.node, nonce=self.lease_nonce, counter=self._counter, left=left)
        await self._exchange.put_lease(lease)

    async def _observe_leases(self) -> None:
        infos = await self._exchange.lease_infos()
        listing: dict[str, tuple[str, bool, str]] = {}
        for node, info in infos.items():
            known = self._known.get(node)
            if known is not None and (known.version == info.version or known.size == info.size):
                # Unchanged, or renewed: a lease's size changes whenever its "left" flag does
                # (records.Lease), so a renewal needs no GET (Decision 8).
                self._known[node] = attrs.evolve(known, version=info.version)
                listing[node] = (info.version, known.left, known.nonce)
                continue
            if self._rejected_leases.get(node) == info.version:
                continue
            try:
                lease = await self._exchange.lease(node)
            except FormatError as exc:
                self._rejected_leases[node] = info.version
                self._exchange.reject(keys.lease(node), str(exc))
                continue
            if lease is None or lease.node != node:
                continue
            self._known[node] = _Known(
                version=info.version, size=info.size, left=lease.left, nonce=lease.nonce
            )
            listing[node] = (info.version, lease.left, lease.nonce)
        now = self._clock.now()
        self._leases = observe(self._leases, listing, now=now)
        live = self._leases.live(now=now, lease_timeout=self._lease_timeout)
        for node in sorted(set(self._known) - live - self._expired):
            self._on_event(LeaseExpired(observer=self.node, node=node))
        self._expired = set(self._known) - live

    async def _round(self, r: int) -> None:
        if self._ledger.commit(r) is not None:
            self._forget(r)
            return
        watch = self._watches.get(r) or rules.RoundWatch(round=r)
        if watch.open_since is None or r not in self._views:
            listed = await self._exchange.reporters(r)
            if self._exchange.keyring is not None:
                listed = list(robust.members(listed, self._known))
            self._views[r] = tuple(listed)
        claims: tuple[Claim, ...] = ()
        if watch.open_since is not None:
            claims = tuple(await self._exchange.claims(r))
        previous = rules.previous_round(self._algorithm, r)
        before = self._ledger.commit(previous) if previous >= 0 else None
        view = rules.RoundView(
            round=r,
            reporters=self._views[r],
            previous_reporters=(
                tuple(i.node for i in before.included) if before is not None else None
            ),
            claims=claims,
            # From commits, which are verified in a signed run: a listing could name anyone.
            peers=tuple(sorted(self._ledger.peers() - {self.node})),
        )
        watch, decision = rules.decide(
            view,
            watch,
            self._leases,
            me=self.node,
            algorithm=self._algorithm,
            now=self._clock.now(),
            lease_timeout=self._lease_timeout,
            takeover=self._takeover,
        )
        self._watches[r] = watch
        if isinstance(decision, rules.ClaimRound):
            await self._close(r, decision.attempt)

    def _forget(self, r: int) -> None:
        self._ledger.unwatch(r)
        self._watches.pop(r, None)
        self._views.pop(r, None)
        # The round is committed: this node's snapshot of it is not read again.
        self._exchange.forget_written(keys.snapshot(r, self.node))

    async def _close(self, r: int, attempt: int) -> None:
        claim = Claim(node=self.node, nonce=new_nonce(), round=r, attempt=attempt)
        if not await self._exchange.claim(claim) and (
            await self._exchange.claim_at(r, attempt) is not None
        ):
            return
        # Won, or the key holds no valid claim (a forgery or garbage, reported): a claim only
        # spares duplicate work, and the create-only commit still commits the round once.
        event = TookOver if attempt > 0 else Claimed
        self._on_event(event(node=self.node, round=r, attempt=attempt))
        started = _wall.monotonic()
        try:
            made = await self._commit(r, attempt)
        except FormatError as exc:  # e.g. a payload key taken: report, and look again later
            self._exchange.reject(getattr(exc, "key", None) or keys.round_prefix(r), str(exc))
            made = None
        if made is None:
            await self._committed_meanwhile(r)
            return
        commit, params = made
        self._ledger.committed(commit, params)
        self._forget(r)
        if self._committed is not None:
            self._committed()
        self._on_event(
            Committed(
                node=self.node,
                round=r,
                fragment=commit.fragment,
                attempt=attempt,
                included=len(commit.included),
                samples=commit.samples,
                seconds=_wall.monotonic() - started,
            )
        )

    async def _committed_meanwhile(self, r: int) -> None:
        """After a close that committed nothing: when another closer committed the round
        (while this node stalled, say), record it so the round is not closed again."""
        try:
            commit = await self._exchange.commit(r)
        except FormatError as exc:
            self._exchange.reject(keys.commit(r), str(exc))
            return
        if commit is not None:
            self._ledger.committed(commit)
            self._forget(r)

    async def _commit(self, r: int, attempt: int) -> tuple[Commit, Tensors] | None:
        """Close round ``r``: the commit written, with its parameters as tensors, or None
        when there was nothing to include or another attempt committed first."""
        k = r % self._algorithm.fragments
        schema = self._manifest.fragment_schema(k)
        snapshots, deltas = await self._read_snapshots(r, schema)
        chosen, excluded = rules.include(self._algorithm, r, snapshots)
        clip = self._algorithm.clip
        norms: dict[str, float] = {}
        if robust.needs_norms(len(chosen), factor=self._outlier_factor, clip=clip):
            norms = {i.node: self._backend.norm(deltas[i.node]) for i in chosen}
            excluded += robust.outliers(
                chosen, norms, inner_steps=self._algorithm.inner_steps, factor=self._outlier_factor
            )
        for node, reason in excluded:
            self._exclude(r, node, reason)
        dropped = {node for node, _ in excluded}
        chosen = [i for i in chosen if i.node not in dropped]
        if not chosen:
            return None
        try:
            master, momentum = await self._outer_state(r, k)
        except ValueError as exc:  # FormatError, SchemaMismatch: a corrupt base; retried later
            self._exchange.reject(getattr(exc, "key", None) or keys.round_prefix(r), str(exc))
            return None
        weights = rules.outer_weights(self._algorithm, chosen, norms)
        if clip is not None:
            self._report_clips(r, chosen, norms, clip)
        gradient = self._backend.weighted_sum(
            [(w, deltas[i.node]) for w, i in zip(weights, chosen, strict=True)]
        )
        master, momentum = self._backend.outer_step(
            master,
            momentum,
            gradient,
            lr=self._algorithm.outer_lr,
            beta=self._algorithm.outer_momentum,
            nesterov=self._algorithm.nesterov,
        )
        nonce = new_nonce()
        cast = self._backend.cast(master, schema)
        params = self._backend.dump(cast)
        state = outer_state(self._backend, schema, master, momentum)
        params_ref = await self._exchange.write_payload(
            keys.params(r, nonce), params, self._compression
        )
        state_ref = await self._exchange.write_payload(
            keys.state(r, nonce), state, self._compression
        )
        commit = Commit(
            round=r,
            fragment=k,
            base_round=rules.previous_round(self._algorithm, r),
            closer=self.node,
            attempt=attempt,
            nonce=nonce,
            included=tuple(chosen),
            params=params_ref,
            state=state_ref,
        )
        if not await self._exchange.create_commit(commit):
            # Another attempt committed first: ours must leave no trace (Decision 2).
            await self._exchange.delete(params_ref.key)
            await self._exchange.delete(state_ref.key)
            return None
        self._keep(commit, master, momentum, schema)
        if rules.writes_head(self._algorithm, r):
            await self._exchange.put_head(k, r)
        # Superseded by ours: this node reads the new payloads from now on.
        before = self._ledger.commit(commit.base_round)
        if before is not None:
            self._exchange.forget_written(before.params.key, before.state.key)
        elif commit.base_round < 0:
            self._exchange.forget_written(self._manifest.init[k].key)
        await self._collect(r)
        return commit, cast

    def _exclude(self, r: int, node: str, reason: str) -> None:
        key = keys.snapshot(r, node)
        self._on_event(Excluded(node=self.node, round=r, key=key, reason=reason))

    def _report_clips(
        self, r: int, chosen: list[Included], norms: dict[str, float], clip: float
    ) -> None:
        """A ``Clipped`` event for each delta the outer weights scale down (``outer_weights``)."""
        inner_steps = self._algorithm.inner_steps
        scales = robust.clip_scales(chosen, norms, inner_steps=inner_steps, clip=clip)
        for node, factor in sorted(scales.items()):
            if factor < 1.0:
                key = keys.snapshot(r, node)
                self._on_event(Clipped(node=self.node, round=r, key=key, factor=factor))

    async def _read_snapshots(
        self, r: int, schema: Schema
    ) -> tuple[list[tuple[str, Snapshot]], dict[str, Tensors]]:
        snapshots: list[tuple[str, Snapshot]] = []
        deltas: dict[str, Tensors] = {}
        limit = payload_limit(schema)
        bound = robust.snapshot_bound(schema)
        for node, size in (await self._exchange.snapshot_sizes(r)).items():
            too_big = robust.oversized(size, bound)
            if too_big is not None:
                self._exclude(r, node, too_big)
                continue
            try:
                found = await self._exchange.snapshot(r, node, limit=limit)
                if found is None:
                    continue
                record, payload = found
                own = self._ledger.own(r) if node == self.node else None
                if own is not None and (record.nonce, record.digest) == (own.nonce, own.digest):
                    # This node's own payload (its digest verified or its bytes compared):
                    # decoding it would give back the very delta the learner encoded.
                    deltas[node] = own.delta
                else:
                    deltas[node] = self._backend.decode(payload, schema)
            except ValueError as exc:  # FormatError, SchemaMismatch, NonFinite
                self._exclude(r, node, str(exc))
                continue
            snapshots.append((node, record))
        return snapshots, deltas

    def _keep(self, commit: Commit, master: Tensors, momentum: Tensors, schema: Schema) -> None:
        """Keep the outer state ``commit`` stored, as tensors, for the fragment's next outer
        step: reading it back would be the store's bytes of exactly these tensors."""
        self._kept.pop(commit.fragment, None)
        size = 2 * schema.f32.nbytes()
        limit = self._exchange.written_limit
        if size > limit:
            return
        while self._kept and sum(kept.size for kept in self._kept.values()) + size > limit:
            self._kept.popitem(last=False)
        self._kept[commit.fragment] = _Kept(
            round=commit.round, nonce=commit.nonce, master=master, momentum=momentum, size=size
        )

    async def _outer_state(self, r: int, k: int) -> tuple[Tensors, Tensors | None]:
        """F32 master parameters and momentum the round's outer step starts from."""
        previous = rules.previous_round(self._algorithm, r)
        before = None
        if previous >= 0:
            before = self._ledger.commit(previous) or await self._exchange.commit(previous)
            if before is None:
                raise FormatError(f"round {r}'s base round {previous} has no commit")
            kept = self._kept.get(k)
            if kept is not None and (kept.round, kept.nonce) == (before.round, before.nonce):
                return kept.master, kept.momentum  # our own commit: what its payloads hold
        state = await read_base(self._exchange, self._backend, self._manifest, k, before)
        if state is not None:
            return state
        if before is None:
            raise FormatError("initial parameters are gone", key=self._manifest.init[k].key)
        raise FormatError("outer state is gone", key=before.state.key)

    async def _collect(self, r: int) -> None:
        if self._keep_rounds is None:
            return
        old = rules.collectable(self._algorithm, r, keep=self._keep_rounds)
        if old is None:
            return
        for key in await self._exchange.list_keys(keys.round_prefix(old)):
            if _collectable_key(key):
                await self._exchange.delete(key)


def _collectable_key(key: str) -> bool:
    """Whether garbage collection may delete ``key`` of a collectable round: everything but
    the commit record and the claims (tiny, and what keeps a closer that stalled past the
    collection from winning a claim again and audit from losing who closed the round).
    Anything else under the round's prefix goes, garbage included."""
    try:
        kind = keys.parse(key).kind
    except FormatError:
        return True
    return kind not in ("commit", "claim")
