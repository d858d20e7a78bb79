"""MLX: the adapter of an ``mlx.nn.Module`` and the backend doing a node's tensor work.

MLX arrays are immutable: the adapter writes with ``Module.update``, keeping the parameter
tree's paths, and a capture is a reference to the current arrays. What the protocol computes,
and in which order, is ``arrays.ArrayBackend``'s, shared with torch so that a payload is the
same bytes whichever framework wrote it; this module supplies MLX's primitives and evaluates
every array it returns. Peaks and finite checks reduce the F32 bits as integers
(``_amax_bits``), which on the CPU is several times faster than float reductions.
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
from gradientmail.adapters.arrays import ArrayBackend, plain_bytes, served
from gradientmail.adapters.base import Tensors
from gradientmail.core import fragments
from gradientmail.core.tensors import (
    F4_BLOCK,
    DType,
    ParameterSpec,
    PayloadDType,
    Schema,
    TensorBytes,
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
_F4_PAIRS = mx.array(
    [[formats.E2M1_VALUES[b & 0xF], formats.E2M1_VALUES[b >> 4]] for b in range(256)], mx.float32
)
"""The two values of each packed F4 byte, the low nibble first."""
# NumPy has no bfloat16: its bytes go through uint16.
_NUMPY: dict[Any, Any] = {mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16}


class MLXAdapter:
    """The trainable parameters of an ``mlx.nn.Module`` (``trainable_parameters``), named as
    ``tree_flatten`` names them (``layers.0.weight``). The set is fixed when the adapter is
    made."""

    row_blocks = True
    """Serves row blocks of its parameters (``core.fragments``): a run it creates may split a
    large parameter across fragments."""

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
        """The model's current arrays, by name; a row block (``name[start:stop]``,
        ``core.fragments``) is those rows of its parameter."""
        names = list(names)
        unknown = [name for name in names if name not in self._schema]
        if unknown:
            served(self._schema, unknown)  # raises unless every one is a row block
        current = dict(_utils.tree_flatten(self.module.parameters()))
        out = {}
        for name in names:
            found = fragments.block(name, self._schema)
            if found is None:
                out[name] = current[name]
            else:
                parent, start, stop = found
                out[name] = current[parent][start:stop]
        return out

    def read(self, names: Sequence[str]) -> dict[str, TensorBytes]:
        return {name: _to_bytes(array) for name, array in self.tensors(names).items()}

    def write(self, tensors: Mapping[str, TensorBytes]) -> None:
        validate(served(self._schema, tensors), tensors, tensors)
        self.update(_evaluated({name: _from_bytes(value) for name, value in tensors.items()}))

    def update(self, arrays: Mapping[str, Any]) -> None:
        """Replace the named parameters (or row blocks of them) with ``arrays``, keeping the
        tree's paths. A block's parameter becomes a new array with those rows replaced."""
        whole: dict[str, Any] = {}
        rows: dict[str, list[tuple[int, int, Any]]] = {}
        for name, array in arrays.items():
            found = fragments.block(name, self._schema)
            if found is None:
                whole[name] = array
            else:
                rows.setdefault(found[0], []).append((found[1], found[2], array))
        if rows:
            current = dict(_utils.tree_flatten(self.module.parameters()))
            for parent, blocks in rows.items():
                # A new handle: an in-place update must not reach arrays captured from it.
                updated = mx.array(whole[parent] if parent in whole else current[parent])
                for start, stop, array in blocks:
                    updated[start:stop] = array
                whole[parent] = updated
            mx.eval(list(whole.values()))
        self.module.update(_utils.tree_unflatten(list(whole.items())))


class MLXBackend(ArrayBackend):
    """The tensor work of a node in MLX, on MLX's default device.

    Every array it returns is evaluated, so the learner's communication thread and the training
    thread can hand them to each other.
    """

    name = "mlx"
    _adapter_type = MLXAdapter
    _module_type = nn.Module
    _takes = "the MLX backend takes an mlx.nn.Module"

    def __repr__(self) -> str:
        return "MLXBackend()"

    spills_base = True
    """A node keeps its fragments' base in a file by default: MLX's arrays share the host's
    memory (``Session(spill_base=...)``)."""

    def ready(self, tensors: Tensors) -> None:
        mx.eval(list(tensors.values()))

    def _capture(self, adapter: MLXAdapter, names: Sequence[str], into: Tensors) -> Tensors:
        # ``into`` is empty: nothing is reserved (``_reserve``). New array handles (no copy:
        # arrays are immutable), so that an in-place ``a[i] = v`` on a live array later cannot
        # reach them. Evaluated here, on the training thread, because MLX evaluates a lazy
        # array only on the thread whose stream made it.
        return _evaluated({name: mx.array(a) for name, a in adapter.tensors(names).items()})

    def _merge_live(
        self,
        adapter: MLXAdapter,
        names: Sequence[str],
        commit: Tensors,
        since: Tensors | None,
        alpha: float | None,
    ) -> None:
        live = adapter.tensors(names)
        merged = {n: self._merged(live[n], commit[n], since, alpha, n) for n in names}
        adapter.update(self.cast(merged, served(adapter.schema, names)))

    def _shift_live(self, adapter: MLXAdapter, names: Sequence[str], difference: Tensors) -> None:
        live = adapter.tensors(names)
        shifted = {n: self._f32(live[n]) + difference[n] for n in names}
        adapter.update(self.cast(shifted, served(adapter.schema, names)))

    def _evaluated(self, tensors: Tensors) -> Tensors:
        return _evaluated(tensors)

    def _array(self, value: TensorBytes) -> Any:
        return _from_bytes(value)

    def _plain_bytes(self, a: Any) -> TensorBytes:
        return _to_bytes(a)

    def _host(self, a: Any) -> bytes:
        return _host_bytes(a)

    def _lent(self, a: Any) -> memoryview:
        if a.dtype == mx.bfloat16:
            a = a.view(mx.uint16)
        return np.ascontiguousarray(a).reshape(-1).view(np.uint8).data.cast("B")

    def _dtype_code(self, a: Any) -> DType:
        dtype = _DTYPE.get(a.dtype)
        if dtype is None:
            raise TypeError(f"a tensor of {a.dtype} has no F32/F16/BF16 bytes")
        return dtype

    def _f32(self, a: Any) -> Any:
        return a if a.dtype == mx.float32 else a.astype(mx.float32)

    def _f32_at(self, a: Any, live: Any) -> Any:
        return self._f32(a)

    def _cast(self, a: Any, dtype: PayloadDType) -> Any:
        return a.astype(_MLX[dtype])

    def _int32(self, a: Any) -> Any:
        return a.astype(mx.int32)

    def _uint8(self, a: Any) -> Any:
        return a.astype(mx.uint8)

    def _bits(self, a: Any) -> Any:
        return a.view(mx.int32)

    def _from_bits(self, a: Any) -> Any:
        return a.view(mx.float32)

    def _zeros(self, a: Any) -> Any:
        return mx.broadcast_to(mx.array(0.0, mx.float32), a.shape)

    def _copy(self, a: Any) -> Any:
        return a  # immutable: sharing it is a copy

    def _times_plus(self, a: Any, s: float, b: Any) -> Any:
        return a * s + b

    def _plus_times(self, a: Any, b: Any, s: float) -> Any:
        return a + b * s

    def _at_least(self, a: Any, low: int) -> Any:
        return mx.maximum(a, low)

    def _clip(self, a: Any, low: Any, high: Any) -> Any:
        return mx.clip(a, low, high)

    def _where(self, condition: Any, yes: float, no: float) -> Any:
        return mx.where(condition, yes, no)

    def _amax(self, a: Any) -> Any:
        return _amax_bits(a.reshape(-1), None).view(mx.float32) if a.size else mx.array(0.0)

    def _amax_rows(self, rows: Any) -> Any:
        return _amax_bits(rows, 1).view(mx.float32)

    def _l2(self, a: Any) -> float:
        return cast(float, mx.sqrt(mx.sum(mx.square(a))).item())

    def _finite(self, arrays: list[Any]) -> list[bool]:
        # The largest bits among positive and among negative floats, as _amax_bits: NaN and
        # Inf are the largest of either sign.
        flags = []
        for a in arrays:
            bits = a.reshape(-1).view(mx.int32)
            positive = mx.max(bits) < 0x7F800000
            flags.append(positive & (mx.max(bits.view(mx.uint32)) < 0xFF800000))
        return cast(list[bool], mx.stack(flags).tolist())

    def _to_e4m3(self, a: Any) -> Any:
        return mx.to_fp8(a)

    def _from_e4m3(self, codes: Any) -> Any:
        return mx.from_fp8(codes, dtype=mx.float32)

    def _padded(self, flat: Any, count: int) -> Any:
        return mx.pad(flat, [(0, count)])

    def _lookup(self, table: tuple[float, ...], indices: Any) -> Any:
        return mx.take(mx.array(table, mx.float32), indices)

    def _round_f4(
        self, x: Any, inverse: Any, scales: Any, owned: bool = False
    ) -> tuple[Any, Any]:  # MLX arrays are immutable: ``owned`` changes nothing
        n = x.size
        packed, residual = _round_f4_rows(self._blocks(x), inverse[:, None], scales[:, None])
        residual = residual.reshape(-1)
        return packed, (residual if residual.size == n else residual[:n]).reshape(x.shape)

    def _dequantize_f4(self, packed: Any, exponents: Any, shape: tuple[int, ...]) -> Any:
        # One gather of both values of each byte, about twice as fast as splitting the
        # nibbles and gathering each.
        values = mx.take(_F4_PAIRS, packed, axis=0).reshape(-1, F4_BLOCK)
        scales = self._lookup(formats.E8M0_VALUES, exponents)
        decoded = (values * scales[:, None]).reshape(-1)
        return decoded[: math.prod(shape)].reshape(shape)

    def _interleave(self, a: Any, b: Any) -> Any:
        return mx.stack([a, b], axis=1).reshape(-1)


def _round_f4_rows_steps(rows: Any, inverse: Any, scales: Any) -> tuple[Any, Any]:
    """``ArrayKernels._round_f4`` over blocks already padded to rows, by integer and float
    arithmetic alone.

    MLX's gathers run at a twentieth of memory speed on the CPU, so neither the comparison
    passes of the default steps nor torch's table of keys pays here. A scaled magnitude
    ``m < 8`` is rounded to the E2M1 grid by the FPU itself: adding and taking away
    ``C = step * 2**23`` (step 0.5 below 2, 1 below 4, else 2, read off ``m``'s exponent)
    rounds ``m`` to a multiple of the step, ties to even. An even multiple is an even code on
    each stretch of the grid, which is the tie rule of ``formats.E2M1_STEPS``; 8 saturates to
    6. The code of a grid value ``v`` comes from its bits: from 1 up, its exponent and one
    mantissa bit less 252 (1.0 is code 2 ... 6.0 code 7); 0.5 is code 1 and 0 code 0; the sign
    bit goes above. The decoded value is ``v`` with ``x``'s sign, times the block's scale.
    Fused by ``mx.compile``; the tests hold it to the reference bit for bit, ties, thresholds
    and subnormals included.
    """
    scaled = rows * inverse
    bits = scaled.view(mx.int32)
    magnitude_bits = bits & 0x7FFFFFFF
    exponent = mx.clip(magnitude_bits >> 23, 127, 129)  # the step is 2 ** (exponent - 128)
    c = ((exponent + 22) << 23).view(mx.float32)
    value = mx.minimum((magnitude_bits.view(mx.float32) + c) - c, formats.E2M1_MAX)
    grid = value.view(mx.int32)
    code = mx.maximum((grid >> 22) - 252, 0) + (grid == 0x3F000000)  # 0x3F000000: 0.5
    codes = (code | ((bits >> 28) & 8)).astype(mx.uint8)
    signed = (grid | (bits & -0x80000000)).view(mx.float32)
    pairs = codes.reshape(-1, 2)  # two codes a byte, the first low
    return pairs[:, 0] | (pairs[:, 1] << 4), rows - signed * scales


_round_f4_rows = mx.compile(_round_f4_rows_steps)


def _amax_bits(a: Any, axis: int | None) -> Any:
    """The int32 bits of ``max|a|`` (along ``axis``) of the F32 ``a``, NaN and Inf included.

    Integer reductions over the bits, with no temporary of ``a``'s size, are several times
    faster on the CPU than a float ``max`` of ``abs``: F32 bits order as their magnitudes
    within a sign, so the int32 maximum is the largest non-negative float's bits (if any) and
    the uint32 maximum the largest negative one's, sign bit set.
    """
    bits = a.view(mx.int32)
    positive = mx.maximum(mx.max(bits, axis=axis), 0)
    negative = (mx.max(bits.view(mx.uint32), axis=axis) & 0x7FFFFFFF).astype(mx.int32)
    return mx.maximum(positive, negative)


def _evaluated(tensors: Tensors) -> Tensors:
    """``tensors``, computed: every array this backend returns is, so that another thread may
    use it (MLX evaluates a lazy array only on the thread whose stream made it)."""
    mx.eval(list(tensors.values()))
    return tensors


def _to_bytes(a: Any) -> TensorBytes:
    return plain_bytes(a, _DTYPE, _host_bytes)


def _host_bytes(a: Any) -> bytes:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.asarray(a).tobytes()


def _from_bytes(value: TensorBytes) -> Any:
    """An array of ``value``: its dtype for F32/F16/BF16, else its raw bytes (uint8)."""
    dtype = _MLX[value.dtype]
    if dtype == mx.uint8:
        return mx.array(np.frombuffer(value.data, dtype=np.uint8))
    host = np.frombuffer(value.data, dtype=_NUMPY[dtype]).reshape(value.shape)
    array = mx.array(host)
    return array.view(mx.bfloat16) if dtype == mx.bfloat16 else array
