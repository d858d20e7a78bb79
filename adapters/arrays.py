"""What the torch and MLX backends share: the ``Backend`` protocol, written once over array
primitives.

``ArrayBackend`` holds every rule of the protocol: which tensors must match, the order of the
F32 roundings (which is what makes a payload the same bytes whichever framework wrote it), the
payload layouts, the outer step and the merge formulas; the quantized formats are those of its
base, ``kernels.ArrayKernels``. A framework's backend subclasses it and supplies only the
primitives, the ``_`` methods declared abstract here and in ``ArrayKernels``: conversions, the
ops whose names or kernels differ between frameworks, and what its device needs (CUDA events in
torch, evaluating lazy arrays in MLX). Beyond them the shared code uses only the array
operations that the ``kernels`` module lists, which torch and MLX do alike.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

from gradientmail.adapters import formats
from gradientmail.adapters.base import Adapter, Tensors
from gradientmail.adapters.kernels import Array, ArrayKernels, numel
from gradientmail.core import fragments
from gradientmail.core.errors import NonFinite
from gradientmail.core.tensors import (
    DTYPES,
    F4_BLOCK,
    DType,
    PayloadDType,
    Quantized,
    Schema,
    SchemaMismatch,
    TensorBytes,
    TensorView,
    scale_name,
)

__all__ = ["ArrayBackend", "check_shapes", "matching", "plain_bytes", "served"]


class _OwnAdapter(Adapter, Protocol):
    """A framework's own adapter class, made from the framework's module."""

    def __init__(self, module: Any) -> None: ...


class ArrayBackend(ArrayKernels):
    """The ``Backend`` protocol over a framework's array primitives."""

    name: str
    _adapter_type: type[_OwnAdapter]
    """The framework's adapter class, whose live parameters ``_capture`` and ``_merge_live``
    reach without going through bytes."""
    _module_type: type[Any]
    _takes: str
    """What ``adapter`` says it takes, refusing another object."""

    def adapter(self, model: object) -> Adapter:
        if isinstance(model, self._adapter_type):
            return model
        if not isinstance(model, self._module_type):
            raise TypeError(f"{self._takes}, not {type(model).__qualname__}")
        return self._adapter_type(model)

    def capture(
        self, adapter: Adapter, names: Sequence[str], *, into: Tensors | None = None
    ) -> Tensors:
        if not isinstance(adapter, self._adapter_type):
            return self.load(adapter.read(names))
        return self._capture(adapter, names, into or {})

    def reserve(self, adapter: Adapter, names: Sequence[str]) -> Tensors:
        if not isinstance(adapter, self._adapter_type):
            return {}
        return self._reserve(adapter, names)

    def load(self, tensors: Mapping[str, TensorBytes]) -> Tensors:
        loaded = {}
        for name, value in tensors.items():
            if value.dtype not in DTYPES:
                raise TypeError(f"tensor {name!r}: load takes F32, F16 or BF16, not {value.dtype}")
            loaded[name] = self._array(value)
        return self._evaluated(loaded)

    def dump(self, tensors: Tensors) -> dict[str, TensorBytes]:
        return {name: self._plain_bytes(t) for name, t in tensors.items()}

    def lend(self, tensors: Tensors) -> dict[str, TensorView]:
        lent = {}
        for name, t in tensors.items():
            dtype = self._dtype_code(t)
            lent[name] = TensorView(dtype=dtype, shape=tuple(t.shape), data=self._lent(t))
        return lent

    def delta(
        self,
        base: Tensors,
        local: Tensors,
        residual: Tensors | None = None,
        *,
        owned: bool = False,
    ) -> Tensors:
        names = matching("delta", base, local, residual)
        out = {}
        for name in names:
            one = None if residual is None else residual[name]
            out[name] = self._delta(base[name], local[name], one, owned=owned)
        return self._evaluated(out)

    def _delta(self, base: Array, local: Array, residual: Array | None, *, owned: bool) -> Array:
        """``base - local (+ residual)`` in F32 (``delta``); a framework whose arrays can be
        written may put it in an owned F32 ``local``."""
        d = self._f32(base) - self._f32(local)
        if residual is not None:
            d += self._f32(residual)
        return d

    def encode(
        self, delta: Tensors, quantization: Quantized | None, *, owned: bool = False
    ) -> tuple[dict[str, TensorBytes], Tensors]:
        delta = {name: self._f32(t) for name, t in delta.items()}
        payload: dict[str, TensorBytes] = {}
        residual: Tensors = {}
        if quantization is None:
            self._refuse_nonfinite(delta)
            for name, x in delta.items():
                payload[name] = self._plain_bytes(x)
                residual[name] = self._zeros(x)
            return payload, self._evaluated(residual)
        # The peaks the scales come from hold any NaN or Inf of the tensor: checking them
        # first refuses every bad tensor, by name, before any is quantized.
        peaks = {name: self._peaks(quantization, x) for name, x in delta.items()}
        self._refuse_nonfinite(self._evaluated(peaks))
        with self._workspace():
            for name, x in delta.items():
                encoded, scales, residual[name] = self._quantize(
                    quantization, x, peaks[name], owned
                )
                n = numel(x)
                shape = (n + (-n) % F4_BLOCK,) if quantization == "F4" else tuple(x.shape)
                payload[name] = TensorBytes(
                    dtype=quantization, shape=shape, data=self._host(encoded)
                )
                payload[scale_name(name)] = TensorBytes(
                    dtype="F32" if quantization == "F8_E4M3" else "F8_E8M0",
                    shape=tuple(scales.shape),
                    data=self._host(scales),
                )
        return payload, self._evaluated(residual)

    def lend_plain(self, delta: Tensors) -> dict[str, TensorView]:
        delta = {name: self._f32(t) for name, t in delta.items()}
        self._refuse_nonfinite(delta)
        return self.lend(delta)

    def decode(self, payload: Mapping[str, TensorBytes], schema: Schema) -> Tensors:
        layout = formats.payload_layout(payload, schema)
        out: Tensors = {}
        with self._workspace():
            for spec in schema.parameters:
                data = self._array(payload[spec.name])
                if layout[spec.name] == "F8_E4M3":
                    scale = self._array(payload[scale_name(spec.name)])
                    out[spec.name] = self._dequantize_f8(data, scale, spec.shape)
                elif layout[spec.name] == "F4":
                    scales = self._array(payload[scale_name(spec.name)])
                    out[spec.name] = self._dequantize_f4(data, scales, spec.shape)
                else:
                    out[spec.name] = self._f32(data)
        self._refuse_nonfinite(self._evaluated(out))
        return out

    def average(self, weighted: Sequence[tuple[float, Tensors]]) -> Tensors:
        # Normalized first so that large weights (tokens) cannot overflow F32.
        coefficients = formats.normalized_weights([w for w, _ in weighted])
        return self.weighted_sum(list(zip(coefficients, (t for _, t in weighted), strict=True)))

    def weighted_sum(self, weighted: Sequence[tuple[float, Tensors]]) -> Tensors:
        formats.check_weights(w for w, _ in weighted)
        names = matching("weighted_sum", *(t for _, t in weighted))
        out = {}
        for name in names:
            # One rounding a product and one a sum, in order: the same F32 results everywhere.
            terms = (self._f32(t[name]) * w for w, t in weighted)
            total = next(terms)
            for term in terms:
                total = total + term
            out[name] = total
        return self._evaluated(out)

    def norm(self, tensors: Tensors) -> float:
        total = 0.0
        for t in tensors.values():
            a = self._f32(t)
            if numel(a) == 0:
                continue
            peak = float(self._amax(a))
            if not math.isfinite(peak):
                return math.inf if peak == math.inf else math.nan
            if peak > 0.0:
                # Scaled by the peak: squares of F32 values above 1.8e19 would overflow.
                total += (peak * self._l2(a / peak)) ** 2
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
        reuse: bool = False,
    ) -> tuple[Tensors, Tensors]:
        formats.check_outer(lr, beta)
        names = matching("outer_step", master, gradient, momentum)
        new_master, new_momentum = {}, {}
        for name in names:
            # torch.optim.SGD's steps in its order (_single_tensor_sgd).
            g = self._f32(gradient[name])
            if momentum is None:
                m = self._copy(g)
            elif reuse:
                m = self._times_plus_into(self._f32(momentum[name]), beta, g)
            else:
                m = self._times_plus(self._f32(momentum[name]), beta, g)
            if not nesterov:
                update = m
            elif reuse:
                update = self._plus_times_into(g, m, beta)
            else:
                update = self._plus_times(g, m, beta)
            if reuse and update is not m:
                # The update is the gradient's buffer, spent once the master has it.
                new_master[name] = self._plus_times_over(self._f32(master[name]), update, -lr)
            elif reuse and m is not g:
                # Without Nesterov the update is the momentum; the spent gradient takes the
                # new master.
                new_master[name] = self._plus_times_to(self._f32(master[name]), m, -lr, g)
            else:
                new_master[name] = self._plus_times(self._f32(master[name]), update, -lr)
            new_momentum[name] = m
        return self._evaluated(new_master), self._evaluated(new_momentum)

    def cast(self, tensors: Tensors, schema: Schema) -> Tensors:
        check_shapes("cast", schema, tensors)
        return self._evaluated({n: self._cast(t, schema[n].dtype) for n, t in tensors.items()})

    def merge(
        self,
        adapter: Adapter,
        commit: Tensors,
        *,
        since: Tensors | None,
        alpha: float | None,
    ) -> None:
        formats.check_alpha(alpha)
        names = matching("merge", commit, since if alpha is None else None)
        schema = served(adapter.schema, names)
        check_shapes("merge", schema, commit)
        if isinstance(adapter, self._adapter_type):
            self._merge_live(adapter, names, commit, since, alpha)
            return
        live = self.load(adapter.read(names))
        merged = {n: self._merged(live[n], commit[n], since, alpha, n) for n in names}
        adapter.write(self.dump(self.cast(merged, schema)))

    def difference(self, commit: Tensors, since: Tensors, *, owned: bool = False) -> Tensors:
        names = matching("difference", commit, since)
        return self._evaluated(
            {n: self._difference(commit[n], since[n], owned=owned) for n in names}
        )

    def shift(self, adapter: Adapter, difference: Tensors) -> None:
        names = matching("shift", difference)
        schema = served(adapter.schema, names)
        check_shapes("shift", schema, difference)
        if isinstance(adapter, self._adapter_type):
            self._shift_live(adapter, names, difference)
            return
        live = self.load(adapter.read(names))
        shifted = {n: self._f32(live[n]) + self._f32(difference[n]) for n in names}
        adapter.write(self.dump(self.cast(shifted, schema)))

    def _difference(self, commit: Array, since: Array, *, owned: bool) -> Array:
        """``commit - since`` in F32 (``difference``); a framework whose arrays can be written
        may put it in an owned F32 ``since``."""
        return self._f32(commit) - self._f32(since)

    @abstractmethod
    def _shift_live(self, adapter: Any, names: Sequence[str], difference: Tensors) -> None:
        """``shift`` into an adapter of ``_adapter_type``."""

    def _merged(
        self, live: Array, commit: Array, since: Tensors | None, alpha: float | None, name: str
    ) -> Array:
        """A parameter after ``merge``, in F32 on the device of ``live``."""
        c = self._f32_at(commit, live)
        if alpha is not None:
            return self._f32_at(live, live) * alpha + c * (1.0 - alpha)
        if since is not None:
            return c + (self._f32_at(live, live) - self._f32_at(since[name], live))
        return c

    def _refuse_nonfinite(self, tensors: Tensors) -> None:
        """Raise ``NonFinite`` naming the tensors that hold NaN or Inf."""
        named = [(name, t) for name, t in tensors.items() if numel(t)]
        if not named:
            return
        flags = self._finite([t for _, t in named])
        bad = sorted(name for (name, _), ok in zip(named, flags, strict=True) if not ok)
        if bad:
            raise NonFinite(bad)

    # The primitives. Arrays handed in may be any of the backend's own; those returned are on
    # its device unless said otherwise.

    def _evaluated(self, tensors: Tensors) -> Tensors:
        """``tensors``, computed, for a framework that computes lazily; eager ones keep this."""
        return tensors

    @abstractmethod
    def _capture(self, adapter: Any, names: Sequence[str], into: Tensors) -> Tensors:
        """``capture`` from an adapter of ``_adapter_type``."""

    def _reserve(self, adapter: Any, names: Sequence[str]) -> Tensors:
        """``reserve`` for an adapter of ``_adapter_type``: nothing, unless a framework's
        capture pays for fresh memory."""
        return {}

    @abstractmethod
    def _merge_live(
        self,
        adapter: Any,
        names: Sequence[str],
        commit: Tensors,
        since: Tensors | None,
        alpha: float | None,
    ) -> None:
        """``merge`` into an adapter of ``_adapter_type``: each parameter becomes ``_merged``
        of it, rounded to its dtype."""

    @abstractmethod
    def _array(self, value: TensorBytes) -> Array:
        """An array of ``value``: its dtype for F32/F16/BF16, else its raw bytes (uint8)."""

    @abstractmethod
    def _plain_bytes(self, a: Array) -> TensorBytes:
        """Bytes of the F32, F16 or BF16 ``a``, keeping its dtype (``plain_bytes``)."""

    @abstractmethod
    def _host(self, a: Array) -> bytes:
        """The raw bytes of ``a``, C-contiguous."""

    @abstractmethod
    def _lent(self, a: Array) -> memoryview:
        """The raw bytes of ``a``, C-contiguous, as a flat byte view of its own memory where
        it is host memory and contiguous, else of a host copy."""

    @abstractmethod
    def _dtype_code(self, a: Array) -> DType:
        """The F32, F16 or BF16 code of ``a``'s dtype (``TypeError`` for any other)."""

    @abstractmethod
    def _f32(self, a: Array) -> Array:
        """``a`` in F32: ``a`` itself when it already is."""

    @abstractmethod
    def _f32_at(self, a: Array, live: Array) -> Array:
        """``a`` in F32 on the device of the live parameter ``live``."""

    @abstractmethod
    def _cast(self, a: Array, dtype: PayloadDType) -> Array:
        """``a`` rounded to nearest even to ``dtype``."""

    @abstractmethod
    def _zeros(self, a: Array) -> Array:
        """F32 zeros of ``a``'s shape, to add or read but not to write into: a broadcast
        zero where the framework has one, which takes no memory."""

    def _workspace(self) -> AbstractContextManager[None]:
        """Scope of one ``encode`` or ``decode``, for a backend that reuses scratch buffers
        across its tensors; none by default."""
        return nullcontext()

    @abstractmethod
    def _copy(self, a: Array) -> Array:
        """An array of ``a``'s values that no caller holds."""

    @abstractmethod
    def _times_plus(self, a: Array, s: float, b: Array) -> Array:
        """F32 ``a * s + b``, rounded after each op."""

    @abstractmethod
    def _plus_times(self, a: Array, b: Array, s: float) -> Array:
        """``a + b * s``, as the framework's own SGD computes it."""

    def _times_plus_into(self, a: Array, s: float, b: Array) -> Array:
        """``_times_plus``, computed into ``a`` where the framework can (``a`` is spent)."""
        return self._times_plus(a, s, b)

    def _plus_times_into(self, a: Array, b: Array, s: float) -> Array:
        """``_plus_times``, computed into ``a`` where the framework can (``a`` is spent)."""
        return self._plus_times(a, b, s)

    def _plus_times_to(self, a: Array, b: Array, s: float, out: Array) -> Array:
        """``_plus_times``, computed into ``out`` where the framework can (``out`` is spent
        and is neither ``a`` nor ``b``)."""
        return self._plus_times(a, b, s)

    def _plus_times_over(self, a: Array, b: Array, s: float) -> Array:
        """``_plus_times``, computed into ``b`` where the framework can (``b`` is spent)."""
        return self._plus_times(a, b, s)

    @abstractmethod
    def _l2(self, a: Array) -> float:
        """The L2 norm of ``a``."""

    @abstractmethod
    def _finite(self, arrays: list[Array]) -> list[bool]:
        """Whether each of the non-empty ``arrays`` holds neither NaN nor Inf."""


def plain_bytes(
    a: Array, dtypes: Mapping[Any, DType], host: Callable[[Array], bytes]
) -> TensorBytes:
    """Bytes of ``a``, keeping its dtype, looked up in ``dtypes`` (a framework's dtypes by their
    codes); ``host`` gives an array's raw bytes."""
    dtype = dtypes.get(a.dtype)
    if dtype is None:
        raise TypeError(f"a tensor of {a.dtype} has no F32/F16/BF16 bytes")
    return TensorBytes(dtype=dtype, shape=tuple(a.shape), data=host(a))


def matching(what: str, *groups: Tensors | None) -> list[str]:
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


def served(schema: Schema, names: Iterable[str]) -> Schema:
    """The specs of ``names``: parameters of ``schema`` and row blocks of them
    (``fragments.block``). ``SchemaMismatch`` names those that are neither, or blocks outside
    their parameter's rows."""
    names = list(names)
    bad = []
    for name in names:
        found = fragments.block(name, schema)
        if found is None:
            if name not in schema:
                bad.append(name)
        elif not (schema[found[0]].shape and found[2] <= schema[found[0]].shape[0]):
            bad.append(name)
    if bad:
        raise SchemaMismatch(sorted(bad), "not trainable parameters of the model, nor row blocks")
    return fragments.fragment_schema(schema, names)


def check_shapes(what: str, schema: Schema, tensors: Tensors) -> None:
    """Raise ``SchemaMismatch`` naming the tensors that are not ``schema``'s, shapes included."""
    bad = [n for n, t in tensors.items() if n not in schema or tuple(t.shape) != schema[n].shape]
    if bad:
        raise SchemaMismatch(sorted(bad), f"{what}: not parameters of the schema, or other shapes")
