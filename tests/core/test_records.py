"""Records: canonical JSON round trips, and every malformed, foreign or invalid input refused
with a ``FormatError`` (from bytes) or ``ValueError`` (at construction)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradientmail.core import keys
from gradientmail.core.algorithm import DiLoCo
from gradientmail.core.errors import FormatError
from gradientmail.core.fragments import partition
from gradientmail.core.records import (
    Claim,
    Commit,
    Included,
    Lease,
    Manifest,
    PayloadRef,
    Record,
    Snapshot,
    canonical,
    read_record,
    to_bytes,
)
from gradientmail.core.tensors import ParameterSpec, Schema

NONCE = "0123456789abcdef"
OTHER = "fedcba9876543210"
DIGEST = "ab" * 32
KINDS: list[type[Any]] = [Manifest, Lease, Snapshot, Claim, Commit]

nodes = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=64)
nonces = st.text(alphabet="0123456789abcdef", min_size=16, max_size=16)
digests = st.binary(min_size=32, max_size=32).map(bytes.hex)
counts = st.integers(0, 2**63)
positive = st.integers(1, 2**40)


def schema() -> Schema:
    specs = [ParameterSpec(name=f"layers.{i}.w", dtype="F32", shape=(2, 3)) for i in range(4)]
    return Schema.of([*specs, ParameterSpec(name="embed", dtype="BF16", shape=(8,))])


def manifest(k: int = 2, *, signed: bool = False) -> Manifest:
    s = schema()
    return Manifest(
        nonce=NONCE,
        creator="node-a",
        schema=s,
        algorithm=DiLoCo(inner_steps=10, fragments=k),
        fragments=partition(s, k),
        init=tuple(PayloadRef(key=keys.init(i, NONCE), digest=DIGEST, size=24) for i in range(k)),
        signed=signed,
    )


def included(node: str = "a", **changes: Any) -> Included:
    fields: dict[str, Any] = {
        "node": node,
        "nonce": NONCE,
        "samples": 32,
        "steps": 10,
        "base_round": 1,
        "digest": DIGEST,
        **changes,
    }
    return Included(**fields)


def commit(**changes: Any) -> Commit:
    r = changes.get("round", 5)
    fields: dict[str, Any] = {
        "round": r,
        "fragment": 1,
        "base_round": 1,
        "closer": "a",
        "attempt": 0,
        "nonce": NONCE,
        "included": (included("a"), included("b")),
        "params": PayloadRef(key=keys.params(r, NONCE), digest=DIGEST, size=100),
        "state": PayloadRef(key=keys.state(r, NONCE), digest=DIGEST, size=200),
        **changes,
    }
    return Commit(**fields)


def snapshot(**changes: Any) -> Snapshot:
    fields: dict[str, Any] = {
        "node": "a",
        "nonce": NONCE,
        "round": 5,
        "base_round": 1,
        "samples": 64,
        "steps": 10,
        "digest": DIGEST,
        **changes,
    }
    return Snapshot(**fields)


EXAMPLES: list[Record] = [
    manifest(),
    manifest(1, signed=True),
    Lease(node="a", nonce=NONCE, counter=0),
    Lease(node="node-7", nonce=OTHER, counter=2**62, left=True),
    snapshot(),
    snapshot(round=0, base_round=-1),
    Claim(node="a", nonce=NONCE, round=3, attempt=0),
    commit(),
    commit(round=0, base_round=-1, fragment=0),
]


@pytest.mark.parametrize("record", EXAMPLES, ids=lambda r: type(r).__name__)
def test_every_record_round_trips_through_canonical_bytes(record: Record) -> None:
    data = to_bytes(record)
    assert read_record(data, type(record)) == record
    value = json.loads(data)
    assert value["format"] == 1 and value["kind"] == record.KIND
    assert data == canonical(value)
    assert b" " not in data and list(value) == sorted(value)


@st.composite
def snapshots(draw: st.DrawFn) -> Snapshot:
    r = draw(st.integers(0, keys.MAX_ROUND))
    return Snapshot(
        node=draw(nodes),
        nonce=draw(nonces),
        round=r,
        base_round=draw(st.integers(-1, r - 1)),
        samples=draw(positive),
        steps=draw(positive),
        digest=draw(digests),
    )


@st.composite
def commits(draw: st.DrawFn) -> Commit:
    r = draw(st.integers(0, 10**12))
    base = draw(st.integers(-1, r - 1))
    names = sorted(draw(st.lists(nodes, min_size=1, max_size=5, unique=True)))
    parts = [
        Included(
            node=n,
            nonce=draw(nonces),
            samples=draw(positive),
            steps=draw(positive),
            base_round=base,
            digest=draw(digests),
        )
        for n in names
    ]
    nonce = draw(nonces)
    return Commit(
        round=r,
        fragment=draw(st.integers(0, 100)),
        base_round=base,
        closer=draw(nodes),
        attempt=draw(st.integers(0, keys.MAX_ATTEMPT)),
        nonce=nonce,
        included=tuple(parts),
        params=PayloadRef(key=keys.params(r, nonce), digest=draw(digests), size=draw(counts)),
        state=PayloadRef(key=keys.state(r, nonce), digest=draw(digests), size=draw(counts)),
    )


leases = st.builds(Lease, node=nodes, nonce=nonces, counter=counts, left=st.booleans())
claims = st.builds(
    Claim,
    node=nodes,
    nonce=nonces,
    round=st.integers(0, keys.MAX_ROUND),
    attempt=st.integers(0, keys.MAX_ATTEMPT),
)
manifests = st.builds(manifest, st.integers(1, 5), signed=st.booleans())
records: st.SearchStrategy[Record] = st.one_of(leases, snapshots(), claims, commits(), manifests)


@given(records)
def test_random_records_round_trip(record: Record) -> None:
    assert read_record(to_bytes(record), type(record)) == record


def _read_any(data: bytes) -> None:
    """Read ``data`` as every kind; anything but a record of that kind must be a FormatError."""
    for kind in KINDS:
        try:
            record = read_record(data, kind, key="rounds/x")
        except FormatError as exc:
            assert exc.key == "rounds/x"
        else:
            assert isinstance(record, kind)


@given(st.binary(max_size=300))
def test_random_bytes_raise_only_format_error(data: bytes) -> None:
    _read_any(data)


@given(records, st.data())
def test_mutated_bytes_raise_only_format_error(record: Record, data: st.DataObject) -> None:
    raw = bytearray(to_bytes(record))
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(raw)))
        edit = data.draw(st.sampled_from(["replace", "insert", "delete", "truncate"]))
        byte = data.draw(st.integers(0, 255))
        if edit == "truncate":
            del raw[at:]
        elif edit == "insert":
            raw.insert(at, byte)
        elif at < len(raw):
            if edit == "delete":
                del raw[at]
            else:
                raw[at] = byte
    _read_any(bytes(raw))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


def _paths(value: object, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON value that a mutation may replace or drop."""
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            found += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found += _paths(v, (*prefix, i))
    return found


@given(records, st.data())
def test_json_level_mutations_raise_only_format_error(record: Record, data: st.DataObject) -> None:
    value = json.loads(to_bytes(record))
    path = data.draw(st.sampled_from(_paths(value)))
    parent = value
    for part in path[:-1]:
        parent = parent[part]
    edit = data.draw(st.sampled_from(["replace", "drop", "add"]))
    if edit == "replace":
        parent[path[-1]] = data.draw(json_values)
    elif edit == "drop":
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent[data.draw(st.text(min_size=1, max_size=8))] = data.draw(json_values)
    else:
        parent.append(data.draw(json_values))
    _read_any(json.dumps(value).encode())


def test_wrong_kind_is_refused_naming_the_key() -> None:
    data = to_bytes(Lease(node="a", nonce=NONCE, counter=1))
    with pytest.raises(FormatError, match="expected a snapshot record, got 'lease'") as info:
        read_record(data, Snapshot, key="leases/a")
    assert info.value.key == "leases/a" and "leases/a" in str(info.value)


@pytest.mark.parametrize("fmt", [0, 2, "1", None, [1], -1])
def test_other_format_versions_are_refused(fmt: object) -> None:
    value = {**json.loads(to_bytes(snapshot())), "format": fmt}
    with pytest.raises(FormatError, match=r"record format .* is not 1"):
        read_record(json.dumps(value).encode(), Snapshot)


def test_missing_format_is_refused() -> None:
    value = json.loads(to_bytes(snapshot()))
    del value["format"]
    with pytest.raises(FormatError, match="record format None"):
        read_record(json.dumps(value).encode(), Snapshot)


@pytest.mark.parametrize("fmt", [True, 1.0])
def test_format_must_be_the_integer_one(fmt: object) -> None:
    value = {**json.loads(to_bytes(snapshot())), "format": fmt}
    with pytest.raises(FormatError, match="format"):
        read_record(json.dumps(value).encode(), Snapshot)


@pytest.mark.parametrize(
    "data", [b"", b"{", b"\xff\xfe\x00", b"{'a': 1}", b"nul", b"[1,", b"\x00" * 8, b'{"a":1}x']
)
def test_bytes_that_are_not_json_are_refused_naming_the_key(data: bytes) -> None:
    with pytest.raises(FormatError, match="not JSON") as info:
        read_record(data, Lease, key="leases/a")
    assert info.value.key == "leases/a"


@pytest.mark.parametrize("data", [b"[]", b"1", b'"lease"', b"null", b"true"])
def test_json_that_is_not_an_object_is_refused(data: bytes) -> None:
    with pytest.raises(FormatError, match="JSON object"):
        read_record(data, Lease)


def test_deeply_nested_json_is_a_format_error() -> None:
    with pytest.raises(FormatError):
        read_record(b"[" * 100_000 + b"]" * 100_000, Lease)


def test_an_integer_too_long_to_parse_is_a_format_error() -> None:
    data = b'{"format":1,"kind":"lease","counter":' + b"1" * 5000 + b"}"
    with pytest.raises(FormatError):
        read_record(data, Lease)


def _fields_of(record: Record) -> list[tuple[str, object]]:
    return list(record.to_json().items())


FIELD_CASES = [(r, name) for r in EXAMPLES[::2] for name, _ in _fields_of(r)]


@pytest.mark.parametrize(
    ("record", "field"), FIELD_CASES, ids=[f"{type(r).__name__}.{f}" for r, f in FIELD_CASES]
)
def test_a_missing_field_is_refused_by_name(record: Record, field: str) -> None:
    value = json.loads(to_bytes(record))
    del value[field]
    with pytest.raises(FormatError, match=rf"missing \['{field}'\]"):
        read_record(canonical(value), type(record))


@pytest.mark.parametrize("record", EXAMPLES[::2], ids=lambda r: type(r).__name__)
def test_an_unknown_field_is_refused_by_name(record: Record) -> None:
    value = {**json.loads(to_bytes(record)), "extra_field": 1}
    with pytest.raises(FormatError, match=r"unknown \['extra_field'\]"):
        read_record(canonical(value), type(record))


def _wrong_values(example: object) -> list[object]:
    if isinstance(example, bool):
        return [0, 1, "true", None]
    if isinstance(example, int):
        return [True, False, "1", 1.5, float(example), None, [example]]
    if isinstance(example, str):
        return [1, None, [example], {"s": example}]
    if isinstance(example, list):
        return ["x", 1, None, {}]
    return ["x", 1, None, []]


TYPE_CASES = [
    (r, name, bad)
    for r in EXAMPLES[::2]
    for name, good in _fields_of(r)
    for bad in _wrong_values(good)
]


@pytest.mark.parametrize(
    ("record", "field", "bad"),
    TYPE_CASES,
    ids=[f"{type(r).__name__}.{f}={b!r}" for r, f, b in TYPE_CASES],
)
def test_a_mistyped_field_is_refused_by_name(record: Record, field: str, bad: object) -> None:
    value = {**json.loads(to_bytes(record)), field: bad}
    with pytest.raises(FormatError, match=field):
        read_record(canonical(value), type(record))


@pytest.mark.parametrize(
    ("path", "bad"),
    [
        (("included", 0, "samples"), True),
        (("included", 0, "steps"), "10"),
        (("included", 1, "digest"), DIGEST.upper()),
        (("included", 1, "nonce"), "xyz"),
        (("included", 0, "node"), "Node A"),
        (("included", 0, "samples"), 0),
        (("params", "key"), "not/a/key"),
        (("params", "size"), -1),
        (("state", "digest"), "00"),
        (("included", 0), "a"),
        (("params",), []),
    ],
)
def test_nested_commit_fields_are_validated(path: tuple[Any, ...], bad: object) -> None:
    value = json.loads(to_bytes(commit()))
    parent = value
    for part in path[:-1]:
        parent = parent[part]
    parent[path[-1]] = bad
    with pytest.raises(FormatError):
        read_record(canonical(value), Commit, key=keys.commit(5))


def test_included_nodes_must_be_sorted_and_unique() -> None:
    with pytest.raises(ValueError, match="sorted, unique"):
        commit(included=(included("b"), included("a")))
    with pytest.raises(ValueError, match="sorted, unique"):
        commit(included=(included("a"), included("a", nonce=OTHER)))
    value = json.loads(to_bytes(commit()))
    value["included"].reverse()
    with pytest.raises(FormatError, match="sorted, unique"):
        read_record(canonical(value), Commit)


def test_a_commit_includes_at_least_one_snapshot() -> None:
    with pytest.raises(ValueError, match="includes no snapshot"):
        commit(included=())


@pytest.mark.parametrize(("r", "base"), [(5, 5), (5, 6), (0, 0), (-1, -1)])
def test_a_commits_base_is_an_earlier_round(r: int, base: int) -> None:
    with pytest.raises(ValueError):
        commit(
            round=r,
            base_round=base,
            params=PayloadRef(key="manifest", digest=DIGEST, size=0),
            state=PayloadRef(key="manifest", digest=DIGEST, size=0),
        )


@pytest.mark.parametrize(("r", "base"), [(5, 5), (5, 9), (0, 0), (0, -2), (-1, -2)])
def test_a_snapshots_base_is_an_earlier_round(r: int, base: int) -> None:
    with pytest.raises(ValueError):
        snapshot(round=r, base_round=base)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"samples": 0}, "samples"),
        ({"steps": 0}, "steps"),
        ({"samples": -1}, "samples"),
        ({"digest": DIGEST[:-1]}, "digest"),
        ({"digest": "g" * 64}, "digest"),
        ({"digest": DIGEST.upper()}, "digest"),
        ({"nonce": "0123"}, "nonce"),
        ({"node": "A"}, "node"),
        ({"round": keys.MAX_ROUND + 1}, "round"),
        ({"round": True}, "round"),
        ({"base_round": -2}, "base_round"),
    ],
)
def test_invalid_snapshot_values_raise_value_error_naming_the_field(
    changes: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValueError, match=field.split("_")[0]):
        snapshot(**changes)


def test_a_snapshot_record_with_zero_samples_is_refused_from_bytes() -> None:
    value = {**json.loads(to_bytes(snapshot())), "samples": 0}
    with pytest.raises(FormatError, match="samples must be positive"):
        read_record(canonical(value), Snapshot, key=keys.snapshot(5, "a"))


@pytest.mark.parametrize(
    ("changes", "field"),
    [({"counter": -1}, "counter"), ({"node": ""}, "node"), ({"nonce": NONCE.upper()}, "nonce")],
)
def test_invalid_lease_values_raise_value_error(changes: dict[str, Any], field: str) -> None:
    fields: dict[str, Any] = {"node": "a", "nonce": NONCE, "counter": 1, **changes}
    with pytest.raises(ValueError, match=field):
        Lease(**fields)


def test_a_payload_ref_must_name_a_key_of_ours() -> None:
    with pytest.raises(FormatError, match=r"weights\.bin"):
        PayloadRef(key="weights.bin", digest=DIGEST, size=1)
    with pytest.raises(ValueError, match="size"):
        PayloadRef(key="manifest", digest=DIGEST, size=-1)


def test_commit_counts_samples_and_finds_included_snapshots() -> None:
    record = commit(included=(included("a", samples=3), included("b", samples=4, nonce=OTHER)))
    assert record.samples == 7
    assert record.includes("a") and record.includes("b", OTHER)
    assert not record.includes("b", NONCE) and not record.includes("c")


def test_included_of_copies_a_snapshot() -> None:
    snap = snapshot(node="n1", samples=9, steps=3)
    assert Included.of(snap) == Included(
        node="n1", nonce=NONCE, samples=9, steps=3, base_round=1, digest=DIGEST
    )


def test_manifest_schema_must_match_its_digest() -> None:
    value = json.loads(to_bytes(manifest()))
    value["schema_digest"] = "0" * 64
    with pytest.raises(FormatError, match="does not match its digest"):
        read_record(canonical(value), Manifest, key="manifest")


@pytest.mark.parametrize(
    ("field", "bad", "message"),
    [
        ("fragments", [["embed"], "layers.0.w"], "lists of parameter names"),
        ("fragments", [["embed"], [1]], "lists of parameter names"),
        ("fragments", [["embed", "layers.0.w"], ["layers.1.w"]], "does not split"),
        (
            "fragments",
            [[], ["embed", "layers.0.w", "layers.1.w", "layers.2.w", "layers.3.w"]],
            "does not split",
        ),
        ("schema", [["a", "F64", [1]]], "unsupported dtype"),
        ("schema", [["a", "F32"]], "bad schema entry"),
        ("schema", [["b", "F32", [1]], ["a", "F32", [1]]], "sorted"),
        ("algorithm", {"inner_steps": 0}, "inner_steps"),
        ("algorithm", {"beta": 1}, "unknown algorithm fields"),
        ("init", [], "one init payload per fragment"),
    ],
)
def test_invalid_manifests_are_refused(field: str, bad: object, message: str) -> None:
    value = {**json.loads(to_bytes(manifest())), field: bad}
    with pytest.raises(FormatError, match=message):
        read_record(canonical(value), Manifest, key="manifest")


def test_manifest_fragment_groups_must_match_the_algorithm() -> None:
    s = schema()
    with pytest.raises(ValueError, match=r"3 fragment groups for algorithm\.fragments=2"):
        Manifest(
            nonce=NONCE,
            creator="a",
            schema=s,
            algorithm=DiLoCo(inner_steps=10, fragments=2),
            fragments=partition(s, 3),
            init=(),
        )


def test_manifest_fragment_schema_is_the_groups_subset() -> None:
    m = manifest()
    assert m.fragment_schema(1).names == m.fragments[1]
    assert m.schema_digest == schema().digest()


@pytest.mark.parametrize(
    "which",
    [
        {"params": PayloadRef(key=keys.params(4, NONCE), digest=DIGEST, size=1)},
        {"state": PayloadRef(key=keys.params(5, NONCE), digest=DIGEST, size=1)},
        {"params": PayloadRef(key="manifest", digest=DIGEST, size=1)},
    ],
)
def test_commit_payloads_are_its_rounds_params_and_state(which: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        commit(**which)


def test_manifest_init_refs_are_the_init_keys_of_each_fragment() -> None:
    s = schema()
    refs = (
        PayloadRef(key=keys.init(1, NONCE), digest=DIGEST, size=1),
        PayloadRef(key=keys.params(0, NONCE), digest=DIGEST, size=1),
    )
    with pytest.raises(ValueError):
        Manifest(
            nonce=NONCE,
            creator="a",
            schema=s,
            algorithm=DiLoCo(inner_steps=10, fragments=2),
            fragments=partition(s, 2),
            init=refs,
        )


@pytest.mark.parametrize(
    "make",
    [
        lambda: Claim(node="a", nonce=NONCE, round=-1, attempt=0),
        lambda: Claim(node="a", nonce=NONCE, round=1, attempt=keys.MAX_ATTEMPT + 1),
        lambda: commit(attempt=keys.MAX_ATTEMPT + 1),
    ],
    ids=["claim-round-minus-one", "claim-attempt", "commit-attempt"],
)
def test_records_refuse_values_outside_the_key_layout(make: Any) -> None:
    with pytest.raises(ValueError):
        make()


def test_a_record_parsed_again_is_the_one_parsed_before_under_the_same_arguments() -> None:
    # read_record keeps what it parsed (many simulated nodes read one commit): the same
    # bytes, kind, key and verifier give the record parsed first; any other argument parses
    # anew, so a record judged under one verifier is never taken as verified by another.
    from gradientmail.core.signing import Keyring

    ring, other = Keyring.of("a" * 32), Keyring.of("b" * 32)
    lease = Lease(node="a", nonce=NONCE, counter=7)
    signed = to_bytes(lease, ring)
    first = read_record(signed, Lease, key="leases/a", verifier=ring)
    assert first == lease
    assert read_record(bytearray(signed), Lease, key="leases/a", verifier=ring) is first
    with pytest.raises(FormatError, match="bad signature") as info:
        read_record(signed, Lease, key="leases/a", verifier=other)
    assert info.value.key == "leases/a"
    unsigned = to_bytes(lease)
    assert read_record(unsigned, Lease, key="leases/a") == lease
    with pytest.raises(FormatError, match="unsigned"):
        read_record(unsigned, Lease, key="leases/a", verifier=ring)
    with pytest.raises(FormatError, match="expected a snapshot record"):
        read_record(signed, Snapshot, key="leases/a", verifier=ring)
    # A failure is not kept: the same bad bytes fail again, naming the key they were read at.
    for key in ("leases/b", "leases/c"):
        with pytest.raises(FormatError) as bad:
            read_record(signed[:-2], Lease, key=key, verifier=ring)
        assert bad.value.key == key


def test_records_kept_parsed_stay_within_their_byte_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gradientmail.core import records

    monkeypatch.setattr(records, "PARSED_BYTES", 4096)
    monkeypatch.setattr(records, "_PARSED", records._Parsed())
    for counter in range(200):
        lease = Lease(node="a", nonce=NONCE, counter=counter)
        assert read_record(to_bytes(lease), Lease, key="leases/a") == lease
        assert records._PARSED._bytes <= 4096 + len(to_bytes(lease))
    big = manifest(k=2)
    data = to_bytes(big)
    monkeypatch.setattr(records, "PARSED_LARGEST", len(data) - 1)
    assert read_record(data, Manifest) == big
    assert read_record(data, Manifest) is not read_record(data, Manifest)  # never kept
