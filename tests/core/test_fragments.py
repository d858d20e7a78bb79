"""Fragment partitions: strided over layers in natural order, the rest balanced by bytes,
deterministic, and explicit mappings validated."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradientmail.core import fragments
from gradientmail.core.fragments import layer_of, partition
from gradientmail.core.tensors import ParameterSpec, Schema


def spec(name: str, elements: int = 4) -> ParameterSpec:
    return ParameterSpec(name=name, dtype="F32", shape=(elements,))


def schema(*names: str, elements: int = 4) -> Schema:
    return Schema.of(spec(n, elements) for n in names)


def transformer(layers: int) -> Schema:
    names = [f"layers.{i}.{part}" for i in range(layers) for part in ("attn.w", "mlp.w")]
    return Schema.of([spec("embed.weight", 1000), spec("norm.weight", 10), *map(spec, names)])


def fragment_of(groups: fragments.Partition, name: str) -> int:
    return next(i for i, g in enumerate(groups) if name in g)


@pytest.mark.parametrize(
    ("name", "layer"),
    [
        ("layers.10.mlp.weight", 10),
        ("model.layers.3.attn.q", 3),
        ("h.0.ln_1.weight", 0),
        ("blocks.07.w", 7),
        ("embed.weight", None),
        ("lm_head.weight", None),
        ("norm", None),
        ("layer1.weight", None),
        ("a.2.b.5", 2),
    ],
)
def test_layer_is_the_first_numeric_segment(name: str, layer: int | None) -> None:
    assert layer_of(name) == layer


def test_layers_are_strided_in_natural_numeric_order() -> None:
    # K=3 tells natural from lexicographic order: as strings layers.10 would rank third (2),
    # as numbers it is layer 10, fragment 1.
    groups = partition(transformer(12), 3)
    for i in range(12):
        for part in ("attn.w", "mlp.w"):
            assert fragment_of(groups, f"layers.{i}.{part}") == i % 3
    assert fragment_of(groups, "layers.10.mlp.w") == 1
    assert fragment_of(groups, "layers.9.mlp.w") == 0


def test_sparse_layer_indices_stride_by_rank() -> None:
    groups = partition(schema("layers.0.w", "layers.4.w", "layers.8.w", "layers.12.w"), 2)
    assert groups == (("layers.0.w", "layers.8.w"), ("layers.12.w", "layers.4.w"))


def test_non_layer_parameters_go_largest_first_to_the_lightest_fragment() -> None:
    groups = partition(transformer(4), 2)
    # Layers load both fragments equally; the 1000-element embedding goes to fragment 0, then
    # the 10-element norm to the now lighter fragment 1.
    assert fragment_of(groups, "embed.weight") == 0
    assert fragment_of(groups, "norm.weight") == 1


def test_fewer_layers_than_fragments_balances_everything_by_bytes() -> None:
    groups = partition(Schema.of([spec("layers.0.w", 100), spec("a", 60), spec("b", 50)]), 2)
    assert groups == (("layers.0.w",), ("a", "b"))


@st.composite
def flat_schemas(draw: st.DrawFn) -> Schema:
    sizes = draw(st.lists(st.integers(1, 10_000), min_size=1, max_size=24))
    return Schema.of(spec(f"p{i:02d}", n) for i, n in enumerate(sizes))


@given(flat_schemas(), st.integers(1, 8))
def test_non_layer_fragments_differ_by_at_most_the_largest_parameter(s: Schema, k: int) -> None:
    if k > len(s.parameters):
        return
    groups = partition(s, k)
    loads = [sum(s[n].nbytes for n in g) for g in groups]
    assert max(loads) - min(loads) <= max(p.nbytes for p in s.parameters)


@st.composite
def model_schemas(draw: st.DrawFn) -> Schema:
    layers = draw(st.integers(0, 30))
    extra = draw(st.lists(st.sampled_from(["embed", "norm", "head", "pos", "bias"]), unique=True))
    names = [f"layers.{i}.{p}" for i in range(layers) for p in ("a", "b")] + extra
    sizes = draw(st.lists(st.integers(1, 512), min_size=len(names), max_size=len(names)))
    return Schema.of(spec(n, size) for n, size in zip(names, sizes, strict=True))


@given(model_schemas(), st.integers(1, 8), st.randoms(use_true_random=False))
def test_partition_splits_exactly_deterministically_and_sorted(
    s: Schema, k: int, rng: random.Random
) -> None:
    if not s.parameters:
        return
    try:
        groups = partition(s, k)
    except ValueError as exc:
        assert "would hold no parameters" in str(exc)
        return
    assert len(groups) == k
    assert sorted(n for g in groups for n in g) == list(s.names)
    assert all(g and list(g) == sorted(g) for g in groups)
    shuffled = list(s.parameters)
    rng.shuffle(shuffled)
    assert partition(Schema.of(shuffled), k) == groups
    fragments.check(s, groups)


def test_one_fragment_holds_everything() -> None:
    s = transformer(3)
    assert partition(s, 1) == (s.names,)


def test_explicit_mapping_is_used_as_given() -> None:
    s = schema("a", "b", "c")
    assert partition(s, 2, {"a": 1, "b": 0, "c": 1}) == (("b",), ("a", "c"))


def test_mapping_missing_a_parameter_names_it() -> None:
    with pytest.raises(ValueError, match=r"missing \['c'\], unknown \[\]"):
        partition(schema("a", "b", "c"), 2, {"a": 0, "b": 1})


def test_mapping_with_an_unknown_parameter_names_it() -> None:
    with pytest.raises(ValueError, match=r"missing \[\], unknown \['zz'\]"):
        partition(schema("a", "b"), 2, {"a": 0, "b": 1, "zz": 0})


@pytest.mark.parametrize("index", [-1, 2, 99])
def test_mapping_out_of_range_names_the_parameter(index: int) -> None:
    with pytest.raises(ValueError, match=r"fragment index out of 0\.\.1 for \['b'\]"):
        partition(schema("a", "b"), 2, {"a": 0, "b": index})


def test_mapping_that_leaves_a_fragment_empty_is_refused() -> None:
    with pytest.raises(ValueError, match=r"fragments \[1\] would hold no parameters"):
        partition(schema("a", "b"), 3, {"a": 0, "b": 2})


def test_more_fragments_than_parameters_is_refused() -> None:
    with pytest.raises(ValueError, match=r"would hold no parameters.*2 parameters for 3"):
        partition(schema("a", "b"), 3)


def test_more_fragments_than_layers_still_fills_every_fragment_from_other_groups() -> None:
    groups = partition(schema("layers.0.w", "layers.1.w", "embed"), 3)
    assert sorted(len(g) for g in groups) == [1, 1, 1]


@pytest.mark.parametrize("k", [0, -1])
def test_fragment_count_below_one_is_refused(k: int) -> None:
    with pytest.raises(ValueError, match=f"fragments must be >= 1, got {k}"):
        partition(schema("a"), k)


@pytest.mark.parametrize(
    "groups",
    [
        (("a",), ("b",)),
        (("a", "b", "c"), ()),
        (("a", "b"), ("b", "c")),
        (("a", "b", "c", "d"),),
    ],
)
def test_check_refuses_a_partition_that_does_not_split_the_schema(
    groups: fragments.Partition,
) -> None:
    with pytest.raises(ValueError, match="does not split"):
        fragments.check(schema("a", "b", "c"), groups)


def test_a_superscript_digit_segment_is_not_a_layer() -> None:
    s = schema("h.\u00b2.w")
    assert partition(s, 1) == (("h.\u00b2.w",),)
