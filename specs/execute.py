"""The world's executor: what each effect of the core rules does to a world, the counterpart of
the shell's executors (``gradientmail._node``) over the world's mailbox.

Every protocol decision stays in the rules; this module only reads and writes objects, routes
messages between a node's loops, and keeps the ghost state the invariants read (commit
writes, snapshot sample spans). A create can be given a fault ``outcome``: "lost" (the first
try did not land; the executor's retry goes on at once and may find the key taken: the
exchange then reports it ambiguous) or "ambiguous" (it landed, and the answer was lost).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any

from gradientmail.core import effects as fx
from gradientmail.core import keys
from gradientmail.core.identity import derived
from gradientmail.core.leases import lease_md5
from gradientmail.core.records import Claim, Lease, Manifest, PayloadRef, Snapshot
from gradientmail.core.tensors import ParameterSpec, Schema
from specs.mailbox import (
    DIGEST,
    Forged,
    Payload,
    SnapObj,
    commit_at,
    lease_size,
    manifest_at,
    snapshot_at,
)
from specs.state import NodeState, World

__all__ = ["WRITES", "execute", "run_schema"]

WRITES = (
    fx.Upload,
    fx.RenewLease,
    fx.CreateClaim,
    fx.OuterStep,
    fx.CreateCommit,
    fx.PutHead,
    fx.Delete,
    fx.WriteInit,
    fx.CreateManifest,
)
"""Effects that write to the mailbox: a ``write``-grain step ends after the call that makes
one."""

CREATES: dict[type, str] = {
    fx.Upload: "snapshot",
    fx.CreateClaim: "claim",
    fx.CreateCommit: "commit",
    fx.CreateManifest: "manifest",
}
"""Effects whose create a fault outcome applies to, and the kind of record each creates."""

Outcome = tuple[World, fx.Result | None]


@lru_cache(maxsize=64)
def run_schema(fragments: int) -> Schema:
    """The model every world's nodes train: one F32 parameter per fragment."""
    return Schema.of(ParameterSpec(name=f"p{k}", dtype="F32", shape=(1,)) for k in range(fragments))


def execute(world: World, i: int, effect: fx.Effect, outcome: str) -> Outcome:
    """The world after node ``i`` carries out ``effect``, and its result."""
    handler = _HANDLERS.get(type(effect))
    if handler is None:  # a report: it changes nothing in the world
        return world, None
    return handler(world, i, effect, outcome)


def _name(world: World, i: int) -> str:
    return world.config.names[i]


def _create(world: World, key: str, obj: Any, nonce: str, outcome: str) -> tuple[World, fx.Created]:
    """A create of a record carrying ``nonce``, with the exchange's retry and read-back."""
    found = world.mailbox.get(key)
    if outcome == "ok":
        if found is not None:
            return world, fx.Created(key=key, outcome="taken")
        return world._replace(mailbox=world.mailbox.put(key, obj)), fx.Created(
            key=key, outcome="created"
        )
    world = world._replace(faults=world.faults + 1)
    if outcome == "lost" and found is None:  # the retry lands
        return world._replace(mailbox=world.mailbox.put(key, obj)), fx.Created(
            key=key, outcome="created"
        )
    if found is None:  # ambiguous: the first try landed, its answer was lost
        world = world._replace(mailbox=world.mailbox.put(key, obj))
        found = obj
    return world, fx.Created(key=key, outcome="ambiguous", nonce=_nonce_of(found))


def _nonce_of(obj: Any) -> str | None:
    if isinstance(obj, SnapObj):
        return obj.record.nonce
    return getattr(obj, "nonce", None)


# -- the learner loop ----------------------------------------------------------------------


def _upload(world: World, i: int, upload: fx.Upload, outcome: str) -> Outcome:
    node = world.node(i)
    job = next(j for j in node.jobs if j.round == upload.round)
    node = node._replace(jobs=tuple(j for j in node.jobs if j is not job))
    world = world.with_node(i, node)
    me = _name(world, i)
    record = _snapshot(me, job.nonce, job.round, job.base, job.hi - job.lo, job.steps)
    obj = SnapObj(record=record, epoch=node.epoch, lo=job.lo, hi=job.hi)
    # The first of its snapshot keys not squatted, or the one another incarnation's holds
    # (core.slots).
    key, _ = snapshot_at(world.mailbox, job.round, me)
    before = world.mailbox.get(key)
    world, created = _create(world, key, obj, job.nonce, outcome)
    if before is None and world.mailbox.get(key) == obj:
        spans = (*world.spans, (job.nonce, (me, node.epoch, job.lo, job.hi)))
        world = world._replace(spans=tuple(sorted(spans)))
    return world, fx.Uploaded(round=upload.round, created=created)


@lru_cache(maxsize=65536)
def _snapshot(node: str, nonce: str, r: int, base: int, samples: int, steps: int) -> Snapshot:
    return Snapshot(
        node=node, nonce=nonce, round=r, base_round=base, samples=samples, steps=steps,
        digest=DIGEST,
    )  # fmt: skip


def _read_commit(world: World, i: int, read: fx.PollCommit | fx.ReadCommit, _: str) -> Outcome:
    _, found = commit_at(world.mailbox, read.round)
    return world, fx.CommitRead(round=read.round, commit=found)


def _read_head(world: World, i: int, read: fx.ReadHead, _: str) -> Outcome:
    found = world.mailbox.get(keys.head(read.fragment))
    return world, fx.HeadRead(
        fragment=read.fragment, round=found if isinstance(found, int) else None
    )


def _read_params(world: World, i: int, read: fx.ReadParams, _: str) -> Outcome:
    key = (
        read.commit.params.key
        if read.commit is not None
        else _manifest(world).init[read.fragment].key
    )
    present = key in world.mailbox
    return world, fx.ParamsRead(fragment=read.fragment, commit=read.commit, present=present)


def _deliver(world: World, i: int, deliver: fx.Deliver, _: str) -> Outcome:
    from specs.state import Ready

    node = world.node(i)
    ready = Ready(commit=deliver.commit, counted=deliver.counted)
    return world.with_node(i, node._replace(ready=(*node.ready, ready))), None


def _to_syncer(world: World, i: int, message: fx.Result, _: str) -> Outcome:
    return world.with_node(i, _send(world.node(i), "syncer", message)), None


def _to_learner(world: World, i: int, message: fx.Result, _: str) -> Outcome:
    return world.with_node(i, _send(world.node(i), "learner", message)), None


def _send(node: NodeState, loop: str, message: fx.Result) -> NodeState:
    target = node.loop(loop)
    if target is None or target.done:
        return node
    return node.with_loop(loop, target._replace(inbox=(*target.inbox, message)))


# -- the syncer loop -----------------------------------------------------------------------


def _renew(world: World, i: int, renew: fx.RenewLease, _: str) -> Outcome:
    key, lease = keys.lease(renew.lease.node), renew.lease
    before = world.mailbox.get(key)
    if lease.left and not (
        isinstance(before, Lease) and before.left and before.nonce == lease.nonce
    ):
        world = _left_after_uploads(world, i)
    return world._replace(mailbox=world.mailbox.put(key, lease)), None


def _left_after_uploads(world: World, i: int) -> World:
    """Decision 11, checked as a node's lease first says ``left``: each round it has a snapshot
    in flight for is committed, or holds that snapshot, so a closer that sees the lease
    ``left`` finds it. (A missed round's progress published after this is not waited for.)"""
    node, me = world.node(i), _name(world, i)
    if node.trainer is None:
        return world
    for fragment in node.trainer.fragments:
        r = fragment.outstanding
        if r is None or commit_at(world.mailbox, r)[1] is not None:
            continue
        _, found = snapshot_at(world.mailbox, r, me)
        if not (isinstance(found, SnapObj) and found.record.nonce == fragment.nonce):
            return world.flag(
                "left-after-uploads",
                f"n{i}'s lease says left before its snapshot of round {r} is uploaded, and "
                "the round is not committed",
            )
    return world


def _list_leases(world: World, i: int, _: fx.ListLeases, __: str) -> Outcome:
    entries = []
    for key, lease in world.mailbox.list(keys.LEASES):
        node = key[len(keys.LEASES) :]
        assert isinstance(lease, Lease)
        version = f"{lease.nonce}.{lease.counter}"
        # The world's leases are unsigned records; the MD5 is what S3 would list for them.
        entries.append((node, version, lease_size(lease), lease_md5(lease, None)))
    return world, fx.LeasesListed(entries=tuple(entries))


def _read_lease(world: World, i: int, read: fx.ReadLease, _: str) -> Outcome:
    return world, fx.LeaseRead(node=read.node, lease=world.mailbox.get(keys.lease(read.node)))  # type: ignore[arg-type]


def _list_snapshots(world: World, i: int, listing: fx.ListSnapshots, _: str) -> Outcome:
    found = (keys.parse(key) for key, _ in world.mailbox.list(keys.snapshots(listing.round)))
    sizes = tuple(sorted((p.node or "", p.slot or 0, 1) for p in found))
    return world, fx.SnapshotsListed(round=listing.round, sizes=sizes)


def _list_claims(world: World, i: int, listing: fx.ListClaims, _: str) -> Outcome:
    claims = tuple(obj for _, obj in world.mailbox.list(keys.claims(listing.round)))
    return world, fx.ClaimsRead(round=listing.round, claims=claims)  # type: ignore[arg-type]


def _create_claim(world: World, i: int, create: fx.CreateClaim, outcome: str) -> Outcome:
    claim = create.claim
    key = keys.claim(claim.round, claim.attempt)
    return _create(world, key, claim, claim.nonce, outcome)


def _read_claim(world: World, i: int, read: fx.ReadClaim, _: str) -> Outcome:
    found = world.mailbox.get(keys.claim(read.round, read.attempt))
    claim = found if isinstance(found, Claim) else None
    return world, fx.ClaimRead(round=read.round, attempt=read.attempt, claim=claim)


def _read_snapshot(world: World, i: int, read: fx.ReadSnapshot, _: str) -> Outcome:
    found = world.mailbox.get(keys.snapshot(read.round, read.node, read.slot))
    record = found.record if isinstance(found, SnapObj) else None
    rejected = "forged" if isinstance(found, Forged) else None
    return world, fx.SnapshotRead(
        round=read.round, node=read.node, slot=read.slot, record=record, rejected=rejected
    )


def _accumulate(world: World, i: int, add: fx.Accumulate, _: str) -> Outcome:
    norm = 1.0 if add.norm else None
    return world, fx.Accumulated(round=add.round, node=add.node, norm=norm)


def _read_outer_state(world: World, i: int, read: fx.ReadOuterState, _: str) -> Outcome:
    if read.base is not None:
        present = read.base.state.key in world.mailbox and read.base.params.key in world.mailbox
    else:
        present = _manifest(world).init[read.fragment].key in world.mailbox
    return world, fx.BaseRead(round=read.round, present=present)


def _outer_step(world: World, i: int, step: fx.OuterStep, _: str) -> Outcome:
    node = world.node(i)
    nonce = derived(_process(world, i), "payload", node.writes)
    world = world.with_node(i, node._replace(writes=node.writes + 1))
    refs = []
    for key in (keys.params(step.round, nonce), keys.state(step.round, nonce)):
        world = world._replace(mailbox=world.mailbox.put(key, Payload(key)))
        refs.append(PayloadRef(key=key, digest=DIGEST, size=1))
    return world, fx.Written(round=step.round, nonce=nonce, params=refs[0], state=refs[1])


def _create_commit(world: World, i: int, create: fx.CreateCommit, outcome: str) -> Outcome:
    commit = create.commit
    key, _ = commit_at(world.mailbox, commit.round)  # the first key not squatted (core.slots)
    before = world.mailbox.get(key)
    world, created = _create(world, key, commit, commit.nonce, outcome)
    if before is None and key in world.mailbox:
        world = world.wrote_commit(commit.round)
    return world, created


def _put_head(world: World, i: int, put: fx.PutHead, _: str) -> Outcome:
    return world._replace(mailbox=world.mailbox.put(keys.head(put.fragment), put.round)), None


def _list_round(world: World, i: int, listing: fx.ListRound, _: str) -> Outcome:
    found = tuple(key for key, _ in world.mailbox.list(keys.round_prefix(listing.round)))
    return world, fx.RoundListed(round=listing.round, keys=found)


def _delete(world: World, i: int, delete: fx.Delete, _: str) -> Outcome:
    mailbox = world.mailbox
    for key in delete.keys:
        mailbox = mailbox.delete(key)
    return world._replace(mailbox=mailbox), None


# -- join ----------------------------------------------------------------------------------


def _read_manifest(world: World, i: int, read: fx.ReadManifest, _: str) -> Outcome:
    _, found = manifest_at(world.mailbox)  # a forgery is garbage here: passed
    return world, fx.ManifestRead(manifest=found)


def _write_init(world: World, i: int, write: fx.WriteInit, _: str) -> Outcome:
    key = keys.init(write.fragment, derived(_process(world, i), "init", write.fragment))
    world = world._replace(mailbox=world.mailbox.put(key, Payload(key)))
    return world, fx.InitWritten(
        fragment=write.fragment, ref=PayloadRef(key=key, digest=DIGEST, size=1)
    )


def _create_manifest(world: World, i: int, create: fx.CreateManifest, outcome: str) -> Outcome:
    key, _ = manifest_at(world.mailbox)
    return _create(world, key, create.manifest, create.manifest.nonce, outcome)


def _manifest(world: World) -> Manifest:
    _, found = manifest_at(world.mailbox)
    assert found is not None
    return found


def _process(world: World, i: int) -> str:
    from specs.mailbox import nonce

    return nonce(i, world.node(i).epoch)


_HANDLERS: dict[type, Callable[[World, int, Any, str], Outcome]] = {
    fx.Upload: _upload,
    fx.PollCommit: _read_commit,
    fx.ReadCommit: _read_commit,
    fx.ReadHead: _read_head,
    fx.ReadParams: _read_params,
    fx.Deliver: _deliver,
    fx.Watch: _to_syncer,
    fx.Seen: _to_syncer,
    fx.Committed: _to_learner,
    fx.RenewLease: _renew,
    fx.ListLeases: _list_leases,
    fx.ReadLease: _read_lease,
    fx.ListSnapshots: _list_snapshots,
    fx.ListClaims: _list_claims,
    fx.CreateClaim: _create_claim,
    fx.ReadClaim: _read_claim,
    fx.ReadSnapshot: _read_snapshot,
    fx.Accumulate: _accumulate,
    fx.ReadOuterState: _read_outer_state,
    fx.OuterStep: _outer_step,
    fx.CreateCommit: _create_commit,
    fx.PutHead: _put_head,
    fx.ListRound: _list_round,
    fx.Delete: _delete,
    fx.ReadManifest: _read_manifest,
    fx.WriteInit: _write_init,
    fx.CreateManifest: _create_manifest,
}
"""Effects that change or read the world; the rest (reports, ``Forget``, ``Drop``: caches of
tensors the world does not model) change nothing."""
