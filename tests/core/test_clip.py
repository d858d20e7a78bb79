"""The norm clip (``DiLoCo.clip``): the pure rule that scales a delta far beyond the round's
median down to ``clip`` times it, and its folding into the outer weights."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradientmail.core import closing as rules
from gradientmail.core.algorithm import DiLoCo
from gradientmail.core.records import Included
from gradientmail.core.robust import clip_scales, needs_norms, outliers

NONCE = "0123456789abcdef"
DIGEST = "cd" * 32


def included(node: str, steps: int = 10, samples: int = 8) -> Included:
    return Included(
        node=node, nonce=NONCE, samples=samples, steps=steps, base_round=1, digest=DIGEST
    )


def test_no_delta_within_clip_times_the_median_is_scaled() -> None:
    chosen = [included(n) for n in "abcd"]
    norms = {"a": 1.0, "b": 1.2, "c": 0.9, "d": 2.2}  # median 1.1; d is exactly 2x
    assert clip_scales(chosen, norms, inner_steps=10, clip=2.0) == dict.fromkeys("abcd", 1.0)


def test_a_huge_delta_is_scaled_to_exactly_clip_times_the_median() -> None:
    chosen = [included(n) for n in "abcd"]
    norms = {"a": 1.0, "b": 1.2, "c": 0.9, "d": 500.0}
    scales = clip_scales(chosen, norms, inner_steps=10, clip=2.0)
    assert {n: scales[n] for n in "abc"} == dict.fromkeys("abc", 1.0)
    assert scales["d"] * norms["d"] == pytest.approx(2.0 * 1.1, rel=1e-15)


def test_norms_are_normalized_to_h_steps_before_the_clip() -> None:
    # d spans 40 steps (rebased): its norm 4.0 is 1.0 at H=10 steps, no clip.
    chosen = [included("a"), included("b"), included("c"), included("d", steps=40)]
    norms = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 4.0}
    assert clip_scales(chosen, norms, inner_steps=10, clip=1.5)["d"] == 1.0
    # e spans 1 step with a norm of 1.0: 10.0 at H steps, clipped to 1.5 normalized.
    chosen[3] = included("e", steps=1)
    scales = clip_scales(chosen, {**norms, "e": 1.0}, inner_steps=10, clip=1.5)
    assert scales["e"] == pytest.approx(0.15)


def test_with_fewer_than_three_deltas_nothing_is_clipped() -> None:
    two = [included("a"), included("b")]
    assert clip_scales(two, {"a": 1.0, "b": 1e9}, inner_steps=10, clip=1.0) == {"a": 1.0, "b": 1.0}
    assert clip_scales([], {}, inner_steps=10, clip=1.0) == {}


@given(
    st.lists(st.floats(0.0, 3.4e38), max_size=5),
    st.sampled_from([None, 1.5, 10.0]),
    st.sampled_from([None, 1.0, 4.0]),
)
def test_norms_are_skipped_only_where_no_rule_reads_them(
    norms: list[float], factor: float | None, clip: float | None
) -> None:
    # Decoded deltas are finite, so are their norms: without the clip and below the outlier
    # minimum, no value of them changes the round.
    chosen = [included(f"n{i}") for i in range(len(norms))]
    named = {i.node: norm for i, norm in zip(chosen, norms, strict=True)}
    if needs_norms(len(chosen), factor=factor, clip=clip):
        assert clip is not None or len(chosen) >= 3
        return
    assert clip is None
    assert outliers(chosen, named, inner_steps=10, factor=factor) == []


def test_a_zero_median_clips_nothing() -> None:
    chosen = [included(n) for n in "abc"]
    norms = {"a": 0.0, "b": 0.0, "c": 5.0}
    assert clip_scales(chosen, norms, inner_steps=10, clip=1.0) == dict.fromkeys("abc", 1.0)


@pytest.mark.parametrize("clip", [0.99, 0.0, -1.0, math.nan, math.inf])
def test_a_clip_below_one_or_not_finite_is_refused(clip: float) -> None:
    with pytest.raises(ValueError, match=r"clip must be a number >= 1\.0"):
        clip_scales([included("a")], {"a": 1.0}, inner_steps=10, clip=clip)


def test_non_finite_norms_must_be_excluded_first() -> None:
    chosen = [included(n) for n in "abc"]
    with pytest.raises(ValueError, match=r"non-finite delta norms of \['b'\]"):
        clip_scales(chosen, {"a": 1.0, "b": math.inf, "c": 1.0}, inner_steps=10, clip=2.0)


@given(
    st.lists(st.floats(1e-6, 1e6), min_size=3, max_size=9),
    st.floats(1.0, 100.0),
)
def test_every_clipped_norm_lands_on_the_bound_and_no_other_moves(
    values: list[float], clip: float
) -> None:
    chosen = [included(f"n{i}") for i in range(len(values))]
    norms = {i.node: v for i, v in zip(chosen, values, strict=True)}
    scales = clip_scales(chosen, norms, inner_steps=10, clip=clip)
    ordered = sorted(values)
    middle = len(ordered) // 2
    median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    for node, value in norms.items():
        assert 0.0 < scales[node] <= 1.0
        if value > clip * median:
            assert math.isclose(scales[node] * value, clip * median, rel_tol=1e-12)
        else:
            assert scales[node] == 1.0


def test_outer_weights_carry_the_clip_factors() -> None:
    chosen = [included(n) for n in "abcd"]
    norms = {"a": 1.0, "b": 1.2, "c": 0.9, "d": 500.0}
    plain = rules.outer_weights(DiLoCo(inner_steps=10), chosen)
    assert plain == rules.outer_weights(DiLoCo(inner_steps=10), chosen, norms)  # clip off
    clipped = rules.outer_weights(DiLoCo(inner_steps=10, clip=2.0), chosen, norms)
    assert clipped[:3] == plain[:3]
    assert clipped[3] * norms["d"] == pytest.approx(plain[3] * 2.0 * 1.1, rel=1e-15)
    with pytest.raises(ValueError, match="needs the deltas' norms"):
        rules.outer_weights(DiLoCo(inner_steps=10, clip=2.0), chosen)
