"""The Backend contract, run against torch and MLX alike (the ``fw`` fixture)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gradientmail.adapters import formats
from gradientmail.core.errors import NonFinite, SchemaMismatch
from gradientmail.core.tensors import (
    DTYPES,
    ParameterSpec,
    Schema,
    TensorBytes,
    payload_schema,
    scale_name,
)

ODD_SHAPES = [(), (1,), (3,), (31,), (33,), (2, 3, 5), (64, 7), (0,), (4, 0)]
ITEM = {"F32": 4, "F16": 2, "BF16": 2}


def schema_of(arrays: dict[str, Any], dtype: str = "F32") -> Schema:
    return Schema.of(
        ParameterSpec(name=n, dtype=dtype, shape=tuple(np.shape(a))) for n, a in arrays.items()
    )


def f32_arrays() -> Any:
    """Arrays of 0 to 3 axes (0-d, single elements and block tails included), any finite F32."""
    finite = st.floats(width=32, allow_nan=False, allow_infinity=False)
    shapes = hnp.array_shapes(min_dims=0, max_dims=3, max_side=12)
    return hnp.arrays(np.float32, shapes, elements=finite)


def payload_codes(payload: dict[str, TensorBytes], name: str) -> np.ndarray[Any, Any]:
    return np.frombuffer(payload[name].data, np.uint8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ODD_SHAPES)
def test_load_and_dump_keep_exact_bytes(fw: Any, dtype: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(7)
    # Any bit pattern, NaNs and infinities included: loading and dumping do no arithmetic.
    data = rng.integers(0, 256, math.prod(shape) * ITEM[dtype], dtype=np.uint8).tobytes()
    value = TensorBytes(dtype=dtype, shape=shape, data=data)
    assert fw.backend.dump(fw.backend.load({"w": value})) == {"w": value}


@pytest.mark.parametrize("shape", ODD_SHAPES)
def test_unquantized_payload_is_the_exact_delta(fw: Any, shape: tuple[int, ...]) -> None:
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    payload, residual = fw.backend.encode({"w": fw.tensor(x)}, None)
    assert payload == {"w": TensorBytes(dtype="F32", shape=shape, data=x.tobytes())}
    assert not fw.numpy(residual["w"]).any()
    assert np.array_equal(fw.numpy(fw.backend.decode(payload, schema_of({"w": x}))["w"]), x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_reads_plain_payloads_of_every_dtype(fw: Any, dtype: str) -> None:
    x = np.array([[1.5, -2.25, 3e-3], [0.0, 7.0, -1e4]], np.float32)
    payload = fw.backend.dump({"w": fw.tensor(x, dtype)})
    decoded = fw.numpy(fw.backend.decode(payload, schema_of({"w": x}, "BF16"))["w"])
    assert np.array_equal(decoded, fw.numpy(fw.tensor(x, dtype)))


@given(x=f32_arrays())
def test_f8_codes_are_the_nearest_of_all_256(fw: Any, x: np.ndarray[Any, Any]) -> None:
    payload, residual = fw.backend.encode({"w": fw.tensor(x)}, "F8_E4M3")
    codes, scale = formats.encode_f8(x)
    assert payload_codes(payload, "w").tolist() == codes.reshape(-1).tolist()
    assert payload[scale_name("w")].data == np.float32(scale).tobytes()
    decoded = fw.numpy(fw.backend.decode(payload, schema_of({"w": x}))["w"])
    assert np.array_equal(decoded, formats.decode_f8(codes, scale))
    assert np.array_equal(fw.numpy(residual["w"]), x - decoded)


@given(x=f32_arrays())
def test_f4_codes_are_the_nearest_of_all_16(fw: Any, x: np.ndarray[Any, Any]) -> None:
    payload, residual = fw.backend.encode({"w": fw.tensor(x)}, "F4")
    packed, scales = formats.encode_f4(x)
    assert payload_codes(payload, "w").tolist() == packed.tolist()
    assert payload_codes(payload, scale_name("w")).tolist() == scales.tolist()
    decoded = fw.numpy(fw.backend.decode(payload, schema_of({"w": x}))["w"])
    assert np.array_equal(decoded.reshape(-1), formats.decode_f4(packed, scales, x.size))
    assert np.array_equal(fw.numpy(residual["w"]), x - decoded)


@pytest.mark.parametrize("quantization", ["F8_E4M3", "F4"])
@pytest.mark.parametrize("shape", ODD_SHAPES)
def test_quantized_layout_is_quantized_specs(fw: Any, quantization: str, shape: Any) -> None:
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    payload, _ = fw.backend.encode({"w": fw.tensor(x)}, quantization)
    expected = payload_schema(schema_of({"w": x}), quantization)
    assert (
        Schema.of(ParameterSpec(name=n, dtype=t.dtype, shape=t.shape) for n, t in payload.items())
        == expected
    )


def test_quantization_error_is_within_each_formats_bound(fw: Any) -> None:
    rng = np.random.default_rng(3)
    # Magnitudes over many octaves inside each tensor and block, the hard case for scales.
    x = (rng.standard_normal(4099) * np.exp2(rng.integers(-20, 20, 4099))).astype(np.float32)
    p8, _ = fw.backend.encode({"w": fw.tensor(x)}, "F8_E4M3")
    scale = float(np.frombuffer(p8[scale_name("w")].data, np.float32)[0])
    assert float(np.abs(x).max()) / scale <= formats.E4M3_MAX
    assert float(np.abs(x).max()) / scale > formats.E4M3_MAX / 2  # the smallest such power
    error8 = np.abs(x - fw.numpy(fw.backend.decode(p8, schema_of({"w": x}))["w"]))
    # Three mantissa bits: half an ulp is 2**-4 of the value, or 2**-10 scales when subnormal.
    assert (error8 <= np.maximum(np.abs(x) * 2.0**-4, scale * 2.0**-10)).all()

    p4, _ = fw.backend.encode({"w": fw.tensor(x)}, "F4")
    scales = np.exp2(payload_codes(p4, scale_name("w")).astype(np.float64) - 127)
    per_element = np.repeat(scales, 32)[: x.size]
    error4 = np.abs(x - fw.numpy(fw.backend.decode(p4, schema_of({"w": x}))["w"]))
    # E2M1 spacing is 0.5 below 2 and a quarter of the value above; saturation above 6 stays
    # within that too, as amax / scale < 8.
    assert (error4 <= np.maximum(np.abs(x) / 4, per_element / 4)).all()


def test_f4_ties_round_to_even_and_large_values_saturate(fw: Any) -> None:
    # amax 6 gives the scale 1, so the block holds the scaled values themselves.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -5.0]
    expected = [0, 2, 2, 4, 4, 6, 6, 8, 10, 14]
    block = np.zeros(32, np.float32)
    block[: len(ties)] = ties
    block[-1] = 6.0
    payload, _ = fw.backend.encode({"w": fw.tensor(block)}, "F4")
    packed = payload_codes(payload, "w")
    codes = np.stack([packed & 0xF, packed >> 4], axis=1).reshape(-1)
    assert codes[: len(ties)].tolist() == expected
    assert payload_codes(payload, scale_name("w")).tolist() == [127]
    saturating = np.array([7.9] + [1.0] * 31, np.float32)  # floor(log2(7.9)) = 2: scale 1
    decoded = fw.backend.decode(
        fw.backend.encode({"w": fw.tensor(saturating)}, "F4")[0], schema_of({"w": saturating})
    )
    assert fw.numpy(decoded["w"])[0] == 6.0


@pytest.mark.parametrize("quantization", ["F8_E4M3", "F4"])
def test_codes_hold_on_each_side_of_every_f4_threshold(fw: Any, quantization: str) -> None:
    # Each block leads with 6, which gives the scale 1: the block holds the values themselves.
    # The values are the E2M1 thresholds and their F32 neighbours, of either sign.
    near = []
    for threshold, _ in formats.E2M1_STEPS:
        t = np.float32(threshold)
        near += [np.nextafter(t, np.float32(0)), t, np.nextafter(t, np.float32(8))]
    values = np.array(near + [-v for v in near] + [0.0, -0.0, 1e-45, -1e-45], np.float32)
    blocks = np.zeros((-(-values.size // 31), 32), np.float32)
    blocks[:, 0] = 6.0
    blocks[:, 1:].reshape(-1)[: values.size] = values
    x = blocks.reshape(-1)
    delta = {"w": fw.tensor(x)}
    payload, residual = fw.backend.encode(delta, quantization)
    if quantization == "F4":
        packed, scales = formats.encode_f4(x)
        assert payload_codes(payload, "w").tolist() == packed.tolist()
        assert payload_codes(payload, scale_name("w")).tolist() == scales.tolist()
    else:
        codes, _ = formats.encode_f8(x)
        assert payload_codes(payload, "w").tolist() == codes.tolist()
    decoded = fw.numpy(fw.backend.decode(payload, schema_of({"w": x}))["w"])
    # Bit for bit, zeros' signs included; the delta itself is left as it was.
    assert (fw.numpy(residual["w"]).view(np.uint32) == (x - decoded).view(np.uint32)).all()
    assert (fw.numpy(delta["w"]).view(np.uint32) == x.view(np.uint32)).all()


@pytest.mark.parametrize("quantization", [None, "F8_E4M3", "F4"])
def test_an_owned_delta_gives_the_same_payload_and_residual(fw: Any, quantization: Any) -> None:
    """``encode(..., owned=True)`` writes the same payload and residual bit for bit, over
    tensors of every odd shape (F4 block tails and empty ones included) and a non-contiguous
    one; torch leaves a quantized residual in the delta's own memory, MLX makes new arrays."""
    rng = np.random.default_rng(11)
    arrays = {f"t{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(ODD_SHAPES)}
    kept, _ = fw.backend.encode({n: fw.tensor(a) for n, a in arrays.items()}, quantization)
    _, expected = fw.backend.encode({n: fw.tensor(a) for n, a in arrays.items()}, quantization)
    delta = {n: fw.tensor(a) for n, a in arrays.items()}
    if fw.name == "torch":
        delta["t5"] = fw.tensor(arrays["t5"].T.copy()).permute(2, 1, 0)  # (2, 3, 5), strided
    payload, residual = fw.backend.encode(delta, quantization, owned=True)
    assert payload == kept
    for name, want in expected.items():
        got = fw.numpy(residual[name])
        assert got.shape == arrays[name].shape
        assert (got.view(np.uint32) == fw.numpy(want).view(np.uint32)).all(), name
    if fw.name == "torch" and quantization is not None:
        full = [n for n in arrays if arrays[n].size]
        shared = [n for n in full if residual[n].data_ptr() == delta[n].data_ptr()]
        assert shared == [n for n in full if n != "t5"]


@pytest.mark.parametrize("base_dtype", ["F32", "BF16"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_an_owned_delta_is_the_same_delta_in_the_capture_memory(
    fw: Any, base_dtype: str, with_residual: bool
) -> None:
    """``delta(..., owned=True)`` gives ``base - local (+ residual)`` bit for bit as the
    unowned delta; torch writes an F32 ``local`` over (no new memory), MLX makes new arrays."""
    rng = np.random.default_rng(12)
    arrays = {f"t{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(ODD_SHAPES)}
    bases = {n: fw.tensor(a + np.float32(0.5), base_dtype) for n, a in arrays.items()}
    residual = (
        {n: fw.tensor(rng.standard_normal(a.shape).astype(np.float32)) for n, a in arrays.items()}
        if with_residual
        else None
    )
    expected = fw.backend.delta(bases, {n: fw.tensor(a) for n, a in arrays.items()}, residual)
    local = {n: fw.tensor(a) for n, a in arrays.items()}
    got = fw.backend.delta(bases, local, residual, owned=True)
    for name, want in expected.items():
        values = fw.numpy(got[name])
        assert values.dtype == np.float32 and values.shape == arrays[name].shape
        assert (values.view(np.uint32) == fw.numpy(want).view(np.uint32)).all(), name
    if fw.name == "torch":
        assert all(got[n] is local[n] for n in arrays)


def test_f8_values_near_the_f32_maximum_stay_finite(fw: Any) -> None:
    # max|x| / 2**120 just below 256 would round up to 256 * 2**120, F32's infinity.
    x = np.float32([3.4e38, -3.3e38, 2.9e38, 1.0])
    payload, residual = fw.backend.encode({"w": fw.tensor(x)}, "F8_E4M3")
    codes, scale = formats.encode_f8(x)
    assert scale == 2.0**120
    assert payload_codes(payload, "w").tolist() == codes.tolist()
    decoded = fw.numpy(fw.backend.decode(payload, schema_of({"w": x}))["w"])
    assert decoded.tolist()[:3] == [240 * 2.0**120, -240 * 2.0**120, 224 * 2.0**120]
    assert np.isfinite(fw.numpy(residual["w"])).all()


def test_zero_tensors_have_defined_scales(fw: Any) -> None:
    x = np.zeros(40, np.float32)
    p4, _ = fw.backend.encode({"w": fw.tensor(x)}, "F4")
    assert payload_codes(p4, scale_name("w")).tolist() == [0, 0]
    p8, _ = fw.backend.encode({"w": fw.tensor(x)}, "F8_E4M3")
    assert p8[scale_name("w")].data == np.float32(2.0**-126).tobytes()
    for payload in (p4, p8):
        assert not fw.numpy(fw.backend.decode(payload, schema_of({"w": x}))["w"]).any()


@pytest.mark.parametrize("quantization", [None, "F8_E4M3", "F4"])
def test_encode_refuses_nan_and_inf_naming_the_tensors(fw: Any, quantization: Any) -> None:
    delta = {
        "a": fw.tensor([1.0, np.nan]),
        "b": fw.tensor([2.0, 3.0]),
        "c": fw.tensor(np.inf),
        "d": fw.tensor([-np.inf, 0.0]),
    }
    with pytest.raises(NonFinite) as caught:
        fw.backend.encode(delta, quantization)
    assert caught.value.names == ("a", "c", "d")


def test_lend_plain_is_the_unquantized_payload_uncopied(fw: Any) -> None:
    """``lend_plain`` gives ``encode(delta, None)``'s bytes, as views of the delta, and refuses
    NaN and Inf by name as ``encode`` does."""
    delta = {"a": fw.tensor(np.arange(6, dtype=np.float32).reshape(2, 3)), "b": fw.tensor(0.5)}
    payload, _ = fw.backend.encode(delta, None)
    lent = fw.backend.lend_plain(delta)
    assert sorted(lent) == sorted(payload)
    for name, value in payload.items():
        assert (lent[name].dtype, lent[name].shape) == (value.dtype, value.shape)
        assert bytes(lent[name].data) == value.data
    bad = {"a": fw.tensor([1.0, np.nan]), "b": fw.tensor([2.0]), "c": fw.tensor(np.inf)}
    with pytest.raises(NonFinite) as caught:
        fw.backend.lend_plain(bad)
    assert caught.value.names == ("a", "c")


def _f4_payload(codes: list[int], scale: int) -> dict[str, TensorBytes]:
    nibbles = np.zeros(32, np.uint8)
    nibbles[: len(codes)] = codes
    packed = (nibbles[0::2] | (nibbles[1::2] << 4)).tobytes()
    return {
        "w": TensorBytes(dtype="F4", shape=(32,), data=packed),
        "w.scale": TensorBytes(dtype="F8_E8M0", shape=(1,), data=bytes([scale])),
    }


def _f8_payload(code: int, scale: float) -> dict[str, TensorBytes]:
    return {
        "w": TensorBytes(dtype="F8_E4M3", shape=(2,), data=bytes([0x38, code])),
        "w.scale": TensorBytes(dtype="F32", shape=(), data=np.float32(scale).tobytes()),
    }


@pytest.mark.parametrize(
    "payload",
    [
        _f4_payload([1, 2], 0xFF),  # the E8M0 NaN scale
        _f4_payload([7], 254),  # 6 * 2**127 overflows F32
        _f8_payload(0x7F, 1.0),  # E4M3 NaN
        _f8_payload(0xFF, 1.0),
        _f8_payload(0x38, math.inf),
        _f8_payload(0x38, math.nan),
        {
            "w": TensorBytes(
                dtype="F32", shape=(2,), data=np.array([1, np.inf], np.float32).tobytes()
            )
        },
        {"w": TensorBytes(dtype="BF16", shape=(2,), data=bytes([0, 0, 0xC0, 0x7F]))},
    ],
    ids=[
        "e8m0-nan",
        "f4-overflow",
        "e4m3-nan",
        "e4m3-negative-nan",
        "scale-inf",
        "scale-nan",
        "f32-inf",
        "bf16-nan",
    ],
)
def test_decode_refuses_nan_and_inf(fw: Any, payload: dict[str, TensorBytes]) -> None:
    shape = (32,) if payload["w"].dtype == "F4" else (2,)
    schema = Schema.of([ParameterSpec(name="w", dtype="F32", shape=shape)])
    with pytest.raises(NonFinite) as caught:
        fw.backend.decode(payload, schema)
    assert caught.value.names == ("w",)


def test_decode_names_every_entry_that_does_not_match(fw: Any) -> None:
    x = np.ones((3, 4), np.float32)
    f4, _ = fw.backend.encode({"a": fw.tensor(x)}, "F4")
    f8, _ = fw.backend.encode({"b": fw.tensor(x), "c": fw.tensor(x), "d": fw.tensor(x)}, "F8_E4M3")
    plain, _ = fw.backend.encode({"e": fw.tensor(x[:2])}, None)
    payload = {**f4, **f8, **plain}
    del payload["c.scale"]  # c loses its scale
    payload["d.scale"] = TensorBytes(dtype="F32", shape=(1,), data=bytes(4))  # wrong scale shape
    payload["z"] = plain["e"]  # belongs to no parameter
    schema = schema_of({"a": x, "b": x, "c": x, "d": x, "e": x, "f": x})
    with pytest.raises(SchemaMismatch) as caught:
        fw.backend.decode(payload, schema)
    assert set(caught.value.names) == {"c", "d", "e", "f", "z"}
    assert "missing" in str(caught.value)
    assert "shape (2, 4)" in str(caught.value)
    good = {n: v for n, v in payload.items() if n in ("a", "a.scale", "b", "b.scale")}
    decoded = fw.backend.decode(good, schema.subset(["a", "b"]))
    assert {n: fw.numpy(t).tolist() for n, t in decoded.items()} == {
        "a": x.tolist(),
        "b": x.tolist(),
    }


@pytest.mark.parametrize("dtype", DTYPES)
def test_delta_is_base_minus_local_plus_residual_in_f32(fw: Any, dtype: str) -> None:
    base, local = np.float32([1.0, 2.0, 3.0]), np.float32([0.5, 2.5, 3.0])
    residual = np.float32([1e-3, 0.0, -1e-3])
    out = fw.backend.delta(fw.tensors({"w": base}, dtype), fw.tensors({"w": local}, dtype))
    assert fw.numpy(out["w"]).tolist() == [0.5, -0.5, 0.0]
    with_residual = fw.backend.delta(
        fw.tensors({"w": base}, dtype), fw.tensors({"w": local}, dtype), fw.tensors({"w": residual})
    )
    assert np.array_equal(fw.numpy(with_residual["w"]), np.float32([0.5, -0.5, 0.0]) + residual)
    with pytest.raises(SchemaMismatch) as caught:
        fw.backend.delta(fw.tensors({"w": base, "v": base}), fw.tensors({"w": local}))
    assert caught.value.names == ("v",)


def test_average_is_the_weighted_mean(fw: Any) -> None:
    rng = np.random.default_rng(4)
    arrays = [rng.standard_normal((5, 3)).astype(np.float32) for _ in range(3)]
    weights = [1e9, 3e9, 2.5e9]  # tokens: normalizing first keeps F32 away from overflow
    out = fw.backend.average(
        [(w, fw.tensors({"w": a})) for w, a in zip(weights, arrays, strict=True)]
    )
    expected = sum(w * a.astype(np.float64) for w, a in zip(weights, arrays, strict=True)) / sum(
        weights
    )
    np.testing.assert_allclose(fw.numpy(out["w"]), expected, rtol=1e-6, atol=1e-7)
    for bad in ([], [(0.0, {"w": fw.tensor(arrays[0])})], [(-1.0, {"w": fw.tensor(arrays[0])})]):
        with pytest.raises(ValueError, match="average"):
            fw.backend.average(bad)


def test_weighted_sum_takes_the_weights_as_given(fw: Any) -> None:
    a, b = np.float32([1.0, -2.0, 0.5]), np.float32([4.0, 0.25, -8.0])
    out = fw.backend.weighted_sum([(0.5, {"w": fw.tensor(a)}), (1.5, {"w": fw.tensor(b, "BF16")})])
    assert fw.numpy(out["w"]).tolist() == (0.5 * a + 1.5 * b).tolist()
    with pytest.raises(ValueError, match="weighted sum"):
        fw.backend.weighted_sum([])
    with pytest.raises(ValueError, match="finite"):
        fw.backend.weighted_sum([(math.nan, {"w": fw.tensor(a)})])
    with pytest.raises(SchemaMismatch) as caught:
        fw.backend.weighted_sum([(1.0, {"w": fw.tensor(a)}), (1.0, {"v": fw.tensor(a)})])
    assert caught.value.names == ("v", "w")


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_steps_follow_torch_sgd(fw: Any, nesterov: bool) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    start = rng.standard_normal((7, 9)).astype(np.float32)
    gradients = [rng.standard_normal((7, 9)).astype(np.float32) for _ in range(5)]
    parameter = torch.nn.Parameter(torch.from_numpy(start.copy()))
    sgd = torch.optim.SGD([parameter], lr=0.7, momentum=0.9, nesterov=nesterov)
    master, momentum = {"w": fw.tensor(start)}, None
    for g in gradients:
        parameter.grad = torch.from_numpy(g.copy())
        sgd.step()
        master, momentum = fw.backend.outer_step(
            master, momentum, {"w": fw.tensor(g)}, lr=0.7, beta=0.9, nesterov=nesterov
        )
        ours, theirs = fw.numpy(master["w"]), parameter.detach().numpy()
        if fw.name == "torch":
            assert np.array_equal(ours, theirs)  # same ops, same order: bit for bit
        else:
            np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)
    buffer = sgd.state[parameter]["momentum_buffer"].numpy()
    np.testing.assert_allclose(fw.numpy(momentum["w"]), buffer, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("nesterov", [True, False])
def test_an_outer_step_that_reuses_its_inputs_computes_the_same_and_spares_the_master(
    fw: Any, nesterov: bool
) -> None:
    rng = np.random.default_rng(8)
    start = rng.standard_normal((7, 9)).astype(np.float32)
    master = {"w": fw.tensor(start)}
    plain_momentum: Any = None
    reused_momentum: Any = None
    for _ in range(4):
        g = rng.standard_normal((7, 9)).astype(np.float32)
        expected, plain_momentum = fw.backend.outer_step(
            master, plain_momentum, {"w": fw.tensor(g)}, lr=0.7, beta=0.9, nesterov=nesterov
        )
        gradient = {"w": fw.tensor(g)}
        got, reused_momentum = fw.backend.outer_step(
            master,
            reused_momentum,
            gradient,
            lr=0.7,
            beta=0.9,
            nesterov=nesterov,
            reuse=True,
        )
        assert np.array_equal(fw.numpy(got["w"]), fw.numpy(expected["w"]))
        assert np.array_equal(fw.numpy(reused_momentum["w"]), fw.numpy(plain_momentum["w"]))
        assert np.array_equal(fw.numpy(master["w"]), start)  # never written
        if fw.name == "torch":  # the new master took the spent gradient's memory
            assert got["w"].data_ptr() == gradient["w"].data_ptr()
        master, start = expected, fw.numpy(expected["w"]).copy()


def test_outer_step_rejects_bad_settings(fw: Any) -> None:
    t = {"w": fw.tensor([1.0])}
    with pytest.raises(ValueError, match="beta"):
        fw.backend.outer_step(t, None, t, lr=0.7, beta=1.0)
    with pytest.raises(ValueError, match="lr"):
        fw.backend.outer_step(t, None, t, lr=math.nan, beta=0.9)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cast_rounds_to_nearest_even(fw: Any, dtype: str) -> None:
    # Exact ties of BF16 (8 bits) and F16 (11 bits), and values just beyond them.
    x = np.float32([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8 + 2**-20])
    out = fw.backend.cast({"w": fw.tensor(x)}, schema_of({"w": x}, dtype))
    value = fw.backend.dump(out)["w"]
    assert value.dtype == dtype
    expected = {
        "F32": x,
        "F16": np.float32([1 + 2**-8, 1 + 3 * 2**-8, 1.0, 1 + 2**-9, 1 + 2**-8]),
        "BF16": np.float32([1.0, 1 + 2**-6, 1.0, 1.0, 1 + 2**-7]),
    }[dtype]
    assert np.array_equal(fw.numpy(out["w"]), expected)
    with pytest.raises(SchemaMismatch):
        fw.backend.cast({"v": fw.tensor(x)}, schema_of({"w": x}, dtype))


@pytest.mark.parametrize("quantization", ["F8_E4M3", "F4"])
def test_error_feedback_keeps_the_sum_of_deltas(fw: Any, quantization: str) -> None:
    rng = np.random.default_rng(6)
    shape = (50, 13)
    deltas = [(rng.standard_normal(shape) * 1e-2).astype(np.float32) for _ in range(40)]
    schema = schema_of({"w": deltas[0]})
    sent, residual = np.zeros(shape), None
    plain_sent = np.zeros(shape)
    for d in deltas:
        base, local = {"w": fw.tensor(d)}, {"w": fw.tensor(np.zeros(shape))}
        payload, residual = fw.backend.encode(fw.backend.delta(base, local, residual), quantization)
        sent += fw.numpy(fw.backend.decode(payload, schema)["w"])
        plain, _ = fw.backend.encode({"w": fw.tensor(d)}, quantization)
        plain_sent += fw.numpy(fw.backend.decode(plain, schema)["w"])
    true = np.sum(deltas, axis=0, dtype=np.float64)
    # What was sent plus what is still owed is the true sum, up to F32 additions.
    np.testing.assert_allclose(sent + fw.numpy(residual["w"]), true, atol=1e-5)
    # So the error stays that of one quantization, while without feedback it accumulates.
    one_step = float(np.abs(fw.numpy(residual["w"])).max())
    assert np.abs(sent - true).max() <= one_step + 1e-5
    assert np.abs(sent - true).mean() < np.abs(plain_sent - true).mean() / 2
