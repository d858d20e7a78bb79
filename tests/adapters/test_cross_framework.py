"""Bytes are the contract: what one framework's backend writes, the other reads to the same
numbers, and both compute the same outer steps."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gradientmail.core.tensors import ParameterSpec, Schema

SHAPES = {
    "scalar": (),
    "one": (1,),
    "odd": (3, 11),
    "tail": (65,),
    "wide": (8, 96),
    "empty": (0, 3),
}


def deltas(seed: int) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in SHAPES.items():
        size = int(np.prod(shape))
        out[name] = (
            rng.standard_normal(shape) * np.exp2(rng.integers(-12, 12, size)).reshape(shape)
        ).astype(np.float32)
    return out


def schema() -> Schema:
    return Schema.of(ParameterSpec(name=n, dtype="BF16", shape=s) for n, s in SHAPES.items())


@pytest.mark.parametrize("quantization", [None, "F8_E4M3", "F4"])
@pytest.mark.parametrize("direction", ["torch->mlx", "mlx->torch"])
def test_payloads_decode_to_the_same_numbers_across_frameworks(
    torch_fw: Any, mlx_fw: Any, quantization: Any, direction: str
) -> None:
    writer, reader = (torch_fw, mlx_fw) if direction == "torch->mlx" else (mlx_fw, torch_fw)
    x = deltas(11)
    payload, residual = writer.backend.encode(writer.tensors(x), quantization)
    # Both write the very same bytes, scales included.
    assert reader.backend.encode(reader.tensors(x), quantization)[0] == payload
    theirs = reader.backend.decode(payload, schema())
    ours = writer.backend.decode(payload, schema())
    for name in SHAPES:
        assert np.array_equal(reader.numpy(theirs[name]), writer.numpy(ours[name]))
        assert np.array_equal(reader.numpy(theirs[name]) + writer.numpy(residual[name]), x[name])


def test_arithmetic_agrees_across_frameworks(torch_fw: Any, mlx_fw: Any) -> None:
    rng = np.random.default_rng(12)
    shape = (33, 17)
    a, b, r = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    results = {}
    for fw in (torch_fw, mlx_fw):
        delta = fw.backend.delta(
            {"w": fw.tensor(a, "BF16")}, {"w": fw.tensor(b, "BF16")}, {"w": fw.tensor(r)}
        )
        weighted = [(3.0, delta), (5.0, {"w": fw.tensor(b)}), (1.0, {"w": fw.tensor(r)})]
        mean = fw.backend.average(weighted)
        total = fw.backend.weighted_sum([(w * 0.37, t) for w, t in weighted])
        rounded = fw.backend.cast(
            mean, Schema.of([ParameterSpec(name="w", dtype="BF16", shape=shape)])
        )
        results[fw.name] = [fw.numpy(t["w"]) for t in (delta, mean, total, rounded)]
    for ours, theirs in zip(results["torch"], results["mlx"], strict=True):
        assert np.array_equal(ours, theirs)  # separate F32 roundings in the same order


def test_outer_steps_agree_within_f32_rounding(torch_fw: Any, mlx_fw: Any) -> None:
    rng = np.random.default_rng(13)
    start = rng.standard_normal((40, 9)).astype(np.float32)
    gradients = [rng.standard_normal((40, 9)).astype(np.float32) * 0.1 for _ in range(20)]
    states = {}
    for fw in (torch_fw, mlx_fw):
        master, momentum = {"w": fw.tensor(start)}, None
        for g in gradients:
            master, momentum = fw.backend.outer_step(
                master, momentum, {"w": fw.tensor(g)}, lr=0.7, beta=0.9
            )
        states[fw.name] = (fw.numpy(master["w"]), fw.numpy(momentum["w"]))
    for ours, theirs in zip(states["torch"], states["mlx"], strict=True):
        # torch fuses ``a + alpha * b`` into one rounding and MLX rounds twice: a few ulps
        # apart after 20 steps, never more.
        ulp = np.spacing(np.maximum(np.abs(ours), np.abs(theirs)))
        assert (np.abs(ours - theirs) <= 8 * ulp + 1e-7).all()
