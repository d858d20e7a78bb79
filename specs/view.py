"""The view of a world the explorer deduplicates on, and its fingerprint.

The view drops history and normalizes time so the explored space is finite:

- virtual time itself is dropped (only each node's clock skew is kept, when drift is on);
- every time a node keeps (a lease's last change, a round's timers, a loop's deadline, a
  renewal or poll that is due) becomes its distance from the node's own clock, capped at
  ``Config.cap`` either way: above every threshold a rule compares a time with, and their sums,
  so two worlds whose times differ only beyond the cap have the same futures;
- a lease's counter is dropped: the mailbox keeps each lease's nonce and ``left`` flag, and
  an observer whether the version it last saw (or listed, or rejected) is still the current
  one, and how many renewals behind the current one a counter it judged or listed is, capped
  past ``Config.renewals_ahead`` (the rules recognize that many renewals from a listing);
- records keep what the rules read of them; a manifest is its creator and nonce.

The fingerprint is blake2b over ``repr`` of the view, a nested tuple of ints, floats, strings,
bools and None only, whose ``repr`` is stable across processes (never Python's salted
``hash``). Encodings of unchanged parts are reused by identity, down to each record and state
nested in a node's loops (a successor shares all but a few of them with its parent), and so is
the ``repr`` of each node's and the mailbox's: an encoding that read no time and no lease
version is kept once for every node, the rest per node clock and lease versions. (Reusing
them made the explorer about 15% faster; tests/specs/test_world.py checks every fingerprint
against the view encoded afresh.)
"""

from __future__ import annotations

import hashlib
import itertools
import math
from typing import Any

import attrs

from gradientmail.core import keys
from gradientmail.core.algorithm import DiLoCo
from gradientmail.core.effects import LeasesListed
from gradientmail.core.leases import Keeper, Leases
from gradientmail.core.records import Claim, Commit, Included, Lease, Manifest, Snapshot
from specs.config import Config
from specs.mailbox import Forged, Mailbox, Payload, SnapObj
from specs.state import NodeState, World

__all__ = ["fingerprint", "view"]


def fingerprint(world: World) -> bytes:
    """16 bytes that equal exactly when the views are equal: blake2b of ``repr(view(world))``,
    built from the ``repr`` of each part, kept beside the part's encoding."""
    versions = _versions(world.mailbox)
    text = _text(
        [
            _text([_node_text(world, node, versions) for node in world.nodes]),
            _repr(_mailbox(world.mailbox)),
            _repr(world.spans),
            repr(_ghosts(world)),
            repr(world.config.cap),
        ]
    )
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def view(world: World) -> tuple[Any, ...]:
    """The world as the explorer compares it."""
    versions = _versions(world.mailbox)
    nodes = tuple(_node(world, node, versions) for node in world.nodes)
    return (nodes, _mailbox(world.mailbox), world.spans, _ghosts(world), world.config.cap)


def _ghosts(world: World) -> tuple[Any, ...]:
    return (world.crashes, world.faults, world.pauses, world.forgeries, world.commit_writes,
            world.flags)  # fmt: skip


def _text(parts: list[str]) -> str:
    """``repr`` of the tuple whose items' ``repr`` are ``parts``."""
    return f"({parts[0]},)" if len(parts) == 1 else "(" + ", ".join(parts) + ")"


def _repr(part: Any) -> str:
    """``repr(part)`` of a cached part (an encoding, or a world's spans), made once."""
    return _cached(part, "repr", lambda: repr(part))  # type: ignore[no-any-return]


def _versions(mailbox: Mailbox) -> dict[str, str]:
    """Each lease's current version (``nonce.counter``, as the world lists it)."""
    return _cached(
        mailbox,
        1,
        lambda: {
            key[len(keys.LEASES) :]: f"{lease.nonce}.{lease.counter}"
            for key, lease in mailbox.list(keys.LEASES)
            if isinstance(lease, Lease)
        },
    )


# Encodings of unchanged parts are reused: a successor shares most of its parts with its
# parent (the same objects), down to the records and states nested in a loop. An encoding that
# read no time and no lease version is the same under every coder, and is kept once
# (``_PLAIN``); the rest are kept per coder (its clock, cap and lease versions: the salt).
# Each entry keeps its object alive, so an id() is never reused while its entry exists.
_CACHE: dict[tuple[int, object], tuple[object, object]] = {}
_PLAIN: dict[int, tuple[object, object]] = {}
_LIMIT = 1_500_000


def _cached(obj: object, salt: object, compute: Any) -> Any:
    key = (id(obj), salt)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is obj:
        return hit[1]
    if len(_CACHE) + len(_PLAIN) > _LIMIT:
        _clear()
    value = compute()
    _CACHE[key] = (obj, value)
    return value


def _node(world: World, node: NodeState, versions: dict[str, str]) -> Any:
    return _node_coded(world, node, versions, _salt(world.config, node.clock, versions))


def _node_coded(world: World, node: NodeState, versions: dict[str, str], salt: int) -> Any:
    key = (id(node), salt)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is node:
        return hit[1]
    config = world.config
    skew = node.clock - world.time if config.drift else 0
    coder = _Coder(
        node.clock, config.cap, versions, config.renewals_ahead, None if config.exact else config,
        salt,
    )  # fmt: skip
    if len(_CACHE) + len(_PLAIN) > _LIMIT:
        _clear()
    encode = coder.encode
    # The node with its clock as 0 (every time in it is already relative to the clock).
    encoded = (skew, *map(encode, node[:_CLOCK]), 0, *map(encode, node[_CLOCK + 1 :]))
    _CACHE[key] = (node, encoded)
    return encoded


_CLOCK = NodeState._fields.index("clock")


def _node_text(world: World, node: NodeState, versions: dict[str, str]) -> str:
    """``repr(_node(...))``, kept beside the node under its salt: most nodes of a successor
    are its parent's, under the same clock and lease versions."""
    salt = _salt(world.config, node.clock, versions)
    key = (id(node), salt, "repr")
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is node:
        return hit[1]  # type: ignore[no-any-return]
    text = repr(_node_coded(world, node, versions, salt))
    _CACHE[key] = (node, text)
    return text


def _clear() -> None:
    """Forget every kept encoding (the caches hold their objects alive)."""
    _CACHE.clear()
    _PLAIN.clear()


_SALTS: dict[tuple[int, int, int], tuple[Config, dict[str, str], int]] = {}
# Each distinct (clock, settings, lease versions) gets a number of its own, never reused: a
# hash of them could, rarely, let two of them share cached encodings.
_SALT_NUMBERS: dict[tuple[object, ...], int] = {}
_NEXT_SALT = itertools.count(1)


def _salt(config: Config, clock: int, versions: dict[str, str]) -> int:
    """What a node's encodings depend on besides the node (its clock, the view's settings and
    the current lease versions: ``versions`` is one dict per mailbox) as one number, looked up
    once per clock and mailbox."""
    key = (id(config), id(versions), clock)
    hit = _SALTS.get(key)
    if hit is not None and hit[0] is config and hit[1] is versions:
        return hit[2]
    coded = (config.exact, config.renewals_ahead, config.lease_every, config.lease_timeout)
    inputs = (clock, config.cap, coded, tuple(sorted(versions.items())))
    salt = _SALT_NUMBERS.get(inputs)
    if salt is None:
        if len(_SALT_NUMBERS) > _LIMIT // 8:
            _SALT_NUMBERS.clear()  # the numbers already given stay unique: the count goes on
        salt = _SALT_NUMBERS[inputs] = next(_NEXT_SALT)
    if len(_SALTS) > _LIMIT // 8:
        _SALTS.clear()
    _SALTS[key] = (config, versions, salt)
    return salt


def _mailbox(mailbox: Mailbox) -> Any:
    coder = _Coder(0.0, 0, {}, salt=0)
    return _cached(mailbox, 0, lambda: tuple((k, coder.object(v)) for k, v in mailbox.items()))


_FIELDS: dict[type, tuple[str, ...]] = {}


class _Coder:
    """Encodes a node's state: times relative to its ``clock``, capped at ``cap``; lease
    versions as whether they are the current ones (``versions``)."""

    def __init__(
        self,
        clock: float,
        cap: int,
        versions: dict[str, str],
        ahead: int = 0,
        config: Config | None = None,
        salt: object = 0,
    ) -> None:
        self.clock = clock
        self.cap = cap
        self.versions = versions
        self.ahead = ahead
        self._config = config  # None: the exact view (every time kept up to the cap)
        self.salt = salt  # stands for all of the above in the cache
        self.reads = 0  # times, lease versions and settings read so far

    @property
    def config(self) -> Config | None:
        self.reads += 1
        return self._config

    def age(self, at: float, bound: float) -> float:
        """How long ago ``at`` was on this clock, capped at ``bound`` (inf: never)."""
        self.reads += 1
        if math.isinf(at):
            return math.inf
        return min(bound, round(self.clock - at, 6))

    def fresh(self, node: str, version: str) -> bool:
        self.reads += 1
        return self.versions.get(node) == version

    def lag(self, node: str, version: str) -> int | None:
        """How many renewals the lease listed now is past ``version`` (``nonce.counter``),
        capped where ``leases.renewal`` stops recognizing them; None for another process's."""
        self.reads += 1
        nonce, _, counter = self.versions.get(node, "").partition(".")
        seen_nonce, _, seen = version.partition(".")
        if nonce != seen_nonce or not counter or not seen:
            return None
        return max(-1, min(int(counter) - int(seen), self.ahead + 1))

    def object(self, obj: object) -> Any:
        if isinstance(obj, SnapObj | Payload | Forged | int):
            return repr(obj)
        return self.encode(obj)

    def encode(self, value: Any) -> Any:
        """``value`` as nested tuples; every float is a time (records and states of the core
        hold no other float the explorer reaches). A composite value's encoding is cached by
        identity: once for every coder if it read nothing of this one (``reads``)."""
        kind = type(value)
        if value is None or kind is int or kind is str or kind is bool:
            return value
        if kind is float:
            if math.isinf(value):
                return value
            self.reads += 1
            return min(self.cap, max(-self.cap, round(value - self.clock, 6)))
        key = id(value)
        hit = _PLAIN.get(key)
        if hit is not None and hit[0] is value:
            return hit[1]
        hit = _CACHE.get((key, self.salt))
        if hit is not None and hit[0] is value:
            self.reads += 1  # what contains it depends on this coder too
            return hit[1]
        if len(_CACHE) + len(_PLAIN) > _LIMIT:
            _clear()
        before = self.reads
        encoded = self._encode(value)
        if self.reads == before:
            _PLAIN[key] = (value, encoded)
        else:
            _CACHE[(key, self.salt)] = (value, encoded)
        return encoded

    def _encode(self, value: Any) -> Any:
        special = _SPECIAL.get(type(value))
        if special is not None:
            return special(self, value)
        if isinstance(value, bool | int | str):
            return value
        if isinstance(value, tuple | list):
            return tuple(map(self.encode, value))
        if isinstance(value, frozenset | set):
            return tuple(sorted(map(self.encode, value), key=repr))
        cls = type(value)
        names = _FIELDS.get(cls)
        if names is None:
            if not attrs.has(cls):
                raise TypeError(f"the view cannot encode a {cls.__name__}")
            names = _FIELDS[cls] = tuple(a.name for a in attrs.fields(cls))
        return (cls.__name__, *(self.encode(getattr(value, n)) for n in names))


def _lease(coder: _Coder, lease: Lease) -> Any:
    return ("lease", lease.node, lease.nonce, lease.left)


def _leases(coder: _Coder, leases: Leases) -> Any:
    config = coder.config
    if config is None:
        seen = tuple(
            (n, coder.fresh(n, o.version), o.left, o.nonce, coder.encode(o.changed_at))
            for n, o in leases.seen
        )
        return ("leases", seen, coder.encode(leases.polled_at))
    # The rules read a lease's age only against lease_timeout (``Leases.expired``, ``live``,
    # ``active``): expired at the last LIST or not, and for the next LIST how long ago the
    # version was first seen, which past lease_timeout means expired at any later LIST. So
    # each age is kept up to lease_timeout, and the time of the last LIST not at all.
    timeout = float(config.lease_timeout)
    polled = leases.polled_at
    seen = tuple(
        (
            n,
            coder.fresh(n, o.version),
            o.left,
            o.nonce,
            polled is not None and polled - o.changed_at >= timeout,
            coder.age(o.changed_at, timeout),
        )
        for n, o in leases.seen
    )
    return ("leases", seen, polled is None)


def _keeper(coder: _Coder, keeper: Keeper) -> Any:
    fresh = coder.fresh
    config = coder.config
    if config is None:
        listed: Any = (coder.encode(keeper.listed_at), coder.encode(keeper.next_observation))
    else:
        # The next LIST is due once the last is ``lease_cadence`` old: lease_every / 2, the
        # explorer's only finite cadence, or never (inf). ``next_observation`` is set again
        # from ``listed_at`` at every syncer step before it is read (``leases.watch``).
        listed = coder.age(keeper.listed_at, config.lease_every / 2)
    return (
        "keeper",
        coder.encode(keeper.next_renewal),
        listed,
        keeper.leaving,
        keeper.renewing,
        _leases(coder, keeper.view),
        tuple(
            (
                n,
                fresh(n, k.version),
                coder.lag(n, f"{k.nonce}.{k.counter}"),
                k.left,
                k.nonce,
                tuple(nonce for nonce, _ in k.others),
            )
            for n, k in keeper.known
        ),
        tuple((n, fresh(n, v)) for n, v in keeper.rejected),
        None
        if keeper.listing is None
        else tuple((n, fresh(n, e[0]), e[1], e[2]) for n, e in keeper.listing),
        tuple((n, fresh(n, e[0]), e[1]) for n, e in keeper.waiting),
        tuple(sorted(keeper.expired)),
    )


def _listed(coder: _Coder, listed: LeasesListed) -> Any:
    entries = tuple(
        (n, coder.fresh(n, v), coder.lag(n, v), size) for n, v, size, _ in listed.entries
    )
    return ("listed", entries)


def _manifest(coder: _Coder, manifest: Manifest) -> Any:
    return ("manifest", manifest.creator, manifest.nonce)


def _commit(coder: _Coder, commit: Commit) -> Any:
    # A commit's nonce is its writer's alone (one per payload write): it stands for the record.
    return ("commit", commit.round, commit.nonce)


def _snapshot(coder: _Coder, snapshot: Snapshot) -> Any:
    return ("snapshot", snapshot.node, snapshot.nonce, snapshot.round)


def _claim(coder: _Coder, claim: Claim) -> Any:
    return ("claim", claim.node, claim.nonce, claim.round, claim.attempt)


def _included(coder: _Coder, included: Included) -> Any:
    return ("included", included.node, included.nonce)


_SPECIAL: dict[type, Any] = {
    Lease: _lease,
    Leases: _leases,
    Keeper: _keeper,
    LeasesListed: _listed,
    Manifest: _manifest,
    Commit: _commit,
    Snapshot: _snapshot,
    Claim: _claim,
    Included: _included,
    DiLoCo: lambda coder, _: "algorithm",
}
