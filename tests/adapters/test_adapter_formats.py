"""The reference formats against torch's own float8 dtypes and its vendored MX quantizer, code by
code, and the payload layout check."""

from __future__ import annotations

import ast
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradientmail.adapters import formats
from gradientmail.core.errors import SchemaMismatch
from gradientmail.core.tensors import ParameterSpec, Schema, TensorBytes

torch = pytest.importorskip("torch")


def every_f16_and_its_neighbours(limit: float) -> np.ndarray[Any, Any]:
    """All finite F16 values within ``limit`` and the F32 values either side of each: every
    E4M3 and E2M1 code, every midpoint between two codes, and just off each midpoint."""
    halves = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    values = halves[np.isfinite(halves)].astype(np.float32)
    values = values[np.abs(values) <= limit]
    around = [
        values,
        np.nextafter(values, np.float32(np.inf)),
        np.nextafter(values, np.float32(-np.inf)),
    ]
    return np.concatenate(around).astype(np.float32)


def mx_reference() -> dict[str, Any]:
    """torch's vendored torchao MX quantizer (FLOOR scales, the OCP rule), without the
    ``torch.compile`` handles that make importing it slow."""
    path = Path(torch.__file__).parent / "_vendor" / "quack" / "mx_utils.py"
    if not path.exists():
        pytest.skip("this torch has no vendored MX quantizer")
    tree = ast.parse(path.read_text())
    tree.body = [node for node in tree.body if "torch.compile" not in ast.unparse(node)]
    namespace: dict[str, Any] = {}
    exec(compile(tree, str(path), "exec"), namespace)
    return namespace


def test_e4m3_table_is_torchs_float8_e4m3fn() -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    theirs = codes.view(torch.float8_e4m3fn).to(torch.float32).numpy()
    assert np.array_equal(np.float32(formats.E4M3_VALUES), theirs, equal_nan=True)
    assert [c for c in range(256) if math.isnan(formats.E4M3_VALUES[c])] == [0x7F, 0xFF]
    assert max(v for v in formats.E4M3_VALUES if not math.isnan(v)) == formats.E4M3_MAX


def test_e8m0_table_is_torchs_float8_e8m0fnu() -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    theirs = codes.view(torch.float8_e8m0fnu).to(torch.float32).numpy()
    assert np.array_equal(np.float32(formats.E8M0_VALUES), theirs, equal_nan=True)


def test_e2m1_table_round_trips_through_torchs_mx_encoder() -> None:
    encode = mx_reference()["_f32_to_floatx_unpacked"]
    magnitudes = sorted(formats.E2M1_VALUES[:8])
    assert magnitudes == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    values = torch.tensor(formats.E2M1_VALUES, dtype=torch.float32)
    assert encode(values, 2, 1).tolist() == list(range(16))


def test_e4m3_reference_rounds_as_torchs_float8_cast() -> None:
    x = every_f16_and_its_neighbours(formats.E4M3_MAX)
    theirs = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(formats.e4m3_code(x), theirs)


def test_e2m1_reference_rounds_as_torchs_mx_encoder() -> None:
    encode = mx_reference()["_f32_to_floatx_unpacked"]
    x = every_f16_and_its_neighbours(8.0)
    theirs = encode(torch.from_numpy(x), 2, 1).numpy()
    assert np.array_equal(formats.e2m1_code(x), theirs)


@pytest.mark.parametrize("octaves", [0, 8, 30])
def test_mxfp4_reference_is_torchs_floor_mxfp4(octaves: int) -> None:
    rng = np.random.default_rng(octaves)
    blocks = 257
    x = rng.standard_normal(blocks * 32) * np.exp2(rng.integers(-octaves, octaves + 1, blocks * 32))
    x = x.astype(np.float32)
    packed, scales = mx_reference()["to_mxfp4"](torch.from_numpy(x).reshape(1, -1))
    ours_packed, ours_scales = formats.encode_f4(x)
    assert np.array_equal(ours_scales, scales.view(torch.uint8).reshape(-1).numpy())
    assert np.array_equal(ours_packed, packed.reshape(-1).numpy())


@given(st.floats(min_value=0.0, allow_infinity=False, width=32))
def test_f8_scale_is_the_smallest_power_of_two_that_fits(amax: float) -> None:
    k = formats.f8_scale_exponent(amax)
    assert -126 <= k <= formats.E4M3_TOP_EXPONENT
    assert amax <= formats.E4M3_MAX * math.ldexp(1.0, k)
    assert k == -126 or amax > formats.E4M3_MAX * math.ldexp(1.0, k - 1)


def test_f8_saturates_at_240_under_the_top_scale() -> None:
    codes, scale = formats.encode_f8(np.float32([3.4e38, -3.4e38]))
    assert scale == 2.0**120
    assert formats.decode_f8(codes, scale).tolist() == [240 * 2.0**120, -240 * 2.0**120]


def test_f4_reference_handles_tails_zeros_and_subnormal_blocks() -> None:
    x = np.zeros(70, np.float32)
    x[33] = 1e-40  # a subnormal amax: the smallest scale, 2**-127
    x[64:] = [6.0, -6.0, 3.0, 0.5, -0.25, 7.0]
    packed, scales = formats.encode_f4(x)
    assert scales.tolist() == [0, 0, 127]
    assert packed.size == 48
    decoded = formats.decode_f4(packed, scales, x.size)
    assert decoded[64:].tolist() == [6.0, -6.0, 3.0, 0.5, -0.0, 6.0]
    assert not decoded[:64].any()


def _spec(name: str, shape: tuple[int, ...], dtype: str = "BF16") -> ParameterSpec:
    return ParameterSpec(name=name, dtype=dtype, shape=shape)


def _entry(dtype: str, shape: tuple[int, ...]) -> TensorBytes:
    bits = {"F32": 32, "F16": 16, "BF16": 16, "F8_E4M3": 8, "F8_E8M0": 8, "F4": 4}[dtype]
    return TensorBytes(dtype=dtype, shape=shape, data=bytes(bits * math.prod(shape) // 8))


def test_payload_layout_infers_each_parameters_format() -> None:
    schema = Schema.of([_spec("a", (3,)), _spec("b", (2, 2)), _spec("c", (33,)), _spec("d", ())])
    payload = {
        "a": _entry("F16", (3,)),
        "b": _entry("F8_E4M3", (2, 2)),
        "b.scale": _entry("F32", ()),
        "c": _entry("F4", (64,)),
        "c.scale": _entry("F8_E8M0", (2,)),
        "d": _entry("F32", ()),
    }
    assert formats.payload_layout(payload, schema) == {
        "a": "F16",
        "b": "F8_E4M3",
        "c": "F4",
        "d": "F32",
    }


@pytest.mark.parametrize(
    ("payload", "names", "detail"),
    [
        ({}, ("a",), "missing"),
        ({"a": _entry("F32", (4,))}, ("a",), "shape (4,)"),
        ({"a": _entry("F8_E8M0", (3,))}, ("a",), "no parameter layout"),
        ({"a": _entry("F4", (32,))}, ("a",), "scales 'a.scale': none"),
        ({"a": _entry("F4", (30,)), "a.scale": _entry("F8_E8M0", (1,))}, ("a",), "F4 shape (30,)"),
        (
            {"a": _entry("F8_E4M3", (3,)), "a.scale": _entry("F8_E8M0", ())},
            ("a",),
            "expected F32 ()",
        ),
        (
            {"a": _entry("F32", (3,)), "a.scale": _entry("F32", ())},
            ("a.scale",),
            "not in the schema",
        ),
    ],
)
def test_payload_layout_names_what_is_wrong(payload: Any, names: Any, detail: str) -> None:
    with pytest.raises(SchemaMismatch) as caught:
        formats.payload_layout(payload, Schema.of([_spec("a", (3,))]))
    assert caught.value.names == names
    assert detail in str(caught.value)


def test_weights_and_settings_are_checked() -> None:
    assert formats.normalized_weights([1.0, 3.0]) == [0.25, 0.75]
    with pytest.raises(ValueError, match="positive"):
        formats.normalized_weights([1.0, math.inf])
    with pytest.raises(ValueError, match="alpha"):
        formats.check_alpha(1.5)
    formats.check_alpha(None)
    formats.check_outer(0.7, 0.0)
