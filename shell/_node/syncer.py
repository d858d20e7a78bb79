"""The syncer loop's executor: it carries out what ``core.syncer`` and ``core.closing`` decide.

It keeps each round's workspace while this node closes it: the snapshot payload read last, the
F32 sum of the deltas added so far (one delta decoded at a time), the outer state the step starts
from, and after the step the parameters it wrote. A closer's own snapshot is
taken from what its learner encoded when the stored bytes are the very ones it published, and
the outer state of the last commit it wrote of a fragment is kept in memory (within the
exchange's budget for what the node wrote) for the fragment's next step: both are what reading
the store would give. Every ``if`` here is about I/O and those caches.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs

from gradientmail._events import (
    Callback,
    Claimed,
    Clipped,
    Committed,
    Excluded,
    LeaseExpired,
    TookOver,
)
from gradientmail._node import spill
from gradientmail._node.drive import Inbox, Loop
from gradientmail._node.exchange import Exchange
from gradientmail._node.handoff import Handover
from gradientmail._node.learner import UNTRUSTED, read_commit
from gradientmail._node.payloads import add_to_sum, outer_state, read_base, scaled
from gradientmail._node.release import release_memory
from gradientmail._node.spill import Base, SpilledBase
from gradientmail.adapters.base import Backend, Tensors
from gradientmail.core import effects as fx
from gradientmail.core import keys, syncer
from gradientmail.core.codecs import Compression
from gradientmail.core.payloads import all_f32, payload_limit
from gradientmail.core.records import Commit, Snapshot
from gradientmail.core.robust import snapshot_bound
from gradientmail.core.tensors import Schema, TensorBytes

__all__ = ["SyncerLoop"]


@attrs.define(eq=False)
class _Workspace:
    """One round's tensors while this node closes it: the snapshot read last (its payload,
    or the delta its learner handed over when it is this node's own), the snapshots fetched
    ahead of their turn (``ReadSnapshot.ahead``) and the sum."""

    waiting: tuple[str, Mapping[str, TensorBytes] | None, Tensors | None] | None = None
    ahead: dict[tuple[str, int], fx.SnapshotRead | tuple[Snapshot, Mapping[str, TensorBytes]]] = (
        attrs.field(factory=dict)
    )
    sum: Tensors | None = None
    master: Base | None = None
    momentum: Base | None = None
    params: Tensors | None = None
    stepped: tuple[Tensors, Tensors] | None = None
    """The master and momentum the outer step left (tensors in memory)."""


@attrs.frozen(kw_only=True)
class _Kept:
    """The F32 master parameters and momentum of a commit this node wrote, as its outer step
    left them: the next outer step of the fragment starts from them when it is this node's.

    With F32 parameters the master is the very tensors handed to the learner, its base until
    it merges a newer commit of the fragment: kept by weak reference, it costs nothing and is
    gone once the learner lets go. Otherwise the master is held (``master``). The momentum is
    held while the budget allows (``size``: the bytes this entry holds). When the learner keeps
    its base in a file (``spill``) and the state does not fit, the momentum goes to a file of
    its own, and so does the master unless the parameters are F32 (then it is the learner's
    file of them, ``Handover.base``): ``size`` 0."""

    round: int
    nonce: str
    master: Base | None
    shared: dict[str, weakref.ref[Any]] | None
    momentum: Base | None
    size: int

    def base(self) -> Base | None:
        """The master, or None when the learner has let go of it (or holds it in a file)."""
        if self.master is not None:
            return self.master
        if self.shared is None:
            return None
        found = {name: ref() for name, ref in self.shared.items()}
        return None if any(t is None for t in found.values()) else found


class SyncerLoop(Loop[syncer.SyncerState]):
    """Keeps the lease, watches the rounds and closes them until stopped: the executor of
    ``core.syncer.step``."""

    def __init__(
        self,
        *,
        settings: syncer.Settings,
        state: syncer.SyncerState,
        exchange: Exchange,
        backend: Backend,
        compression: Compression,
        handover: Handover,
        inbox: Inbox,
        learner: Inbox,
        nonces: Callable[[], str],
        on_event: Callback,
        learner_spills: bool = False,
        spill_dir: str | None = None,
    ) -> None:
        self.settings = settings
        self.state = state
        self.inbox = inbox
        # Whether the learner keeps its base in a file: then a master handed to it is not
        # held there, and is kept here as its own tensors when it fits (``_keep_state``).
        self._learner_spills = learner_spills
        self._spill_dir = spill_dir
        self._exchange = exchange
        self._backend = backend
        self._compression = compression
        self._handover = handover
        self._learner = learner
        self._nonces = nonces
        self._on_event = on_event
        self._manifest = settings.manifest
        self._node = settings.node
        self._work: dict[int, _Workspace] = {}
        self._kept: OrderedDict[int, _Kept] = OrderedDict()
        self._handlers: dict[type, Callable[[Any], Awaitable[fx.Result | None]]] = {
            fx.RenewLease: self._renew,
            fx.ListLeases: self._list_leases,
            fx.ReadLease: self._read_lease,
            fx.ListSnapshots: self._list_snapshots,
            fx.ListClaims: self._list_claims,
            fx.CreateClaim: self._create_claim,
            fx.ReadClaim: self._read_claim,
            fx.ReadSnapshot: self._read_snapshot,
            fx.Accumulate: self._accumulate,
            fx.ReadOuterState: self._read_outer_state,
            fx.OuterStep: self._outer_step,
            fx.CreateCommit: self._create_commit,
            fx.Committed: self._committed,
            fx.ReadCommit: self._read_commit,
            fx.PutHead: self._put_head,
            fx.ListRound: self._list_round,
            fx.Delete: self._delete,
            fx.Forget: self._forget,
            fx.Drop: self._drop,
            fx.Claimed: self._claimed,
            fx.Excluded: self._excluded,
            fx.Clipped: self._clipped,
            fx.Expired: self._expired,
            fx.Rejected: self._reject,
        }

    name = "syncer"
    rule = staticmethod(syncer.step)
    # The lease is renewed and the leases listed beside the rounds' work (drive): a close's
    # slow read never delays a renewal, and a LIST never delays a close.
    aside = frozenset({fx.RenewLease, fx.ListLeases, fx.ReadLease})
    latest = frozenset({fx.RenewLease})

    def _work_of(self, r: int) -> _Workspace:
        return self._work.setdefault(r, _Workspace())

    # -- leases -------------------------------------------------------------------------

    async def _renew(self, renew: fx.RenewLease) -> None:
        await self._exchange.put_lease(renew.lease)

    async def _list_leases(self, _: fx.ListLeases) -> fx.Result:
        infos = await self._exchange.lease_infos()
        entries = tuple(
            (node, info.version, info.size, info.md5) for node, info in sorted(infos.items())
        )
        return fx.LeasesListed(entries=entries)

    async def _read_lease(self, read: fx.ReadLease) -> fx.Result:
        try:
            return fx.LeaseRead(node=read.node, lease=await self._exchange.lease(read.node))
        except UNTRUSTED as exc:
            return fx.LeaseRead(node=read.node, lease=None, rejected=str(exc))

    # -- a round's view -----------------------------------------------------------------

    async def _list_snapshots(self, listing: fx.ListSnapshots) -> fx.Result:
        found = await self._exchange.snapshot_slots(listing.round)
        sizes = tuple(
            (node, slot, size) for node, keys_of in sorted(found.items()) for slot, size in keys_of
        )
        return fx.SnapshotsListed(round=listing.round, sizes=sizes)

    async def _list_claims(self, listing: fx.ListClaims) -> fx.Result:
        claims = tuple(await self._exchange.claims(listing.round))
        return fx.ClaimsRead(round=listing.round, claims=claims)

    async def _read_commit(self, read: fx.ReadCommit) -> fx.Result:
        return await read_commit(self._exchange, read.round, verify=read.verify)

    # -- a close --------------------------------------------------------------------------

    async def _create_claim(self, create: fx.CreateClaim) -> fx.Result:
        return await self._exchange.claim(create.claim)

    async def _read_claim(self, read: fx.ReadClaim) -> fx.Result:
        claim = await self._exchange.claim_at(read.round, read.attempt)
        return fx.ClaimRead(round=read.round, attempt=read.attempt, claim=claim)

    async def _read_snapshot(self, read: fx.ReadSnapshot) -> fx.Result:
        r, node, slot = read.round, read.node, read.slot
        work = self._work_of(r)
        work.waiting = None
        schema = self._manifest.fragment_schema(r % self._manifest.algorithm.fragments)
        own = self._handover.own(r) if node == self._node else None
        if own is not None and own.key == keys.snapshot(r, node, slot):
            # The key this node's learner created its snapshot at: the object there is that
            # record (create-only), and its delta is in hand. Not read back (docs/decisions.md,
            # "A closer does not read back its own snapshot").
            work.waiting = (node, None, own.delta)
            return fx.SnapshotRead(round=r, node=node, slot=slot, record=own.record)
        found = work.ahead.pop((node, slot), None)
        if found is None:
            # This key and the next ones the close names, fetched together; the others kept
            # for their turn (those of this node are its own, in hand).
            later = [k for k in read.ahead if k[0] != self._node and k not in work.ahead]
            fetched = await self._exchange.clock.gather(
                *(self._fetch_snapshot(r, n, s, schema) for n, s in [(node, slot), *later])
            )
            found = fetched[0]
            work.ahead.update(zip(later, fetched[1:], strict=True))
        for k in [k for k in work.ahead if k not in read.ahead]:
            del work.ahead[k]  # fetched for a read the close no longer makes
        if isinstance(found, fx.SnapshotRead):
            return found
        record, payload = found
        work.waiting = (node, payload, None)
        return fx.SnapshotRead(round=r, node=node, slot=slot, record=record)

    async def _fetch_snapshot(
        self, r: int, node: str, slot: int, schema: Schema
    ) -> fx.SnapshotRead | tuple[Snapshot, Mapping[str, TensorBytes]]:
        """The verified snapshot at ``node``'s key ``slot`` of ``r`` and its payload, or the
        result that reports it gone or rejected."""
        limit, bound = payload_limit(schema), snapshot_bound(schema)
        try:
            found = await self._exchange.snapshot(r, node, slot=slot, limit=limit, bound=bound)
        except UNTRUSTED as exc:
            return fx.SnapshotRead(round=r, node=node, slot=slot, record=None, rejected=str(exc))
        if found is None:
            return fx.SnapshotRead(round=r, node=node, slot=slot, record=None)
        return found

    async def _accumulate(self, add: fx.Accumulate) -> fx.Result:
        r, node = add.round, add.node
        work = self._work_of(r)
        assert work.waiting is not None and work.waiting[0] == node
        _, payload, own = work.waiting
        work.waiting = None
        if add.start:
            work.sum = None
        schema = self._manifest.fragment_schema(r % self._manifest.algorithm.fragments)
        try:
            delta = own if payload is None else self._backend.decode(payload, schema)
        except UNTRUSTED as exc:
            return fx.Accumulated(round=r, node=node, rejected=str(exc))
        del payload
        assert delta is not None
        if own is not None:
            # The learner's delta is the sum's from here on (the outer step computes into
            # it); a second pass or another close reads the snapshot from the store.
            self._handover.drop_own(r)
        del own
        norm = self._backend.norm(delta) if add.norm else None
        work.sum = add_to_sum(self._backend, work.sum, delta, add.weight, owned=True)
        return fx.Accumulated(round=r, node=node, norm=norm)

    async def _read_outer_state(self, read: fx.ReadOuterState) -> fx.Result:
        base, k = read.base, read.fragment
        kept = self._kept.get(k)
        ours = (
            base is not None
            and kept is not None
            and (kept.nonce, kept.round) == (base.nonce, base.round)
        )
        found = kept.base() if kept is not None and ours else None  # our own commit's
        if found is None and all_f32(self._manifest.fragment_schema(k)):
            # F32 parameters are the master: the learner's file of them (of the initial ones
            # for a fragment's first round), when it holds it.
            found = self._handover.base(k, base)
        master: Base
        momentum: Base | None
        if found is not None and kept is not None and ours and kept.momentum is not None:
            master, momentum = found, kept.momentum
        else:  # from the store: the momentum only, when the master is in hand
            try:
                state = await read_base(
                    self._exchange, self._backend, self._manifest, k, base, master=found
                )
            except UNTRUSTED as exc:
                return fx.BaseRead(round=read.round, present=False, rejected=str(exc))
            if state is None:
                return fx.BaseRead(round=read.round, present=False)
            master, momentum = state
        work = self._work_of(read.round)
        work.master, work.momentum = master, momentum
        return fx.BaseRead(round=read.round, present=True)

    async def _outer_step(self, step: fx.OuterStep) -> fx.Result:
        r, k = step.round, step.fragment
        work = self._work_of(r)
        assert work.master is not None
        algorithm = self._manifest.algorithm
        schema = self._manifest.fragment_schema(k)
        assert work.sum is not None
        gradient = scaled(self._backend, work.sum, step.scale)
        work.sum = None
        # The step computes into the momentum and the gradient (fresh from the weighted sum),
        # so the kept copy of this fragment's state is spent: a lost commit reads it again.
        kept = self._kept.get(k)
        if (
            kept is not None
            and kept.momentum is work.momentum
            and not isinstance(kept.momentum, SpilledBase)  # a file is only read
        ):
            del self._kept[k]
        master, momentum = spill.outer_step(
            self._backend,
            work.master,
            work.momentum,
            gradient,
            lr=algorithm.outer_lr,
            beta=algorithm.outer_momentum,
            nesterov=algorithm.nesterov,
            reuse=True,
        )
        del gradient
        work.master = work.momentum = None
        work.stepped = master, momentum
        work.params = self._backend.cast(master, schema)
        nonce = self._nonces()
        try:
            # Lent, not copied (nothing writes these tensors before the payloads are stored),
            # and not remembered by the exchange: the learner is handed the parameters and
            # this loop keeps the outer state (``_keep_state``), as tensors. The two are
            # written at once: a close waits on one write's time, not two.
            params, state = await self._exchange.clock.gather(
                self._exchange.write_payload(
                    keys.params(r, nonce),
                    self._backend.lend(work.params),
                    self._compression,
                    remember=False,
                ),
                self._exchange.write_payload(
                    keys.state(r, nonce),
                    outer_state(self._backend, schema, master, momentum),
                    self._compression,
                    remember=False,
                ),
            )
        except UNTRUSTED as exc:  # a payload key taken: report, and look again later
            return fx.Written(round=r, nonce=nonce, params=None, state=None, failed=str(exc))
        return fx.Written(round=r, nonce=nonce, params=params, state=state)

    async def _create_commit(self, create: fx.CreateCommit) -> fx.Result:
        params = self._work_of(create.commit.round).params
        if params is not None:
            # Handed over before the commit exists, so that a learner that reads the commit
            # at once finds its parameters here; a lost race takes them back (``_delete``).
            self._handover.put_params(create.commit, params)
        return await self._exchange.create_commit(create.commit)

    async def _committed(self, committed: fx.Committed) -> None:
        commit = committed.commit
        work = self._work_of(commit.round)
        assert work.stepped is not None and work.params is not None
        # The commit stands: the learner and the callbacks hear of it first, and the outer
        # state is kept after (in a file when the learner spills: a write of the fragment's
        # momentum that the merge need not wait for).
        self._learner.put(committed)
        self._on_event(
            Committed(
                node=self._node,
                round=commit.round,
                fragment=commit.fragment,
                attempt=commit.attempt,
                included=len(commit.included),
                samples=commit.samples,
                seconds=committed.seconds,
            )
        )
        self._keep_state(commit, *work.stepped, work.params)
        work.stepped = None  # kept (or not) by now
        release_memory()  # the step's temporaries are spent

    def _keep_state(
        self, commit: Commit, master: Tensors, momentum: Tensors, params: Tensors
    ) -> None:
        """Keep the outer state ``commit`` stored, as tensors, for the fragment's next outer
        step: reading it back would be the store's bytes of exactly these tensors. The master
        is kept by weak reference when it is the parameters handed to the learner (F32
        parameters) and the learner holds them as its base (it does not spill); what is held
        stays within the exchange's budget, oldest out first. When the learner keeps its base
        in a file, a state that does not fit goes to files (``_Kept``)."""
        k = commit.fragment
        self._kept.pop(k, None)
        shared = not self._learner_spills and all(params[n] is t for n, t in master.items())
        schema = self._manifest.fragment_schema(k)
        nbytes = schema.f32.nbytes()
        size = nbytes if shared else 2 * nbytes
        limit = self._exchange.written_limit
        for j in list(self._kept) if size <= limit else []:  # make room, oldest first; a
            if self._held() + size <= limit:  # shared master stays, and so do files
                break
            if self._kept[j].size == 0:
                continue
            old = self._kept[j]
            if old.shared is not None:
                self._kept[j] = attrs.evolve(old, momentum=None, size=0)
            else:
                del self._kept[j]
        fits = self._held() + size <= limit
        if shared:
            refs = {n: weakref.ref(t) for n, t in master.items()}
            self._kept[k] = _Kept(
                round=commit.round,
                nonce=commit.nonce,
                master=None,
                shared=refs,
                momentum=momentum if fits else None,
                size=size if fits else 0,
            )
        elif fits:
            self._kept[k] = _Kept(
                round=commit.round,
                nonce=commit.nonce,
                master=master,
                shared=None,
                momentum=momentum,
                size=size,
            )
        elif self._learner_spills:
            # No room for the files: nothing is kept, and the next close reads the state back.
            with contextlib.suppress(OSError):
                self._kept[k] = _Kept(
                    round=commit.round,
                    nonce=commit.nonce,
                    master=None if all_f32(schema) else self._spill(master),
                    shared=None,
                    momentum=self._spill(momentum),
                    size=0,
                )

    def _spill(self, tensors: Tensors) -> SpilledBase:
        return spill.spill(self._backend, tensors, self._spill_dir)

    def _held(self) -> int:
        """Bytes the kept outer states hold."""
        return sum(kept.size for kept in self._kept.values())

    async def _put_head(self, put: fx.PutHead) -> None:
        await self._exchange.put_head(put.fragment, put.round)

    async def _list_round(self, listing: fx.ListRound) -> fx.Result:
        found = await self._exchange.list_keys(keys.round_prefix(listing.round))
        return fx.RoundListed(round=listing.round, keys=tuple(found))

    async def _delete(self, delete: fx.Delete) -> None:
        for key in delete.keys:
            parsed = keys.parse(key)
            if parsed.kind == "params" and parsed.round is not None and parsed.nonce:
                self._handover.drop_params(parsed.round, parsed.nonce)
            await self._exchange.delete(key)

    async def _forget(self, forget: fx.Forget) -> None:
        self._exchange.forget_written(*forget.keys)
        for key in forget.keys:
            parsed = keys.parse(key)
            if parsed.kind == "snapshot" and parsed.round is not None:
                self._handover.drop_own(parsed.round)

    async def _drop(self, drop: fx.Drop) -> None:
        if self._work.pop(drop.round, None) is not None:
            release_memory()  # the round's sum, step and payloads are spent

    # -- reports --------------------------------------------------------------------------

    async def _claimed(self, claimed: fx.Claimed) -> None:
        event = TookOver if claimed.attempt > 0 else Claimed
        self._on_event(event(node=self._node, round=claimed.round, attempt=claimed.attempt))

    async def _excluded(self, excluded: fx.Excluded) -> None:
        key = keys.snapshot(excluded.round, excluded.node, excluded.slot)
        self._on_event(
            Excluded(node=self._node, round=excluded.round, key=key, reason=excluded.reason)
        )

    async def _clipped(self, clipped: fx.Clipped) -> None:
        key = keys.snapshot(clipped.round, clipped.node, clipped.slot)
        self._on_event(
            Clipped(node=self._node, round=clipped.round, key=key, factor=clipped.factor)
        )

    async def _expired(self, expired: fx.Expired) -> None:
        self._on_event(LeaseExpired(observer=self._node, node=expired.node))

    async def _reject(self, reject: fx.Rejected) -> None:
        self._exchange.reject(reject.key, reject.reason)
