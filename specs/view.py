"""The view of a world the explorer deduplicates on, its fingerprint and its symmetry.

The view drops history and normalizes time so the explored space is finite:

- virtual time itself is dropped (only clock skew is kept, when drift is on);
- every timestamp becomes an age on its owner's clock, capped just above the largest threshold
  the rules compare it with (``lease_timeout`` for a lease, ``grace`` for quorum,
  ``takeover * 2**a + (nodes - 1) * takeover`` for attempt ``a``'s claim, ...). Ages at or over
  the cap compare alike forever, so two worlds with the same view have the same futures: the
  abstraction is exact. A lease keeps two ages, both capped at ``lease_timeout``: at the
  observer's last poll (what expiry is judged at now) and at its clock (what the next poll
  judges);
- a lease's counter is dropped; an observer keeps only whether its last seen version is still
  the current one (the rules only ask whether the version changed);
- a node id becomes its index under a renaming, so node permutations can be canonicalized.

The fingerprint is blake2b over ``repr`` of the view, a nested tuple of ints, strings, bools
and None only, whose ``repr`` is stable across processes (never Python's salted ``hash``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from functools import partial
from itertools import permutations, product
from typing import Any

from gradientmail.core.learner import LearnerState
from gradientmail.core.leases import Leases
from gradientmail.core.syncer import RoundWatch
from specs.mailbox import (
    ClaimObj,
    CommitObj,
    LeaseObj,
    Mailbox,
    ManifestObj,
    ParamsObj,
    SnapObj,
)
from specs.state import RUNNING, NodeState, World

__all__ = ["canonical", "fingerprint", "view"]

Rename = tuple[int, ...]


def fingerprint(world: World, *, symmetry: bool = False) -> bytes:
    """16 bytes that equal exactly when the (canonical, with ``symmetry``) views are equal."""
    encoded = canonical(world) if symmetry else _encode(world, _identity(len(world.nodes)))
    return hashlib.blake2b(encoded.encode(), digest_size=16).digest()


def view(world: World, rename: Rename | None = None) -> tuple[Any, ...]:
    """The world as the explorer compares it, node ``i`` renamed ``rename[i]`` (the
    fingerprint encodes the same parts, reusing the encodings of unchanged ones)."""
    ren = rename if rename is not None else _identity(len(world.nodes))
    nodes = sorted((ren[i], _node(world, i, ren)) for i in range(len(world.nodes)))
    return (
        tuple(n for _, n in nodes),
        _mailbox(world.mailbox, ren),
        _counters(world),
    )


def canonical(world: World) -> str:
    """The smallest encoding of the view over node permutations (symmetry reduction).

    Nodes are first ordered by a name-free signature; only nodes with equal signatures are
    permuted among themselves, and the smallest encoding wins."""
    n = len(world.nodes)
    blind = tuple(0 for _ in range(n))
    versions = _lease_versions(world.mailbox)
    signatures = sorted((_node_text(world, i, blind, versions), i) for i in range(n))
    groups: list[list[int]] = []
    last = None
    for signature, i in signatures:
        if signature != last:
            groups.append([])
            last = signature
        groups[-1].append(i)
    best: str | None = None
    for choice in product(*(permutations(g) for g in groups)):
        order = [i for group in choice for i in group]
        ren = [0] * n
        for position, i in enumerate(order):
            ren[i] = position
        encoded = _encode(world, tuple(ren))
        if best is None or encoded < best:
            best = encoded
    assert best is not None
    return best


# Encodings of unchanged parts are reused: a successor shares most of its components with its
# parent (the same objects), so only what a step changed is encoded again. Each entry keeps its
# object alive, so an id() is never reused while its entry exists.
_TEXTS: dict[tuple[Any, ...], tuple[object, str]] = {}
_CACHE_LIMIT = 500_000


def _identity(n: int) -> Rename:
    return tuple(range(n))


def _cached(obj: object, key: tuple[Any, ...], compute: Callable[[], object]) -> str:
    full = (id(obj), *key)
    hit = _TEXTS.get(full)
    if hit is not None and hit[0] is obj:
        return hit[1]
    if len(_TEXTS) > _CACHE_LIMIT:
        _TEXTS.clear()
    text = repr(compute())
    _TEXTS[full] = (obj, text)
    return text


def _encode(world: World, ren: Rename) -> str:
    """``repr`` of the view's parts, joined: equal exactly when the views are equal."""
    order = sorted(range(len(world.nodes)), key=lambda i: ren[i])
    versions = _lease_versions(world.mailbox)
    parts = [_node_text(world, i, ren, versions) for i in order]
    parts.append(_cached(world.mailbox, ("M", ren), partial(_mailbox_text, world.mailbox, ren)))
    parts.append(repr(_counters(world)))
    return "\x00".join(parts)


def _node_text(world: World, i: int, ren: Rename, versions: object) -> str:
    node = world.nodes[i]
    if node.status != RUNNING:
        return repr((node.status, node.epoch))
    assert node.learner is not None
    clock, config = node.clock, world.config
    head = _head(world, node)
    parts = (
        repr(head),
        _cached(node.learner, ("l",), lambda: _learner(node.learner)),  # type: ignore[arg-type]
        _cached(node.ready, ("r", ren), lambda: tuple(_commit(c, ren) for c in node.ready)),
        _cached(node.known, ("k", ren), lambda: _known(node.known, ren)),
        _cached(
            node.leases, ("s", ren, versions, clock, config), lambda: _leases(world, node, ren)
        ),
        _cached(node.watches, ("w", clock, config), lambda: _watches(world, node)),
        _cached(node.views, ("v", ren), lambda: _known(node.views, ren)),
        repr(_work(node, ren)),
    )
    return "\x02".join(parts)


class _Text(str):
    """An encoding computed elsewhere, whose ``repr`` is itself (for ``_cached``)."""

    def __repr__(self) -> str:
        return str(self)


def _mailbox_text(mailbox: Mailbox, ren: Rename) -> _Text:
    entries = sorted(_cached(obj, ("m", ren), partial(_entry, obj, ren)) for obj in mailbox.values)
    return _Text("\x01".join(entries))


def _lease_versions(mailbox: Mailbox) -> tuple[tuple[str, str], ...]:
    return tuple(
        (key, obj.version) for key, obj in mailbox.list("leases/") if isinstance(obj, LeaseObj)
    )


def _counters(world: World) -> tuple[Any, ...]:
    return (world.crashes, world.faults, world.pauses, world.commit_writes, world.flags)


def _name(name: str, ren: Rename) -> int:
    return ren[int(name[1:])]


def _names(names: tuple[str, ...], ren: Rename) -> tuple[int, ...]:
    return tuple(sorted(_name(n, ren) for n in names))


def _age(now: int, stamp: float | None, cap: int) -> int | None:
    if stamp is None:
        return None
    return min(int(now - stamp), cap)


def _node(world: World, i: int, ren: Rename) -> tuple[Any, ...]:
    node = world.nodes[i]
    if node.status != RUNNING:
        return (node.status, node.epoch)
    assert node.learner is not None
    return (
        _head(world, node),
        _learner(node.learner),
        tuple(_commit(c, ren) for c in node.ready),
        _known(node.known, ren),
        _leases(world, node, ren),
        _watches(world, node),
        _known(node.views, ren),
        _work(node, ren),
    )


def _head(world: World, node: NodeState) -> tuple[Any, ...]:
    skew = node.clock - world.time if world.config.drift else 0
    return (
        node.status,
        node.epoch,
        skew,
        node.produced,
        tuple(tuple(job) for job in node.jobs),
        node.captured,
        node.next_poll,
        node.watched,
        node.leaving,
        node.synced,
        node.paused,
    )


def _known(pairs: tuple[tuple[int, tuple[str, ...]], ...], ren: Rename) -> tuple[Any, ...]:
    return tuple((r, _names(nodes, ren)) for r, nodes in pairs)


def _watches(world: World, node: NodeState) -> tuple[Any, ...]:
    return tuple(_watch(world, node.clock, w) for w in node.watches)


def _learner(state: LearnerState) -> tuple[Any, ...]:
    fragments = tuple(
        (
            f.merged,
            f.outstanding,
            f.published_at,
            f.in_flight_samples,
            f.in_flight_steps,
            f.samples,
            f.steps,
        )
        for f in state.fragments
    )
    return (state.step, state.slot, state.deferred, state.closing, fragments)


def _leases(world: World, node: NodeState, ren: Rename) -> tuple[Any, ...]:
    config = world.config
    leases: Leases = node.leases
    seen = []
    for name, observed in leases.seen:
        current = world.mailbox.get("leases/" + name)
        fresh = isinstance(current, LeaseObj) and current.version == observed.version
        epoch = int(observed.nonce[4:10], 16)
        age = _age(node.clock, observed.changed_at, config.lease_timeout)
        at_poll = _age(leases.polled_at or 0, observed.changed_at, config.lease_timeout)
        seen.append((_name(name, ren), fresh, observed.left, epoch, age, at_poll))
    return (tuple(sorted(seen)), leases.polled_at is not None)


def _watch(world: World, now: int, watch: RoundWatch) -> tuple[Any, ...]:
    config = world.config
    spread = (config.nodes - 1) * config.takeover
    claims = tuple(
        (a, _age(now, seen, config.takeover * 2**a + spread)) for a, seen in watch.claim_seen
    )
    return (
        watch.round,
        _age(now, watch.quorum_since, config.grace),
        _age(now, watch.open_since, spread),
        tuple(sorted(claims)),
    )


def _work(node: NodeState, ren: Rename) -> tuple[Any, ...] | None:
    if node.work is None:
        return None
    w = node.work
    included = tuple(sorted((_name(inc.node, ren), *inc[1:]) for inc in w.included))
    return (w.round, w.attempt, included, w.retried)


def _commit(c: CommitObj, ren: Rename) -> tuple[Any, ...]:
    included = tuple(sorted((_name(inc.node, ren), *inc[1:]) for inc in c.included))
    return (c.round, c.base, _name(c.closer, ren), c.epoch, c.attempt, included)


def _mailbox(mailbox: Mailbox, ren: Rename) -> tuple[Any, ...]:
    return tuple(sorted(repr(_entry(obj, ren)) for obj in mailbox.values))


def _entry(obj: object, ren: Rename) -> tuple[Any, ...]:
    if isinstance(obj, SnapObj):
        return ("snap", obj.round, _name(obj.node, ren), obj.epoch, *obj[3:])
    if isinstance(obj, ClaimObj):
        return ("claim", obj.round, obj.attempt, _name(obj.node, ren), obj.epoch)
    if isinstance(obj, CommitObj):
        return ("commit", obj.round, _commit(obj, ren))
    if isinstance(obj, ParamsObj):
        return ("params", obj.round, _name(obj.closer, ren), obj.epoch, obj.attempt)
    if isinstance(obj, LeaseObj):
        return ("lease", 0, _name(obj.node, ren), obj.epoch, obj.left)
    assert isinstance(obj, ManifestObj)
    return ("manifest", 0)
