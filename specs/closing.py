"""A node's syncer side as the shell runs it (shell/syncer.py), every decision taken by
``gradientmail.core.syncer``: look at a watched round and claim it when the rules say so, read
its snapshots, then commit it (create-only) and collect old rounds.

``claim`` is one pass of ``Syncer._round`` for one round, followed when the rules answer
``ClaimRound`` by the claim's create and the read of the round's snapshots (the closer's
work, volatile). ``commit`` writes the round record; the payloads were written with the
work. A closer whose commit create fails deletes its payloads, after reading the record back
when an earlier try may have landed (Decision 2).
"""

from __future__ import annotations

from functools import lru_cache

from gradientmail.core import keys
from gradientmail.core import syncer as rules
from gradientmail.core.records import Claim, Snapshot
from specs import bugs, learning
from specs.mailbox import ClaimObj, CommitObj, Inc, ParamsObj, SnapObj, nonce
from specs.state import Work, World

__all__ = ["OutOfBounds", "claim", "commit", "forget", "sync"]


class OutOfBounds(Exception):
    """The step would leave the explored bounds (a state constraint, not an error)."""


_DIGEST = "0" * 64


@lru_cache(maxsize=65536)
def snapshot_record(obj: SnapObj) -> Snapshot:
    """The real record of a model snapshot (its payload digest is a placeholder)."""
    return Snapshot(
        node=obj.node,
        nonce=nonce(int(obj.node[1:]), obj.epoch),
        round=obj.round,
        base_round=obj.base,
        samples=obj.samples,
        steps=obj.steps,
        digest=_DIGEST,
    )


@lru_cache(maxsize=65536)
def claim_record(obj: ClaimObj) -> Claim:
    return Claim(
        node=obj.node,
        nonce=nonce(int(obj.node[1:]), obj.epoch),
        round=obj.round,
        attempt=obj.attempt,
    )


def reporters(world: World, r: int) -> tuple[str, ...]:
    """The nodes listed under the round's snapshots (one LIST, key names only)."""
    return tuple(keys.parse(key).node or "" for key, _ in world.mailbox.list(keys.snapshots(r)))


def forget(world: World, i: int, r: int) -> World:
    node = world.node(i)
    node = node._replace(
        watched=tuple(x for x in node.watched if x != r),
        watches=tuple(w for w in node.watches if w.round != r),
        views=tuple(v for v in node.views if v[0] != r),
    )
    return world.with_node(i, node)


def sync(world: World, i: int) -> World:
    """One pass of the syncer's loop (``Syncer.tick``): renew the lease, observe every lease,
    look at each watched round in order until one is claimed (the pass then waits on that
    round's commit)."""
    world = learning.observe_leases(learning.renew(world, i), i)
    for r in world.node(i).watched:
        world = claim(world, i, r)
        if world.node(i).work is not None:
            break
    return world.with_node(i, world.node(i)._replace(synced=True))


def claim(world: World, i: int, r: int) -> World:
    """One look at round ``r`` (``rules.decide``); claim and read it when the rules say so."""
    config, node = world.config, world.node(i)
    if node.known_commit(r) is not None:
        return forget(world, i, r)
    watch = node.watch(r) or rules.RoundWatch(round=r)
    seen = node.view_of(r)
    views = node.views
    if watch.open_since is None or seen is None:
        seen = reporters(world, r)
        views = tuple(sorted((*(v for v in views if v[0] != r), (r, seen))))
    claims: tuple[Claim, ...] = ()
    if watch.open_since is not None:
        claims = tuple(
            claim_record(obj)
            for _, obj in world.mailbox.list(keys.claims(r))
            if isinstance(obj, ClaimObj)
        )
    previous = rules.previous_round(config.algorithm, r)
    view = rules.RoundView(
        round=r,
        reporters=seen,
        previous_reporters=node.known_commit(previous) if previous >= 0 else None,
        claims=claims,
    )
    watch, decision = bugs.decide(
        config, view, watch, node.leases, me=config.names[i], now=node.clock
    )
    watches = tuple(sorted((*(w for w in node.watches if w.round != r), watch), key=_round_of))
    world = world.with_node(i, node._replace(watches=watches, views=views))
    if isinstance(decision, rules.ClaimRound):
        return _close(world, i, r, decision.attempt)
    return world


def _round_of(watch: rules.RoundWatch) -> int:
    return watch.round


def _close(world: World, i: int, r: int, attempt: int) -> World:
    config, node = world.config, world.node(i)
    if attempt >= config.attempts:
        raise OutOfBounds(f"attempt {attempt} of round {r}")
    me = config.names[i]
    mailbox, won = world.mailbox.create(
        keys.claim(r, attempt), ClaimObj(node=me, epoch=node.epoch, round=r, attempt=attempt)
    )
    world = world._replace(mailbox=mailbox)
    if not won:
        return world
    read = []
    by_node: dict[str, SnapObj] = {}
    for key, obj in mailbox.list(keys.snapshots(r)):
        assert isinstance(obj, SnapObj)
        name = keys.parse(key).node or ""
        read.append((name, snapshot_record(obj)))
        by_node[name] = obj
    chosen, _excluded = rules.include(config.algorithm, r, read)
    if not chosen:
        return world
    included = []
    for inc in chosen:
        obj = by_node[inc.node]
        included.append(Inc(obj.node, obj.epoch, obj.base, obj.lo, obj.hi, obj.steps))
    work = Work(round=r, attempt=attempt, included=tuple(included))
    params = ParamsObj(round=r, closer=me, epoch=node.epoch, attempt=attempt)
    mailbox = mailbox.put(_record_of(world, i, work).params_key, params)
    return world.with_node(i, node._replace(work=work))._replace(mailbox=mailbox)


def _record_of(world: World, i: int, work: Work) -> CommitObj:
    node = world.node(i)
    return CommitObj(
        round=work.round,
        base=rules.previous_round(world.config.algorithm, work.round),
        closer=world.config.names[i],
        epoch=node.epoch,
        attempt=work.attempt,
        included=work.included,
    )


def commit(world: World, i: int, outcome: str) -> World:
    """Create the commit record of the node's work (``outcome`` as in ``upload``)."""
    node = world.node(i)
    assert node.work is not None
    work = node.work
    record = _record_of(world, i, work)
    key = keys.commit(work.round)
    existing = world.mailbox.get(key)
    if outcome != "ok":
        world = world._replace(faults=world.faults + 1)
        if outcome == "ambiguous" and existing is None:
            world = world._replace(mailbox=world.mailbox.put(key, record)).wrote_commit(work.round)
        return world.with_node(i, node._replace(work=work._replace(retried=True)))
    ours = existing is None or (
        work.retried and existing == record and not bugs.skips_readback(world.config)
    )
    if existing is None or (existing != record and bugs.commit_overwrites(world.config)):
        world = world._replace(mailbox=world.mailbox.put(key, record)).wrote_commit(work.round)
        ours = True
    node = node._replace(work=None)
    if not ours:
        # Another attempt committed first: ours must leave no trace (Decision 2).
        mailbox = world.mailbox.delete(record.params_key)
        return world.with_node(i, node)._replace(mailbox=mailbox)
    known = tuple(sorted((*node.known, (work.round, tuple(inc.node for inc in work.included)))))
    world = forget(world.with_node(i, node._replace(known=known)), i, work.round)
    return _collect(world, work.round)


def _collect(world: World, r: int) -> World:
    old = rules.collectable(world.config.algorithm, r)
    if old is None:
        return world
    mailbox = world.mailbox
    for key, _ in mailbox.list(keys.round_prefix(old)):
        if key != keys.commit(old):
            mailbox = mailbox.delete(key)
    return world._replace(mailbox=mailbox)
