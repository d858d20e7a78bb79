"""The key layout: every kind builds and parses back, lists in numeric order, and foreign or
malformed keys are refused with the key named."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradientmail.core import keys
from gradientmail.core.errors import FormatError
from gradientmail.core.keys import ParsedKey

NONCE = "0123456789abcdef"
rounds = st.integers(0, keys.MAX_ROUND)
attempts = st.integers(0, keys.MAX_ATTEMPT)
fragment_ids = st.integers(0, keys.MAX_FRAGMENT)
nodes = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=64)
nonces = st.text(alphabet="0123456789abcdef", min_size=16, max_size=16)


def build(parsed: ParsedKey) -> str:
    """The key a ``ParsedKey`` came from, through the public builders only."""
    builders: dict[str, Callable[[ParsedKey], str]] = {
        "manifest": lambda p: keys.manifest(_int(p.slot)),
        "init": lambda p: keys.init(_int(p.fragment), _str(p.nonce)),
        "lease": lambda p: keys.lease(_str(p.node)),
        "head": lambda p: keys.head(_int(p.fragment)),
        "snapshot": lambda p: keys.snapshot(_int(p.round), _str(p.node), _int(p.slot)),
        "claim": lambda p: keys.claim(_int(p.round), _int(p.attempt)),
        "params": lambda p: keys.params(_int(p.round), _str(p.nonce)),
        "state": lambda p: keys.state(_int(p.round), _str(p.nonce)),
        "commit": lambda p: keys.commit(_int(p.round), _int(p.slot)),
    }
    return builders[parsed.kind](parsed)


def _int(value: int | None) -> int:
    assert value is not None
    return value


def _str(value: str | None) -> str:
    assert value is not None
    return value


@st.composite
def any_key(draw: st.DrawFn) -> tuple[str, ParsedKey]:
    """A key of every kind with the ``ParsedKey`` it must parse to."""
    kind = draw(
        st.sampled_from(
            ["manifest", "init", "lease", "head", "snapshot", "claim", "params", "state", "commit"]
        )
    )
    r, node, nonce = draw(rounds), draw(nodes), draw(nonces)
    fragment, attempt = draw(fragment_ids), draw(attempts)
    slot = draw(st.integers(0, keys.MAX_SLOT))
    expected = {
        "manifest": (keys.manifest(slot), ParsedKey(kind="manifest", slot=slot)),
        "init": (
            keys.init(fragment, nonce),
            ParsedKey(kind="init", fragment=fragment, nonce=nonce),
        ),
        "lease": (keys.lease(node), ParsedKey(kind="lease", node=node)),
        "head": (keys.head(fragment), ParsedKey(kind="head", fragment=fragment)),
        "snapshot": (
            keys.snapshot(r, node, slot),
            ParsedKey(kind="snapshot", round=r, node=node, slot=slot),
        ),
        "claim": (keys.claim(r, attempt), ParsedKey(kind="claim", round=r, attempt=attempt)),
        "params": (keys.params(r, nonce), ParsedKey(kind="params", round=r, nonce=nonce)),
        "state": (keys.state(r, nonce), ParsedKey(kind="state", round=r, nonce=nonce)),
        "commit": (keys.commit(r, slot), ParsedKey(kind="commit", round=r, slot=slot)),
    }
    return expected[kind]


@given(any_key())
def test_every_kind_parses_to_its_fields_and_builds_back(case: tuple[str, ParsedKey]) -> None:
    key, expected = case
    assert keys.parse(key) == expected
    assert build(keys.parse(key)) == key


def test_layout_matches_the_documented_shapes() -> None:
    assert keys.commit(7) == "rounds/00000000000000000007/commit"
    assert keys.commit(7, 0) == keys.commit(7)
    assert keys.commit(7, 12) == "rounds/00000000000000000007/commit-0012"
    assert keys.snapshot(12, "node-a") == "rounds/00000000000000000012/snapshots/node-a"
    assert keys.claim(3, 2) == "rounds/00000000000000000003/claims/0002"
    assert keys.params(1, NONCE) == f"rounds/00000000000000000001/params-{NONCE}"
    assert keys.state(1, NONCE) == f"rounds/00000000000000000001/state-{NONCE}"
    assert keys.init(2, NONCE) == f"init/0002-{NONCE}"
    assert keys.lease("n1") == "leases/n1"
    assert keys.head(3) == "heads/0003"


@given(rounds, nodes, attempts, nonces)
def test_round_keys_lie_under_their_round_prefix(
    r: int, node: str, attempt: int, nonce: str
) -> None:
    prefix = keys.round_prefix(r)
    assert keys.snapshot(r, node).startswith(keys.snapshots(r))
    assert keys.claim(r, attempt).startswith(keys.claims(r))
    for key in (
        keys.snapshots(r),
        keys.claims(r),
        keys.params(r, nonce),
        keys.state(r, nonce),
        keys.commit(r),
    ):
        assert key.startswith(prefix) and key.startswith(keys.ROUNDS)


@given(rounds, rounds)
def test_one_rounds_prefix_never_lists_another_round(a: int, b: int) -> None:
    if a != b:
        assert not keys.commit(b).startswith(keys.round_prefix(a))
        assert not keys.snapshots(b).startswith(keys.snapshots(a))


@given(st.lists(rounds, min_size=2, max_size=20, unique=True))
def test_lexicographic_order_of_round_keys_is_numeric_order(rs: list[int]) -> None:
    for make in (keys.commit, lambda r: keys.snapshot(r, "a"), lambda r: keys.params(r, NONCE)):
        assert [keys.parse(k).round for k in sorted(make(r) for r in rs)] == sorted(rs)
    assert sorted(keys.round_prefix(r) for r in rs) == [keys.round_prefix(r) for r in sorted(rs)]


@given(st.lists(attempts, min_size=2, max_size=20, unique=True), rounds)
def test_lexicographic_order_of_claims_is_attempt_order(a: list[int], r: int) -> None:
    listed = sorted(keys.claim(r, x) for x in a)
    assert [keys.parse(k).attempt for k in listed] == sorted(a)


def test_the_smallest_and_largest_rounds_order_correctly() -> None:
    assert keys.commit(0) < keys.commit(9) < keys.commit(10) < keys.commit(keys.MAX_ROUND)
    assert keys.parse(keys.commit(keys.MAX_ROUND)).round == keys.MAX_ROUND


R = "0" * 20
FOREIGN = [
    "",
    "manifest2",
    "Manifest",
    "/manifest",
    "manifest/",
    "manifest\n",
    "leases/",
    "leases/Node",
    "leases/a_b",
    "leases/a/b",
    "leases/" + "a" * 65,
    "heads/1",
    "heads/00001",
    "init/0001",
    f"init/1-{NONCE}",
    "init/0001-0123456789ABCDEF",
    "init/0001-0123",
    "rounds/1/commit",
    f"rounds/{R[:-1]}/commit",
    f"rounds/{R}0/commit",
    f"rounds/{R}/commits",
    f"rounds/{R}/snapshots/",
    f"rounds/{R}/snapshots/a/b",
    f"rounds/{R}/claims/1",
    f"rounds/{R}/claims/00001",
    f"rounds/{R}/params-",
    f"rounds/{R}/params-{NONCE}0",
    f"rounds/{R}/state-{NONCE[:-1]}",
    f"rounds/{R}/other",
    "rounds/-0000000000000000001/commit",
    "other/manifest",
    "checkpoints/model.pt",
]


@pytest.mark.parametrize("key", FOREIGN)
def test_foreign_keys_raise_format_error_naming_the_key(key: str) -> None:
    with pytest.raises(FormatError) as info:
        keys.parse(key)
    assert info.value.key == key
    if key:
        assert key in str(info.value)


@given(any_key(), st.data())
def test_a_mutated_key_is_refused_or_parses_to_exactly_itself(
    case: tuple[str, ParsedKey], data: st.DataObject
) -> None:
    key, _ = case
    at = data.draw(st.integers(0, len(key)))
    edit = data.draw(st.sampled_from(["replace", "insert", "delete"]))
    char = data.draw(st.characters(min_codepoint=32, max_codepoint=126))
    tail = key[at + 1 :] if edit != "insert" else key[at:]
    mutated = key[:at] + ("" if edit == "delete" else char) + tail
    try:
        parsed = keys.parse(mutated)
    except FormatError as exc:
        assert exc.key == mutated
    else:
        assert build(parsed) == mutated


@pytest.mark.parametrize(
    "key",
    [
        "rounds/" + "\u0660" * 20 + "/commit",
        "rounds/" + "0" * 19 + "\u0661/claims/0001",
        "heads/\u0660\u0660\u0660\u0661",
        f"init/\u0660\u0660\u0660\u0661-{NONCE}",
    ],
)
def test_keys_with_non_ascii_digits_are_foreign(key: str) -> None:
    with pytest.raises(FormatError):
        keys.parse(key)


BAD_NODES: list[object] = ["", "A", "node_1", "a.b", "a/b", "a b", "é", "a" * 65, "n\n", 5, None]


@pytest.mark.parametrize("node", BAD_NODES)
def test_bad_node_ids_raise_value_error_naming_the_id(node: Any) -> None:
    for make in (keys.check_node, keys.lease, lambda n: keys.snapshot(0, n)):
        with pytest.raises(ValueError, match=r"node id .* must match") as info:
            make(node)
        assert repr(node) in str(info.value)


@given(nodes)
def test_good_node_ids_are_returned_unchanged(node: str) -> None:
    assert keys.check_node(node) == node


BAD_NONCES: list[object] = ["", "0123", NONCE + "0", NONCE[:-1], NONCE.upper(), "g" * 16, 16, None]


@pytest.mark.parametrize("nonce", BAD_NONCES)
def test_bad_nonces_raise_value_error_naming_the_nonce(nonce: Any) -> None:
    for make in (
        keys.check_nonce,
        lambda n: keys.init(0, n),
        lambda n: keys.params(0, n),
        lambda n: keys.state(0, n),
    ):
        with pytest.raises(ValueError, match="16 lowercase hex digits") as info:
            make(nonce)
        assert repr(nonce) in str(info.value)


@pytest.mark.parametrize("r", [-1, -(10**20), keys.MAX_ROUND + 1, 10**30])
def test_rounds_outside_the_padded_range_raise_value_error(r: int) -> None:
    for make in (
        keys.round_prefix,
        keys.snapshots,
        keys.claims,
        keys.commit,
        lambda x: keys.snapshot(x, "a"),
        lambda x: keys.claim(x, 0),
        lambda x: keys.params(x, NONCE),
        lambda x: keys.state(x, NONCE),
    ):
        with pytest.raises(ValueError, match=f"round {r} outside"):
            make(r)


@pytest.mark.parametrize("attempt", [-1, keys.MAX_ATTEMPT + 1])
def test_attempts_outside_four_digits_raise_value_error(attempt: int) -> None:
    with pytest.raises(ValueError, match=f"attempt {attempt} outside"):
        keys.claim(0, attempt)


@pytest.mark.parametrize("slot", [-1, keys.MAX_SLOT + 1])
def test_slots_outside_four_digits_raise_value_error(slot: int) -> None:
    for make in (
        lambda: keys.commit(0, slot),
        lambda: keys.snapshot(0, "a", slot),
        lambda: keys.manifest(slot),
    ):
        with pytest.raises(ValueError, match=f"slot {slot} outside"):
            make()


def test_the_first_key_of_a_slot_sequence_has_one_spelling() -> None:
    """Slot 0 is ``commit``, ``<node>`` and ``manifest``: a ``0000`` suffix would be a second
    key for the same slot."""
    for zero in (
        keys.round_prefix(3) + "commit-0000",
        keys.snapshots(3) + "a.0000",
        "manifest-0000",
    ):
        with pytest.raises(FormatError):
            keys.parse(zero)
    assert keys.parse(keys.commit(3, 1)) == ParsedKey(kind="commit", round=3, slot=1)
    assert keys.parse(keys.snapshot(3, "a-1", 2)) == ParsedKey(
        kind="snapshot", round=3, node="a-1", slot=2
    )
    assert keys.snapshot(3, "a-1", 2).endswith("/a-1.0002")
    assert keys.parse(keys.manifest(7)) == ParsedKey(kind="manifest", slot=7)


@pytest.mark.parametrize("fragment", [-1, keys.MAX_FRAGMENT + 1])
def test_fragments_outside_four_digits_raise_value_error(fragment: int) -> None:
    with pytest.raises(ValueError, match="fragment"):
        keys.head(fragment)
    with pytest.raises(ValueError, match="fragment"):
        keys.init(fragment, NONCE)
