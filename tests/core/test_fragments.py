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


def gpt2_like(layers: int = 12, vocab: int = 50257, width: int = 768) -> Schema:
    """A GPT-2's parameter shapes: its tied token embedding is 31% of the model at 124M."""
    specs = [
        ParameterSpec(name="wte.weight", dtype="F32", shape=(vocab, width)),
        ParameterSpec(name="wpe.weight", dtype="F32", shape=(1024, width)),
        ParameterSpec(name="ln_f.weight", dtype="F32", shape=(width,)),
    ]
    for i in range(layers):
        specs += [
            ParameterSpec(name=f"h.{i}.attn.w", dtype="F32", shape=(width, 3 * width)),
            ParameterSpec(name=f"h.{i}.mlp.w", dtype="F32", shape=(width, 8 * width)),
            ParameterSpec(name=f"h.{i}.ln.weight", dtype="F32", shape=(width,)),
        ]
    return Schema.of(specs)


def loads(s: Schema, groups: fragments.Partition) -> list[int]:
    return [fragments.fragment_schema(s, g).nbytes() for g in groups]


@pytest.mark.parametrize("k", [2, 3, 4, 8])
def test_split_cuts_a_large_embedding_into_row_blocks_that_even_the_fragments(k: int) -> None:
    s = gpt2_like()
    uneven = loads(s, partition(s, k))
    groups = partition(s, k, split=True)
    even = loads(s, groups)
    assert sum(even) == s.nbytes()
    assert max(uneven) > 1.3 * s.nbytes() / k, "whole, the embedding unbalances the fragments"
    assert max(even) <= -(-s.nbytes() // k) + s["wpe.weight"].nbytes, even
    blocks = [n for g in groups for n in g if n.startswith("wte.weight[")]
    assert len(blocks) >= 2 and "wte.weight" not in {n for g in groups for n in g}
    fragments.check(s, groups)
    shapes = fragments.fragment_schema(s, blocks)
    assert sum(p.shape[0] for p in shapes.parameters) == 50257
    assert all(p.shape[1:] == (768,) for p in shapes.parameters)


def test_split_leaves_small_and_one_dimensional_parameters_whole() -> None:
    s = transformer(4)  # every parameter 1-D
    assert partition(s, 2, split=True) == partition(s, 2)
    assert partition(gpt2_like(), 1, split=True) == (gpt2_like().names,)


def test_a_mapping_is_used_as_given_even_when_split_is_asked() -> None:
    s = schema("a", "b", "c")
    assert partition(s, 2, {"a": 1, "b": 0, "c": 1}, split=True) == (("b",), ("a", "c"))


@pytest.mark.parametrize(
    "groups",
    [
        (("w[0:3]",), ("w[3:9]",)),  # rows 9 and 10 missing
        (("w[0:5]",), ("w[4:10]",)),  # overlapping
        (("w[0:5]", "w"), ("w[5:10]",)),  # whole and blocks
        (("w[0:10]",), ("w[0:10]",)),  # twice
        (("w[0:05]",), ("w[5:10]",)),  # not canonical: not a block of w
    ],
)
def test_check_refuses_row_blocks_that_do_not_cover_the_rows_once(
    groups: fragments.Partition,
) -> None:
    s = Schema.of([ParameterSpec(name="w", dtype="F32", shape=(10, 2))])
    with pytest.raises(ValueError, match=r"does not split|cover"):
        fragments.check(s, groups)


def test_a_block_names_its_rows_and_a_schema_name_always_means_the_whole_parameter() -> None:
    s = Schema.of(
        [
            ParameterSpec(name="w", dtype="BF16", shape=(10, 2)),
            ParameterSpec(name="v[0:1]", dtype="F32", shape=(3,)),
        ]
    )
    assert fragments.block("w[2:7]", s) == ("w", 2, 7)
    assert fragments.block("v[0:1]", s) is None, "a real parameter of that name"
    assert fragments.block("x[0:1]", s) is None
    spec = fragments.fragment_schema(s, ["w[2:7]"])["w[2:7]"]
    assert (spec.dtype, spec.shape) == ("BF16", (5, 2))
    with pytest.raises(ValueError, match="outside"):
        fragments.fragment_schema(s, ["w[2:11]"])


@given(
    st.integers(1, 6),
    st.lists(st.integers(2, 400), min_size=1, max_size=4),
    st.integers(1, 8),
)
def test_split_partitions_cover_every_row_once_and_are_deterministic(
    layers: int, rows: list[int], k: int
) -> None:
    specs = [ParameterSpec(name=f"layers.{i}.w", dtype="F32", shape=(8, 8)) for i in range(layers)]
    specs += [
        ParameterSpec(name=f"extra{j}", dtype="F16", shape=(r, 3)) for j, r in enumerate(rows)
    ]
    s = Schema.of(specs)
    try:
        groups = partition(s, k, split=True)
    except ValueError as exc:
        assert "would hold no parameters" in str(exc)
        return
    fragments.check(s, groups)
    assert partition(Schema.of(reversed(specs)), k, split=True) == groups
    assert sum(loads(s, groups)) == s.nbytes()
