"""The algorithm configuration: defaults and presets as in the papers, every field validated
with its range named, canonical JSON, and a join-time comparison naming every difference."""

from __future__ import annotations

import json
import math
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradientmail.core.algorithm import DiLoCo
from gradientmail.core.errors import ConfigMismatch, FormatError, ProtocolError

FIELDS = [a.name for a in attrs.fields(DiLoCo)]


def test_defaults_are_diloco_outer_nesterov() -> None:
    config = DiLoCo()
    assert (config.outer_lr, config.outer_momentum, config.nesterov) == (0.7, 0.9, True)
    assert (config.fragments, config.overlap_steps, config.alpha) == (1, 0, None)
    assert config.quantization is None and config.global_batch is None
    assert config.clip is None  # off: the commit is the plain weighted mean (Decision 5)
    assert config.quorum_size >= 1 and config.grace >= 0


def test_paper_preset_is_diloco_2023() -> None:
    # Douillard et al. 2023: H=500, outer Nesterov lr 0.7 momentum 0.9, one synchronous sync.
    config = DiLoCo.paper()
    assert config.inner_steps == 500 and config.fragments == 1
    assert (config.outer_lr, config.outer_momentum, config.nesterov) == (0.7, 0.9, True)
    assert config.overlap_steps == 0 and config.alpha is None and config.quantization is None


def test_streaming_preset_is_streaming_diloco_2025() -> None:
    # Douillard et al. 2025: H=100, staggered fragments, overlap tau in 1..5, alpha 0.5, FP4.
    config = DiLoCo.streaming()
    assert config.inner_steps == 100 and config.fragments > 1
    assert config.overlap_steps is not None and 1 <= config.overlap_steps <= 5
    assert config.alpha == 0.5 and config.quantization == "F4"
    assert config.nesterov


def test_presets_take_changes_and_validate_them() -> None:
    assert DiLoCo.paper(inner_steps=100).inner_steps == 100
    assert DiLoCo.streaming(fragments=2).fragments == 2
    with pytest.raises(ValueError, match="outer_lr"):
        DiLoCo.streaming(outer_lr=0)
    with pytest.raises(TypeError):
        DiLoCo.paper(no_such_field=1)


BAD: list[tuple[str, object, str]] = [
    ("inner_steps", 0, ">= 1"),
    ("inner_steps", -5, ">= 1"),
    ("inner_steps", 1.5, ">= 1"),
    ("inner_steps", "500", ">= 1"),
    ("inner_steps", True, ">= 1"),
    ("inner_steps", None, ">= 1"),
    ("fragments", 0, ">= 1"),
    ("fragments", 2.0, ">= 1"),
    ("fragments", True, ">= 1"),
    ("outer_lr", 0, "(0, 10]"),
    ("outer_lr", -0.1, "(0, 10]"),
    ("outer_lr", 10.01, "(0, 10]"),
    ("outer_lr", math.nan, "(0, 10]"),
    ("outer_lr", math.inf, "(0, 10]"),
    ("outer_lr", "0.7", "(0, 10]"),
    ("outer_lr", True, "(0, 10]"),
    ("outer_momentum", -0.01, "[0, 1)"),
    ("outer_momentum", 1.0, "[0, 1)"),
    ("outer_momentum", math.nan, "[0, 1)"),
    ("quorum_size", 0, ">= 1"),
    ("quorum_size", 2.0, ">= 1"),
    ("quorum_size", False, ">= 1"),
    ("grace", -1, "[0, 86400]"),
    ("grace", 86_400.5, "[0, 86400]"),
    ("grace", math.inf, "[0, 86400]"),
    ("grace", None, "[0, 86400]"),
    ("overlap_steps", -1, ">= 0"),
    ("overlap_steps", 0.5, ">= 0"),
    ("overlap_steps", False, ">= 0"),
    ("alpha", -0.1, "[0, 1)"),
    ("alpha", 1.0, "[0, 1)"),
    ("alpha", math.nan, "[0, 1)"),
    ("alpha", "0.5", "[0, 1)"),
    ("global_batch", 0, ">= 1"),
    ("global_batch", 64.0, ">= 1"),
    ("global_batch", True, ">= 1"),
    ("quantization", "F8", "'F8_E4M3' or 'F4'"),
    ("quantization", "f4", "'F8_E4M3' or 'F4'"),
    ("quantization", "F32", "'F8_E4M3' or 'F4'"),
    ("quantization", 4, "'F8_E4M3' or 'F4'"),
    ("clip", 0.5, ">= 1.0"),
    ("clip", 0, ">= 1.0"),
    ("clip", -2.0, ">= 1.0"),
    ("clip", math.inf, ">= 1.0"),
    ("clip", math.nan, ">= 1.0"),
    ("clip", "2", ">= 1.0"),
    ("clip", True, ">= 1.0"),
]


@pytest.mark.parametrize(("field", "value", "allowed"), BAD)
def test_bad_values_raise_value_error_naming_field_and_range(
    field: str, value: Any, allowed: str
) -> None:
    with pytest.raises(ValueError) as info:
        DiLoCo(**{field: value})
    assert str(info.value).startswith(field)
    assert allowed in str(info.value)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_bad_nesterov_raises_value_error_like_every_other_field(value: Any) -> None:
    with pytest.raises(ValueError, match="nesterov"):
        DiLoCo(nesterov=value)


GOOD: list[tuple[str, object]] = [
    ("outer_lr", 10),
    ("outer_lr", 1e-9),
    ("outer_momentum", 0),
    ("outer_momentum", 0.999),
    ("grace", 0),
    ("grace", 86_400),
    ("alpha", 0.0),
    ("alpha", 0.999),
    ("overlap_steps", None),
    ("global_batch", 1),
    ("quantization", "F8_E4M3"),
    ("quantization", "F4"),
    ("nesterov", False),
    ("quorum_size", 10_000),
    ("clip", None),
    ("clip", 1.0),
    ("clip", 1),
    ("clip", 1e6),
]


@pytest.mark.parametrize(("field", "value"), GOOD)
def test_boundary_values_inside_the_range_are_accepted(field: str, value: Any) -> None:
    assert getattr(DiLoCo(**{field: value}), field) == value


def test_fragments_cannot_exceed_inner_steps() -> None:
    assert DiLoCo(inner_steps=8, fragments=8).slot == 1
    with pytest.raises(ValueError, match=r"fragments \(9\) must be at most inner_steps \(8\)"):
        DiLoCo(inner_steps=8, fragments=9)


@given(st.integers(1, 1000), st.integers(1, 64), st.integers(0, 1000))
def test_overlap_steps_must_stay_below_one_slot(h: int, k: int, overlap: int) -> None:
    if k > h:
        return
    slot = h // k
    if overlap < slot:
        config = DiLoCo(inner_steps=h, fragments=k, overlap_steps=overlap)
        assert config.slot == slot
    else:
        with pytest.raises(ValueError, match=rf"overlap_steps \({overlap}\) must be below"):
            DiLoCo(inner_steps=h, fragments=k, overlap_steps=overlap)


def test_unbounded_overlap_is_allowed_at_any_slot() -> None:
    assert DiLoCo(inner_steps=4, fragments=4, overlap_steps=None).overlap_steps is None


@st.composite
def configs(draw: st.DrawFn) -> DiLoCo:
    h = draw(st.integers(1, 2000))
    k = draw(st.integers(1, min(h, 16)))
    slot = h // k
    return DiLoCo(
        inner_steps=h,
        fragments=k,
        outer_lr=draw(st.floats(1e-6, 10)),
        outer_momentum=draw(st.floats(0, 1, exclude_max=True)),
        nesterov=draw(st.booleans()),
        quorum_size=draw(st.integers(1, 64)),
        grace=draw(st.floats(0, 86_400)),
        overlap_steps=draw(st.none() | st.integers(0, slot - 1)),
        alpha=draw(st.none() | st.floats(0, 1, exclude_max=True)),
        global_batch=draw(st.none() | st.integers(1, 10**9)),
        quantization=draw(st.sampled_from([None, "F8_E4M3", "F4"])),
        clip=draw(st.none() | st.floats(1, 1e6)),
    )


@given(configs())
def test_json_round_trip_through_canonical_bytes(config: DiLoCo) -> None:
    wire = json.dumps(config.to_json(), sort_keys=True)
    assert DiLoCo.from_json(json.loads(wire)) == config
    assert sorted(config.to_json()) == sorted(FIELDS)


def test_to_json_names_every_field() -> None:
    assert DiLoCo.streaming().to_json() == {
        "inner_steps": 100,
        "fragments": 4,
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
        "nesterov": True,
        "quorum_size": 1,
        "grace": 30.0,
        "overlap_steps": 1,
        "alpha": 0.5,
        "global_batch": None,
        "quantization": "F4",
        "clip": None,
    }


def test_from_json_rejects_unknown_fields_by_name() -> None:
    value = {**DiLoCo().to_json(), "outer_beta": 0.5, "zeta": 1}
    with pytest.raises(FormatError, match=r"unknown algorithm fields \['outer_beta', 'zeta'\]"):
        DiLoCo.from_json(value)


@pytest.mark.parametrize("value", [None, [], "DiLoCo", 3])
def test_from_json_rejects_non_objects(value: object) -> None:
    with pytest.raises(FormatError, match="JSON object"):
        DiLoCo.from_json(value)


@pytest.mark.parametrize(("field", "value", "allowed"), BAD)
def test_from_json_turns_bad_values_into_format_errors(
    field: str, value: object, allowed: str
) -> None:
    with pytest.raises(FormatError, match=field):
        DiLoCo.from_json({**DiLoCo().to_json(), field: value})


def test_from_json_turns_a_bad_nesterov_into_a_format_error() -> None:
    with pytest.raises(FormatError, match="nesterov"):
        DiLoCo.from_json({**DiLoCo().to_json(), "nesterov": "yes"})


def test_require_same_accepts_an_equal_configuration() -> None:
    DiLoCo.streaming().require_same(DiLoCo.streaming())
    DiLoCo(outer_lr=1).require_same(DiLoCo(outer_lr=1.0))


def test_require_same_names_every_differing_field() -> None:
    run = DiLoCo.paper()
    ours = DiLoCo.paper(inner_steps=100, outer_lr=0.5, quantization="F4")
    with pytest.raises(ConfigMismatch) as info:
        ours.require_same(run)
    assert info.value.fields == (
        ("inner_steps", 500, 100),
        ("outer_lr", 0.7, 0.5),
        ("quantization", None, "F4"),
    )
    message = str(info.value)
    for text in ("inner_steps: run has 500, this node 100", "outer_lr", "quantization"):
        assert text in message
    assert isinstance(info.value, ProtocolError)


def test_require_same_names_clip_when_two_nodes_disagree() -> None:
    with pytest.raises(ConfigMismatch) as info:
        DiLoCo(clip=3.0).require_same(DiLoCo())
    assert info.value.fields == (("clip", None, 3.0),)
    assert "clip: run has None, this node 3.0" in str(info.value)


def test_a_manifest_written_before_clip_existed_reads_as_clip_off() -> None:
    legacy = {k: v for k, v in DiLoCo().to_json().items() if k != "clip"}
    assert DiLoCo.from_json(legacy) == DiLoCo()


@given(configs(), configs())
def test_require_same_raises_exactly_for_the_fields_that_differ(a: DiLoCo, b: DiLoCo) -> None:
    differing = {f for f in FIELDS if getattr(a, f) != getattr(b, f)}
    if not differing:
        a.require_same(b)
        return
    with pytest.raises(ConfigMismatch) as info:
        a.require_same(b)
    assert {name for name, _, _ in info.value.fields} == differing
    assert all(
        theirs == getattr(b, n) and ours == getattr(a, n) for n, theirs, ours in info.value.fields
    )


def test_slot_is_floor_of_inner_steps_over_fragments() -> None:
    params: dict[str, Any] = {"inner_steps": 10, "fragments": 3}
    assert DiLoCo(**params).slot == 3
