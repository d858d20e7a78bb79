"""The records a run writes, as immutable values with canonical JSON.

Every object in the mailbox is an envelope (``envelope`` module) whose record is one of these,
serialized as canonical JSON (sorted keys, no spaces) with ``format`` and ``kind`` fields. A
record is validated when constructed, so an invalid one cannot exist; ``from_bytes`` turns any
malformed, foreign or future-format record into a ``FormatError``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cached_property
from typing import Any, ClassVar, TypeVar

import attrs

from gradientmail.core import keys
from gradientmail.core.algorithm import DiLoCo
from gradientmail.core.errors import FormatError
from gradientmail.core.fragments import Partition, fragment_schema
from gradientmail.core.signing import SIGNATURE_FIELD, Keyring
from gradientmail.core.tensors import Schema

__all__ = [
    "Claim",
    "Commit",
    "Included",
    "Lease",
    "Manifest",
    "PayloadRef",
    "Snapshot",
    "canonical",
    "read_record",
    "to_bytes",
]

FORMAT = 1
R = TypeVar("R")


def canonical(value: object) -> bytes:
    """Canonical JSON: sorted keys, no whitespace, UTF-8; equal values give equal bytes."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _digest(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not (isinstance(value, str) and len(value) == 64 and set(value) <= set("0123456789abcdef")):
        raise ValueError(f"{attribute.name} must be a SHA-256 hex digest, got {value!r}")


def _count(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{attribute.name} must be a non-negative integer, got {value!r}")


def _positive(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    _count(instance, attribute, value)
    if value == 0:
        raise ValueError(f"{attribute.name} must be positive")


def _round(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not -1 <= value <= keys.MAX_ROUND:
        raise ValueError(f"{attribute.name} must be a round in -1..{keys.MAX_ROUND}, got {value!r}")


def _attempt(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    _count(instance, attribute, value)
    if value > keys.MAX_ATTEMPT:  # type: ignore[operator]
        raise ValueError(f"{attribute.name} must be at most {keys.MAX_ATTEMPT}, got {value!r}")


def _fragment(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    _count(instance, attribute, value)
    if value > keys.MAX_FRAGMENT:  # type: ignore[operator]
        raise ValueError(f"{attribute.name} must be at most {keys.MAX_FRAGMENT}, got {value!r}")


def _node(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    keys.check_node(value)  # type: ignore[arg-type]


def _nonce(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    keys.check_nonce(value)  # type: ignore[arg-type]


@attrs.frozen(kw_only=True)
class PayloadRef:
    """Where a payload object lies, its SHA-256 and its size in bytes."""

    key: str
    digest: str = attrs.field(validator=_digest)
    size: int = attrs.field(validator=_count)

    def __attrs_post_init__(self) -> None:
        keys.parse(self.key)

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "digest": self.digest, "size": self.size}

    @classmethod
    def from_json(cls, value: object) -> PayloadRef:
        return cls(**_fields(value, {"key": str, "digest": str, "size": int}))


@attrs.frozen(kw_only=True)
class Manifest:
    """The run: its schema, algorithm, fragment partition and initial parameters.

    The manifest is create-only and written after the init payloads it names, so it *is* the
    initial commit (round -1) of every fragment.
    """

    KIND: ClassVar[str] = "manifest"
    nonce: str = attrs.field(validator=_nonce)
    creator: str = attrs.field(validator=_node)
    schema: Schema
    algorithm: DiLoCo
    fragments: Partition
    init: tuple[PayloadRef, ...]
    signed: bool = False

    def __attrs_post_init__(self) -> None:
        from gradientmail.core.fragments import check

        try:
            check(self.schema, self.fragments)
        except ValueError as exc:
            raise ValueError(f"manifest: {exc}") from None
        if len(self.fragments) != self.algorithm.fragments:
            raise ValueError(
                f"manifest: {len(self.fragments)} fragment groups for "
                f"algorithm.fragments={self.algorithm.fragments}"
            )
        if len(self.init) != len(self.fragments):
            raise ValueError("manifest: one init payload per fragment is required")
        for k, ref in enumerate(self.init):
            parsed = keys.parse(ref.key)
            if parsed.kind != "init" or parsed.fragment != k:
                raise ValueError(f"manifest: init payload {k} is at {ref.key!r}")

    @property
    def schema_digest(self) -> str:
        return self.schema.digest()

    def fragment_schema(self, fragment: int) -> Schema:
        return self._fragment_schemas[fragment]

    @cached_property
    def _fragment_schemas(self) -> tuple[Schema, ...]:
        # Built once: a closer and its learner ask for one every round.
        return tuple(fragment_schema(self.schema, names) for names in self.fragments)

    def to_json(self) -> dict[str, Any]:
        return {
            "nonce": self.nonce,
            "creator": self.creator,
            "schema": self.schema.to_json(),
            "schema_digest": self.schema_digest,
            "algorithm": self.algorithm.to_json(),
            "fragments": [list(g) for g in self.fragments],
            "init": [ref.to_json() for ref in self.init],
            "signed": self.signed,
        }

    @classmethod
    def from_json(cls, value: object) -> Manifest:
        raw = _fields(
            value,
            {
                "nonce": str,
                "creator": str,
                "schema": list,
                "schema_digest": str,
                "algorithm": dict,
                "fragments": list,
                "init": list,
                "signed": bool,
            },
        )
        schema = _wrap(Schema.from_json, raw["schema"])
        if schema.digest() != raw["schema_digest"]:
            raise FormatError("manifest schema does not match its digest")
        groups = raw["fragments"]
        if not all(isinstance(g, list) and all(isinstance(n, str) for n in g) for g in groups):
            raise FormatError("manifest fragments must be lists of parameter names")
        return cls(
            nonce=raw["nonce"],
            creator=raw["creator"],
            schema=schema,
            algorithm=DiLoCo.from_json(raw["algorithm"]),
            fragments=tuple(tuple(g) for g in groups),
            init=tuple(PayloadRef.from_json(ref) for ref in raw["init"]),
            signed=raw["signed"],
        )


@attrs.frozen(kw_only=True)
class Lease:
    """A node's liveness, overwritten by its owner: ``counter`` grows with every renewal,
    ``nonce`` is per process (a restart is a new nonce), ``left`` says it released the lease."""

    KIND: ClassVar[str] = "lease"
    node: str = attrs.field(validator=_node)
    nonce: str = attrs.field(validator=_nonce)
    counter: int = attrs.field(validator=_count)
    left: bool = False

    def to_json(self) -> dict[str, Any]:
        # "left" is written only when true (the form leases have always had): observers
        # recognize a renewal or a release from the MD5 of these exact bytes (core.leases).
        found = {"node": self.node, "nonce": self.nonce, "counter": self.counter}
        return found | {"left": True} if self.left else found

    @classmethod
    def from_json(cls, value: object) -> Lease:
        spec: dict[str, type] = {"node": str, "nonce": str, "counter": int}
        if isinstance(value, dict) and "left" in value:
            spec["left"] = bool
        return cls(**_fields(value, spec))


@attrs.frozen(kw_only=True)
class Snapshot:
    """One node's delta for a round: ``base_round`` is the commit it is measured from,
    ``samples`` and ``steps`` what was trained for it, ``digest`` the payload's SHA-256."""

    KIND: ClassVar[str] = "snapshot"
    node: str = attrs.field(validator=_node)
    nonce: str = attrs.field(validator=_nonce)
    round: int = attrs.field(validator=_round)
    base_round: int = attrs.field(validator=_round)
    samples: int = attrs.field(validator=_positive)
    steps: int = attrs.field(validator=_positive)
    digest: str = attrs.field(validator=_digest)

    def __attrs_post_init__(self) -> None:
        if self.round < 0 or self.base_round >= self.round:
            raise ValueError(f"snapshot of round {self.round} cannot have base {self.base_round}")

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, value: object) -> Snapshot:
        return cls(
            **_fields(
                value,
                {
                    "node": str,
                    "nonce": str,
                    "round": int,
                    "base_round": int,
                    "samples": int,
                    "steps": int,
                    "digest": str,
                },
            )
        )


@attrs.frozen(kw_only=True)
class Claim:
    """Who closes attempt ``attempt`` of round ``round``."""

    KIND: ClassVar[str] = "claim"
    node: str = attrs.field(validator=_node)
    nonce: str = attrs.field(validator=_nonce)
    round: int = attrs.field(validator=_round)
    attempt: int = attrs.field(validator=_attempt)

    def __attrs_post_init__(self) -> None:
        if self.round < 0:
            raise ValueError(f"a claim needs a round >= 0, got {self.round}")

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, value: object) -> Claim:
        return cls(**_fields(value, {"node": str, "nonce": str, "round": int, "attempt": int}))


@attrs.frozen(kw_only=True)
class Included:
    """A snapshot a commit averaged: who, which object (nonce, digest), and its weight."""

    node: str = attrs.field(validator=_node)
    nonce: str = attrs.field(validator=_nonce)
    samples: int = attrs.field(validator=_positive)
    steps: int = attrs.field(validator=_positive)
    base_round: int = attrs.field(validator=_round)
    digest: str = attrs.field(validator=_digest)

    @classmethod
    def of(cls, snapshot: Snapshot) -> Included:
        return cls(
            node=snapshot.node,
            nonce=snapshot.nonce,
            samples=snapshot.samples,
            steps=snapshot.steps,
            base_round=snapshot.base_round,
            digest=snapshot.digest,
        )

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, value: object) -> Included:
        spec = {
            "node": str,
            "nonce": str,
            "samples": int,
            "steps": int,
            "base_round": int,
            "digest": str,
        }
        return cls(**_fields(value, spec))


@attrs.frozen(kw_only=True)
class Commit:
    """The record that closes a round, written last and create-only: the round commits once.

    ``base_round`` is the fragment's previous commit (-1: the manifest's init), ``included`` the
    snapshots averaged (sorted by node), ``params`` and ``state`` the payloads it wrote.
    """

    KIND: ClassVar[str] = "commit"
    round: int = attrs.field(validator=_round)
    fragment: int = attrs.field(validator=_fragment)
    base_round: int = attrs.field(validator=_round)
    closer: str = attrs.field(validator=_node)
    attempt: int = attrs.field(validator=_attempt)
    nonce: str = attrs.field(validator=_nonce)
    included: tuple[Included, ...]
    params: PayloadRef
    state: PayloadRef

    def __attrs_post_init__(self) -> None:
        if not self.included:
            raise ValueError(f"commit of round {self.round} includes no snapshot")
        nodes = [i.node for i in self.included]
        if nodes != sorted(set(nodes)):
            raise ValueError(f"commit of round {self.round}: included nodes must be sorted, unique")
        if self.base_round >= self.round:
            raise ValueError(f"commit of round {self.round} cannot have base {self.base_round}")
        for kind, ref in (("params", self.params), ("state", self.state)):
            parsed = keys.parse(ref.key)
            if parsed.kind != kind or parsed.round != self.round:
                raise ValueError(f"commit of round {self.round}: {kind} at {ref.key!r}")

    @property
    def samples(self) -> int:
        return sum(i.samples for i in self.included)

    def includes(self, node: str, nonce: str | None = None) -> bool:
        return any(i.node == node and (nonce is None or i.nonce == nonce) for i in self.included)

    def to_json(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "fragment": self.fragment,
            "base_round": self.base_round,
            "closer": self.closer,
            "attempt": self.attempt,
            "nonce": self.nonce,
            "included": [i.to_json() for i in self.included],
            "params": self.params.to_json(),
            "state": self.state.to_json(),
        }

    @classmethod
    def from_json(cls, value: object) -> Commit:
        raw = _fields(
            value,
            {
                "round": int,
                "fragment": int,
                "base_round": int,
                "closer": str,
                "attempt": int,
                "nonce": str,
                "included": list,
                "params": dict,
                "state": dict,
            },
        )
        return cls(
            **{
                k: raw[k] for k in ("round", "fragment", "base_round", "closer", "attempt", "nonce")
            },
            included=tuple(Included.from_json(i) for i in raw["included"]),
            params=PayloadRef.from_json(raw["params"]),
            state=PayloadRef.from_json(raw["state"]),
        )


Record = Manifest | Lease | Snapshot | Claim | Commit
_KINDS: dict[str, Any] = {c.KIND: c for c in (Manifest, Lease, Snapshot, Claim, Commit)}


def to_bytes(record: Record, signer: Keyring | None = None) -> bytes:
    """The canonical JSON of ``record`` with its format version and kind; with ``signer``
    (a signed run), plus a ``signature`` field: the HMAC-SHA256 of the canonical JSON of
    every other field (``signing`` module)."""
    value: dict[str, Any] = {"format": FORMAT, "kind": record.KIND, **record.to_json()}
    if signer is not None:
        value[SIGNATURE_FIELD] = signer.sign(canonical(value))
    return canonical(value)


PARSED_BYTES = 4 * 2**20
"""The record bytes ``read_record`` keeps parsed records for (a cache, ``_Parsed``)."""

PARSED_LARGEST = 64 * 2**10
"""Records longer than this many bytes are parsed every time, never kept."""


class _Parsed:
    """Records already parsed, by the exact arguments that parsed them: the same bytes of the
    same kind at the same key under the same verifier parse to the same (immutable) record,
    so a node polling an unchanged object, or many simulated nodes reading one commit, parse
    it once. A failed parse is never kept. Once the records kept pass ``PARSED_BYTES`` bytes
    all are dropped at once (one assignment: threads that parse at once see either set, never
    a half-emptied one). Memoization only: what ``read_record`` returns or raises does not
    depend on it."""

    def __init__(self) -> None:
        self._records: dict[tuple[bytes, type, str | None, Keyring | None], object] = {}
        self._bytes = 0

    def get(self, entry: tuple[bytes, type, str | None, Keyring | None]) -> object | None:
        return self._records.get(entry)

    def keep(self, entry: tuple[bytes, type, str | None, Keyring | None], record: object) -> None:
        if self._bytes > PARSED_BYTES:
            self._records, self._bytes = {}, 0
        self._records[entry] = record
        self._bytes += len(entry[0])


_PARSED = _Parsed()


def read_record(
    data: bytes, kind: type[R], *, key: str | None = None, verifier: Keyring | None = None
) -> R:
    """Parse canonical JSON written by ``to_bytes`` as a record of ``kind``.

    Raises ``FormatError`` naming ``key`` for anything else: bad JSON, another format version,
    another kind, missing or mistyped fields, or values the record's validation refuses. With
    ``verifier`` (a signed run) the record must carry a signature by one of its secrets, else
    ``FormatError`` says it is unsigned or badly signed; without one a signature is ignored.
    """
    if len(data) > PARSED_LARGEST:
        return _read_record(data, kind, key=key, verifier=verifier)
    entry = (bytes(data), kind, key, verifier)
    found = _PARSED.get(entry)
    if found is None:
        found = _read_record(data, kind, key=key, verifier=verifier)
        _PARSED.keep(entry, found)
    return found  # type: ignore[return-value]


def _read_record(
    data: bytes, kind: type[R], *, key: str | None = None, verifier: Keyring | None = None
) -> R:
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, digits
        raise FormatError(f"record is not JSON ({exc})", key=key) from None
    if not isinstance(value, dict):
        raise FormatError("record must be a JSON object", key=key)
    version = value.get("format")
    if type(version) is not int or version != FORMAT:
        raise FormatError(f"record format {value.get('format')!r} is not {FORMAT}", key=key)
    expected = getattr(kind, "KIND", None)
    if value.get("kind") != expected:
        raise FormatError(f"expected a {expected} record, got {value.get('kind')!r}", key=key)
    signature = value.pop(SIGNATURE_FIELD, None)
    if verifier is not None:
        _verify(value, signature, verifier, key)
    body = {k: v for k, v in value.items() if k not in ("format", "kind")}
    try:
        record: R = kind.from_json(body)  # type: ignore[attr-defined]
    except FormatError as exc:
        raise FormatError(str(exc), key=key) from None
    except (ValueError, TypeError, KeyError) as exc:
        raise FormatError(f"invalid {expected} record: {exc}", key=key) from None
    return record


def _verify(value: dict[str, Any], signature: object, verifier: Keyring, key: str | None) -> None:
    if signature is None:
        raise FormatError("record is unsigned, but the run is signed", key=key)
    try:
        body = canonical(value)
    except (ValueError, RecursionError):  # NaN, Infinity: never written by to_bytes
        raise FormatError("record is not canonical JSON", key=key) from None
    if not verifier.verify(body, signature):
        raise FormatError(
            "bad signature: not signed with this run's secret (forged, altered, or written "
            "under a secret this node does not hold)",
            key=key,
        )


def _fields(value: object, spec: dict[str, type]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise FormatError(f"expected a JSON object, got {type(value).__name__}")
    missing = sorted(set(spec) - set(value))
    unknown = sorted(set(value) - set(spec))
    if missing or unknown:
        raise FormatError(f"fields missing {missing}, unknown {unknown}")
    for name, expected in spec.items():
        item = value[name]
        if not isinstance(item, expected) or (expected is int and isinstance(item, bool)):
            raise FormatError(f"field {name!r} must be {expected.__name__}, got {item!r}")
    return dict(value)


def _wrap(parse: Callable[[object], R], value: object) -> R:
    try:
        return parse(value)
    except ValueError as exc:
        raise FormatError(str(exc)) from None
