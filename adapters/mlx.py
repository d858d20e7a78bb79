"""MLX: the adapter of an ``mlx.nn.Module`` and the backend doing a node's tensor work.

MLX arrays are immutable: the adapter writes with ``Module.update``, keeping the parameter
tree's paths, and a capture is a reference to the current arrays. The quantized formats are
those of the ``formats`` module, computed with MLX ops to the same bytes as torch's backend.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import mlx.core as mx
import mlx.nn
import mlx.utils
import numpy as np

from gradientmail.adapters import formats
from gradientmail.adapters.base import Adapter, Tensors
from gradientmail.core.errors import NonFinite
from gradientmail.core.tensors import (
    F4_BLOCK,
    DType,
    ParameterSpec,
    PayloadDType,
    Quantized,
    Schema,
    SchemaMismatch,
    TensorBytes,
    scale_name,
    validate,
)

__all__ = ["MLXAdapter", "MLXBackend"]

# MLX's stubs do not cover mlx.nn and mlx.utils fully; they are used untyped.
nn = cast(Any, mlx.nn)
_utils = cast(Any, mlx.utils)

_DTYPE: dict[Any, DType] = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16"}
_MLX: dict[PayloadDType, Any] = {
    "F32": mx.float32,
    "F16": mx.float16,
    "BF16": mx.bfloat16,
    "F8_E4M3": mx.uint8,
    "F8_E8M0": mx.uint8,
    "F4": mx.uint8,
}
# NumPy has no bfloat16: its bytes go through uint16.
_NUMPY: dict[Any, Any] = {mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16}


class MLXAdapter:
    """The trainable parameters of an ``mlx.nn.Module`` (``trainable_parameters``), named as
    ``tree_flatten`` names them (``layers.0.weight``). The set is fixed when the adapter is
    made."""

    def __init__(self, module: Any) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"MLXAdapter takes an mlx.nn.Module, not {type(module).__name__}")
        self.module = module
        specs = []
        for name, array in _utils.tree_flatten(module.trainable_parameters()):
            dtype = _DTYPE.get(array.dtype)
            if dtype is None:
                raise TypeError(
                    f"parameter {name!r} is {array.dtype}; gradientmail exchanges float32, "
                    "float16 and bfloat16 parameters (convert it, or freeze it)"
                )
            specs.append(ParameterSpec(name=name, dtype=dtype, shape=tuple(array.shape)))
        self._schema = Schema.of(specs)

    @property
    def schema(self) -> Schema:
        return self._schema

    def tensors(self, names: Iterable[str]) -> dict[str, Any]:
        """The model's current arrays, by name."""
        names = list(names)
        unknown = [name for name in names if name not in self._schema]
        if unknown:
            raise SchemaMismatch(unknown, "not trainable parameters of the model")
        current = dict(_utils.tree_flatten(self.module.parameters()))
        return {name: current[name] for name in names}

    def read(self, names: Sequence[str]) -> dict[str, TensorBytes]:
        return {name: _to_bytes(array) for name, array in self.tensors(names).items()}

    def write(self, tensors: Mapping[str, TensorBytes]) -> None:
        validate(self._schema, tensors, tensors)
        self.update(_evaluated({name: _from_bytes(value) for name, value in tensors.items()}))

    def update(self, arrays: Mapping[str, Any]) -> None:
        """Replace the named parameters with ``arrays``, keeping the tree's paths."""
        self.module.update(_utils.tree_unflatten(list(arrays.items())))


class MLXBackend:
    """The tensor work of a node in MLX, on MLX's default device.

    Every array it returns is evaluated, so the learner's communication thread and the training
    thread can hand them to each other.
    """

    name = "mlx"

    def __repr__(self) -> str:
        return "MLXBackend()"

    def adapter(self, model: object) -> Adapter:
        if isinstance(model, MLXAdapter):
            return model
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"the MLX backend takes an mlx.nn.Module, not {type(model).__qualname__}"
            )
        return MLXAdapter(model)

    def capture(self, adapter: Adapter, names: Sequence[str]) -> Tensors:
        if not isinstance(adapter, MLXAdapter):
            return self.load(adapter.read(names))
        # New array handles (no copy: arrays are immutable), so that an in-place ``a[i] = v``
        # on a live array later cannot reach them. Evaluated here, on the training thread,
        # because MLX evaluates a lazy array only on the thread whose stream made it.
        return _evaluated({name: mx.array(a) for name, a in adapter.tensors(names).items()})

    def ready(self, tensors: Tensors) -> None:
        mx.eval(list(tensors.values()))

    def load(self, tensors: Mapping[str, TensorBytes]) -> Tensors:
        loaded = {}
        for name, value in tensors.items():
            if value.dtype not in ("F32", "F16", "BF16"):
                raise TypeError(f"tensor {name!r}: load takes F32, F16 or BF16, not {value.dtype}")
            loaded[name] = _from_bytes(value)
        return _evaluated(loaded)

    def dump(self, tensors: Tensors) -> dict[str, TensorBytes]:
        return {name: _to_bytes(a) for name, a in tensors.items()}

    def delta(self, base: Tensors, local: Tensors, residual: Tensors | None = None) -> Tensors:
        names = _matching("delta", base, local, residual)
        out = {}
        for name in names:
            d = _f32(base[name]) - _f32(local[name])
            out[name] = d if residual is None else d + _f32(residual[name])
        return _evaluated(out)

    def encode(
        self, delta: Tensors, quantization: Quantized | None
    ) -> tuple[dict[str, TensorBytes], Tensors]:
        delta = {name: _f32(a) for name, a in delta.items()}
        bad = _nonfinite(delta)
        if bad:
            raise NonFinite(bad)
        payload: dict[str, TensorBytes] = {}
        residual: Tensors = {}
        for name, x in delta.items():
            if quantization is None:
                payload[name] = _to_bytes(x)
                residual[name] = mx.zeros_like(x)
                continue
            encoded, scales, decoded = _QUANTIZE[quantization](x)
            shape = (x.size + (-x.size) % F4_BLOCK,) if quantization == "F4" else x.shape
            payload[name] = _raw(quantization, tuple(shape), encoded)
            payload[scale_name(name)] = _raw(
                "F32" if quantization == "F8_E4M3" else "F8_E8M0", tuple(scales.shape), scales
            )
            residual[name] = x - decoded
        return payload, _evaluated(residual)

    def decode(self, payload: Mapping[str, TensorBytes], schema: Schema) -> Tensors:
        layout = formats.payload_layout(payload, schema)
        out: Tensors = {}
        for spec in schema.parameters:
            data = _from_bytes(payload[spec.name])
            if layout[spec.name] == "F8_E4M3":
                scale = _from_bytes(payload[scale_name(spec.name)])
                out[spec.name] = (mx.from_fp8(data, dtype=mx.float32) * scale).reshape(spec.shape)
            elif layout[spec.name] == "F4":
                scales = _from_bytes(payload[scale_name(spec.name)])
                out[spec.name] = _dequantize_f4(data, scales, spec.shape)
            else:
                out[spec.name] = data.astype(mx.float32)
        bad = _nonfinite(_evaluated(out))
        if bad:
            raise NonFinite(bad)
        return out

    def average(self, weighted: Sequence[tuple[float, Tensors]]) -> Tensors:
        # Normalized first so that large weights (tokens) cannot overflow F32.
        coefficients = formats.normalized_weights([w for w, _ in weighted])
        return self.weighted_sum(list(zip(coefficients, (t for _, t in weighted), strict=True)))

    def weighted_sum(self, weighted: Sequence[tuple[float, Tensors]]) -> Tensors:
        formats.check_weights(w for w, _ in weighted)
        names = _matching("weighted_sum", *(t for _, t in weighted))
        out = {}
        for name in names:
            # The same ops in the same order as the torch backend: the same F32 results.
            terms = [_f32(t[name]) * w for w, t in weighted]
            total = terms[0]
            for term in terms[1:]:
                total = total + term
            out[name] = total
        return _evaluated(out)

    def norm(self, tensors: Tensors) -> float:
        total = 0.0
        for a in tensors.values():
            x = _f32(a)
            if x.size == 0:
                continue
            peak = cast(float, mx.max(mx.abs(x)).item())
            if not math.isfinite(peak):
                return math.inf if peak == math.inf else math.nan
            if peak > 0.0:
                # Scaled by the peak: squares of F32 values above 1.8e19 would overflow.
                scaled = cast(float, mx.sqrt(mx.sum(mx.square(x / peak))).item())
                total += (peak * scaled) ** 2
        return math.sqrt(total)

    def outer_step(
        self,
        master: Tensors,
        momentum: Tensors | None,
        gradient: Tensors,
        *,
        lr: float,
        beta: float,
        nesterov: bool = True,
    ) -> tuple[Tensors, Tensors]:
        formats.check_outer(lr, beta)
        names = _matching("outer_step", master, gradient, momentum)
        new_master, new_momentum = {}, {}
        for name in names:
            g = _f32(gradient[name])
            m = g if momentum is None else _f32(momentum[name]) * beta + g
            update = g + m * beta if nesterov else m
            new_master[name] = _f32(master[name]) - update * lr
            new_momentum[name] = m
        return _evaluated(new_master), _evaluated(new_momentum)

    def cast(self, tensors: Tensors, schema: Schema) -> Tensors:
        _check_shapes("cast", schema, tensors)
        out = {name: a.astype(_MLX[schema[name].dtype]) for name, a in tensors.items()}
        return _evaluated(out)

    def merge(
        self,
        adapter: Adapter,
        commit: Tensors,
        *,
        since: Tensors | None,
        alpha: float | None,
    ) -> None:
        formats.check_alpha(alpha)
        names = _matching("merge", commit, since if alpha is None else None)
        _check_shapes("merge", adapter.schema, commit)
        if isinstance(adapter, MLXAdapter):
            live = adapter.tensors(names)
        else:
            live = self.load(adapter.read(names))
        merged = {n: _merged(live[n], commit[n], since, alpha, n) for n in names}
        rounded = self.cast(merged, adapter.schema)
        if isinstance(adapter, MLXAdapter):
            adapter.update(rounded)
        else:
            adapter.write(self.dump(rounded))


def _evaluated(tensors: Tensors) -> Tensors:
    """``tensors``, computed: every array this backend returns is, so that another thread may
    use it (MLX evaluates a lazy array only on the thread whose stream made it)."""
    mx.eval(list(tensors.values()))
    return tensors


def _merged(live: Any, commit: Any, since: Tensors | None, alpha: float | None, name: str) -> Any:
    c = _f32(commit)
    if alpha is not None:
        return _f32(live) * alpha + c * (1.0 - alpha)
    if since is not None:
        return c + (_f32(live) - _f32(since[name]))
    return c


def _f32(a: Any) -> Any:
    return a if a.dtype == mx.float32 else a.astype(mx.float32)


def _matching(what: str, *groups: Tensors | None) -> list[str]:
    """The names shared by every group of tensors (None is skipped), with equal shapes."""
    present = [g for g in groups if g is not None]
    names = set(present[0])
    differing = set().union(*(names ^ set(g) for g in present))
    if differing:
        raise SchemaMismatch(sorted(differing), f"{what}: the tensors name different parameters")
    order = sorted(names)
    shapes = [n for n in order if len({tuple(g[n].shape) for g in present}) > 1]
    if shapes:
        raise SchemaMismatch(shapes, f"{what}: the tensors differ in shape")
    return order


def _check_shapes(what: str, schema: Schema, tensors: Tensors) -> None:
    bad = [n for n, a in tensors.items() if n not in schema or tuple(a.shape) != schema[n].shape]
    if bad:
        raise SchemaMismatch(sorted(bad), f"{what}: not parameters of the schema, or other shapes")


def _nonfinite(arrays: Mapping[str, Any]) -> list[str]:
    if not arrays:
        return []
    flags = cast(list[bool], mx.stack([mx.all(mx.isfinite(a)) for a in arrays.values()]).tolist())
    return sorted(name for name, ok in zip(arrays, flags, strict=True) if not ok)


def _to_bytes(a: Any) -> TensorBytes:
    dtype = _DTYPE.get(a.dtype)
    if dtype is None:
        raise TypeError(f"an array of {a.dtype} has no F32/F16/BF16 bytes")
    return _raw(dtype, tuple(a.shape), a)


def _raw(dtype: PayloadDType, shape: tuple[int, ...], a: Any) -> TensorBytes:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return TensorBytes(dtype=dtype, shape=shape, data=np.asarray(a).tobytes())


def _from_bytes(value: TensorBytes) -> Any:
    """An array of ``value``: its dtype for F32/F16/BF16, else its raw bytes (uint8)."""
    dtype = _MLX[value.dtype]
    if dtype == mx.uint8:
        return mx.array(np.frombuffer(value.data, dtype=np.uint8))
    host = np.frombuffer(value.data, dtype=_NUMPY[dtype]).reshape(value.shape)
    array = mx.array(host)
    return array.view(mx.bfloat16) if dtype == mx.bfloat16 else array


def _f8(x: Any) -> tuple[Any, Any, Any]:
    amax = mx.max(mx.abs(x)) if x.size else mx.array(0.0)
    bits = amax.view(mx.int32)
    above = ((bits & 0x7FFFFF) > 0x600000).astype(mx.int32)  # mantissa beyond 1.75 (448)
    k = mx.maximum(((bits >> 23) & 0xFF) - 135 + above, -126)
    scale = ((k + 127) << 23).view(mx.float32)
    inverse = ((127 - k) << 23).view(mx.float32)
    limit = mx.where(k >= formats.E4M3_TOP_EXPONENT, formats.E4M3_TOP_LIMIT, formats.E4M3_MAX)
    codes = mx.to_fp8(mx.clip(x * inverse, -limit, limit))
    return codes, scale, mx.from_fp8(codes, dtype=mx.float32) * scale


def _f4(x: Any) -> tuple[Any, Any, Any]:
    n = x.size
    rows = mx.pad(x.reshape(-1), [(0, (-n) % F4_BLOCK)]).reshape(-1, F4_BLOCK)
    biased = (mx.max(mx.abs(rows), axis=1).view(mx.int32) >> 23) & 0xFF
    exponents = mx.maximum(biased - 2, 0)
    inverse = ((254 - exponents) << 23).view(mx.float32)
    scaled = rows * inverse[:, None]
    magnitude = mx.abs(scaled)
    codes = (scaled.view(mx.int32) < 0).astype(mx.uint8) << 3
    for threshold, inclusive in formats.E2M1_STEPS:
        passed = (magnitude >= threshold) if inclusive else (magnitude > threshold)
        codes = codes + passed.astype(mx.uint8)
    pairs = codes.reshape(-1, 2)
    packed = pairs[:, 0] | (pairs[:, 1] << 4)
    exponents = exponents.astype(mx.uint8)
    decoded = _dequantize_codes(codes.reshape(-1), exponents)[:n].reshape(x.shape)
    return packed, exponents, decoded


def _dequantize_codes(codes: Any, exponents: Any) -> Any:
    values = mx.take(mx.array(formats.E2M1_VALUES, mx.float32), codes).reshape(-1, F4_BLOCK)
    scales = mx.take(mx.array(formats.E8M0_VALUES, mx.float32), exponents)
    return (values * scales[:, None]).reshape(-1)


def _dequantize_f4(packed: Any, exponents: Any, shape: tuple[int, ...]) -> Any:
    codes = mx.stack([packed & 0xF, packed >> 4], axis=1).reshape(-1)
    return _dequantize_codes(codes, exponents)[: math.prod(shape)].reshape(shape)


_QUANTIZE = {"F8_E4M3": _f8, "F4": _f4}
