"""Fixtures that run one test suite against both backends: ``fw`` is torch or MLX."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gradientmail.core.tensors import DType, TensorBytes

_NUMPY = {"F32": np.float32, "F16": np.float16}


class Framework:
    """A backend with the few conversions the tests need to build and inspect its tensors."""

    name: str
    backend: Any

    def tensor(self, values: Any, dtype: DType = "F32") -> Any:
        """A tensor of ``dtype`` from ``values`` (F32 values rounded to nearest even)."""
        array = np.asarray(values, dtype=np.float32)
        return self.from_bytes(_bytes(array, dtype))

    def tensors(self, arrays: dict[str, Any], dtype: DType = "F32") -> dict[str, Any]:
        return {name: self.tensor(a, dtype) for name, a in arrays.items()}

    def from_bytes(self, value: TensorBytes) -> Any:
        return self.backend.load({"t": value})["t"]

    def numpy(self, t: Any) -> np.ndarray[Any, Any]:
        """An F32 NumPy copy of ``t``, exactly."""
        value = self.backend.dump({"t": self.backend.cast({"t": t}, _f32_schema(t))["t"]})["t"]
        return np.frombuffer(value.data, np.float32).reshape(value.shape).copy()


class TorchFramework(Framework):
    name = "torch"

    def __init__(self) -> None:
        from gradientmail.adapters import TorchBackend

        self.backend = TorchBackend("cpu")


class MLXFramework(Framework):
    name = "mlx"

    def __init__(self) -> None:
        from gradientmail.adapters import MLXBackend

        self.backend = MLXBackend()


def _f32_schema(t: Any) -> Any:
    from gradientmail.core.tensors import ParameterSpec, Schema

    return Schema.of([ParameterSpec(name="t", dtype="F32", shape=tuple(t.shape))])


def _bytes(array: np.ndarray[Any, Any], dtype: DType) -> TensorBytes:
    if dtype == "BF16":
        bits = array.astype(np.float32).view(np.uint32).astype(np.uint64)
        # Round to nearest even on the upper half of the F32 bits.
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        data = rounded.astype(np.uint16).tobytes()
    else:
        data = array.astype(_NUMPY[dtype]).tobytes()
    return TensorBytes(dtype=dtype, shape=array.shape, data=data)


def make_framework(name: str) -> Framework:
    if name == "mlx":
        pytest.importorskip("mlx.core")
        return MLXFramework()
    pytest.importorskip("torch")
    return TorchFramework()


@pytest.fixture(params=["torch", "mlx"], scope="module")
def fw(request: pytest.FixtureRequest) -> Framework:
    return make_framework(request.param)


@pytest.fixture(scope="module")
def torch_fw() -> Framework:
    return make_framework("torch")


@pytest.fixture(scope="module")
def mlx_fw() -> Framework:
    return make_framework("mlx")
