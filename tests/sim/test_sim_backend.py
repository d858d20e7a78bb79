"""The tensor-free backend does honest F32 arithmetic: the same numbers as torch where torch
rounds once per operation, within an ulp where torch may fuse, and the Backend contract's
errors."""

from __future__ import annotations

import math
import random
from array import array
from typing import Any

import pytest

from gradientmail.adapters.base import Backend
from gradientmail.core.errors import NonFinite
from gradientmail.core.tensors import Schema, SchemaMismatch, TensorBytes
from sim.sim_backend import FloatBackend, FloatModel, Vector

torch = pytest.importorskip("torch")
from gradientmail.adapters.torch import TorchBackend  # noqa: E402

SHAPES = {"layers.0.w": (5,), "layers.1.w": (2, 3)}


def tensors(seed: int, scale: float = 1.0) -> dict[str, TensorBytes]:
    rng = random.Random(seed)
    out = {}
    for name, shape in SHAPES.items():
        values = array("f", (rng.uniform(-scale, scale) for _ in range(math.prod(shape))))
        out[name] = TensorBytes(dtype="F32", shape=shape, data=values.tobytes())
    return out


def both(seed: int, scale: float = 1.0) -> tuple[Any, Any]:
    data = tensors(seed, scale)
    return FloatBackend().load(data), TorchBackend("cpu").load(data)


def same(float_out: Any, torch_out: Any, *, ulps: int = 0) -> None:
    a = FloatBackend().dump(float_out)
    b = TorchBackend("cpu").dump(torch_out)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].shape == b[name].shape
        if ulps == 0:
            assert a[name].data == b[name].data, name
            continue
        x, y = array("f", a[name].data), array("f", b[name].data)
        for u, v in zip(x, y, strict=True):
            # One F32 ulp is 2**29 double ulps (24 against 53 significant bits).
            assert abs(u - v) <= ulps * math.ulp(max(abs(u), abs(v), 1e-30)) * 2**29, (name, u, v)


def test_the_float_backend_is_a_backend_and_its_model_an_adapter() -> None:
    backend = FloatBackend()
    assert isinstance(backend, Backend)
    model = FloatModel.layered(3, 2)
    assert backend.adapter(model) is model
    assert model.schema.names == ("layers.0.w", "layers.1.w", "layers.2.w")
    with pytest.raises(TypeError, match="FloatModel"):
        backend.adapter(object())


@pytest.mark.parametrize("seed", range(5))
def test_delta_and_weighted_sum_match_torch_bit_for_bit(seed: int) -> None:
    fb, tb = both(seed)
    fl, tl = both(seed + 100)
    fr, tr = both(seed + 200, 1e-3)
    same(FloatBackend().delta(fb, fl), TorchBackend("cpu").delta(tb, tl))
    same(FloatBackend().delta(fb, fl, fr), TorchBackend("cpu").delta(tb, tl, tr))
    weights = [0.25, 1.5, 0.125]
    same(
        FloatBackend().weighted_sum(list(zip(weights, (fb, fl, fr), strict=True))),
        TorchBackend("cpu").weighted_sum(list(zip(weights, (tb, tl, tr), strict=True))),
    )


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_step_matches_torch_within_an_ulp(nesterov: bool) -> None:
    fm, tm = both(1)
    fg, tg = both(2, 0.1)
    fmom, tmom = both(3, 0.1)
    for momentum in ((None, None), (fmom, tmom)):
        f_out = FloatBackend().outer_step(fm, momentum[0], fg, lr=0.7, beta=0.9, nesterov=nesterov)
        t_out = TorchBackend("cpu").outer_step(
            tm, momentum[1], tg, lr=0.7, beta=0.9, nesterov=nesterov
        )
        same(f_out[1], t_out[1], ulps=1)
        same(f_out[0], t_out[0], ulps=2)  # torch may fuse g + beta*m into one rounding


def test_merge_keeps_progress_since_the_snapshot_exactly() -> None:
    backend = FloatBackend()
    model = FloatModel.layered(2, 3)
    captured = backend.capture(model, ["layers.0.w", "layers.1.w"])
    commit = backend.load(tensors_of(model, 0.5))
    # No training since the capture: the merged model is the commit itself, bit for bit.
    backend.merge(model, commit, since=captured, alpha=None)
    assert model.read(["layers.0.w"])["layers.0.w"].data == backend.dump(commit)["layers.0.w"].data
    backend.merge(model, backend.load(tensors_of(model, 2.0)), since=None, alpha=0.5)
    assert all(math.isfinite(v) for v in model.parameters["layers.1.w"].values)


def tensors_of(model: FloatModel, factor: float) -> dict[str, TensorBytes]:
    return {
        n: Vector.of(v.shape, (x * factor for x in v.values)).to_bytes()
        for n, v in model.parameters.items()
    }


def test_bad_input_raises_naming_what_is_wrong() -> None:
    backend = FloatBackend()
    fb, _ = both(0)
    with pytest.raises(ValueError, match="F32 deltas only"):
        backend.encode(fb, "F4")
    bad = {n: Vector.of(v.shape, [math.nan] * len(v.values)) for n, v in fb.items()}
    with pytest.raises(NonFinite):
        backend.encode(bad, None)
    with pytest.raises(NonFinite):
        backend.lend_plain(bad)
    assert {n: bytes(v.data) for n, v in backend.lend_plain(fb).items()} == {
        n: v.data for n, v in backend.encode(fb, None)[0].items()
    }
    schema = Schema.of([])
    with pytest.raises(SchemaMismatch):
        backend.decode(tensors(0), schema)
    with pytest.raises(TypeError, match="F32 only"):
        backend.load({"w": TensorBytes(dtype="F16", shape=(1,), data=b"\0\0")})
    with pytest.raises(ValueError, match="finite"):
        backend.weighted_sum([(math.inf, fb)])
    model = FloatModel.layered(1, 2)
    with pytest.raises(SchemaMismatch):
        model.write({"layers.0.w": TensorBytes(dtype="F32", shape=(3,), data=bytes(12))})


def test_norm_matches_torch_and_reports_non_finite_values() -> None:
    fb, tb = both(4, 3.0)
    assert FloatBackend().norm(fb) == pytest.approx(TorchBackend("cpu").norm(tb), rel=1e-6)
    assert FloatBackend().norm({}) == 0.0
    huge = {"w": Vector.of((2,), [3e38, -3e38])}
    assert math.isfinite(FloatBackend().norm(huge))
    assert FloatBackend().norm({"w": Vector.of((2,), [1.0, math.inf])}) == math.inf
    assert math.isnan(FloatBackend().norm({"w": Vector.of((1,), [math.nan])}))
