"""A tensor-free model and backend for simulation: small F32 vectors as Python ``array('f')``.

``FloatModel`` is an ``Adapter`` and ``FloatBackend`` a ``Backend`` that keep the protocol's
arithmetic honest without a framework: every operation is computed elementwise in double
precision and rounded to F32 when stored, so each result is the correctly rounded F32 value
(double rounding is harmless for + - * since 53 >= 2*24 + 2 bits). Unlike torch on CPU, which
may fuse ``a + alpha*b`` into one FMA, each product and sum here rounds on its own; the audit
recomputes with the same backend, so commits are checked bit for bit.

Only F32 parameters and unquantized payloads are supported: quantization is the torch and MLX
backends' business (the simulator's torch mode covers it).
"""

from __future__ import annotations

import math
import random
from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gradientmail.adapters.base import Adapter, Backend, Tensors
from gradientmail.core.errors import NonFinite
from gradientmail.core.tensors import (
    ParameterSpec,
    Quantized,
    Schema,
    SchemaMismatch,
    TensorBytes,
    TensorView,
)

__all__ = ["FloatBackend", "FloatModel", "Vector", "backend_for", "model_for", "train_step"]


class Vector:
    """An F32 tensor: a shape and its elements, C order, in an ``array('f')``."""

    __slots__ = ("shape", "values")

    def __init__(self, shape: tuple[int, ...], values: array[float]) -> None:
        if len(values) != math.prod(shape):
            raise ValueError(f"shape {shape} needs {math.prod(shape)} elements, got {len(values)}")
        self.shape = shape
        self.values = values

    @classmethod
    def of(cls, shape: tuple[int, ...], values: Iterable[float]) -> Vector:
        return cls(shape, array("f", values))

    def copy(self) -> Vector:
        return Vector(self.shape, array("f", self.values))

    def to_bytes(self) -> TensorBytes:
        return TensorBytes(dtype="F32", shape=self.shape, data=self.values.tobytes())

    @classmethod
    def from_bytes(cls, name: str, value: TensorBytes) -> Vector:
        if value.dtype != "F32":
            raise TypeError(f"tensor {name!r}: the float backend takes F32 only, not {value.dtype}")
        values = array("f")
        values.frombytes(value.data)
        return cls(value.shape, values)


class FloatModel:
    """An ``Adapter`` over named F32 vectors held in this object (the "model").

    ``parameters`` maps each name to its ``Vector``; training code mutates ``values`` in place.
    Names with a numeric segment (``layers.0.w``) partition into fragments by layer.
    """

    def __init__(self, parameters: Mapping[str, Vector]) -> None:
        if not parameters:
            raise ValueError("a FloatModel needs at least one parameter")
        self.parameters = {name: parameters[name].copy() for name in sorted(parameters)}
        self._schema = Schema.of(
            ParameterSpec(name=n, dtype="F32", shape=v.shape) for n, v in self.parameters.items()
        )

    @classmethod
    def layered(cls, layers: int, width: int, *, scale: float = 0.5) -> FloatModel:
        """``layers`` vectors of ``width`` elements, ``layers.<i>.w``, deterministic values."""
        return cls(
            {
                f"layers.{i}.w": Vector.of(
                    (width,), (scale * math.sin(1.0 + i * width + j) for j in range(width))
                )
                for i in range(layers)
            }
        )

    @property
    def schema(self) -> Schema:
        return self._schema

    def read(self, names: Sequence[str]) -> dict[str, TensorBytes]:
        return {name: self._get(name).to_bytes() for name in names}

    def write(self, tensors: Mapping[str, TensorBytes]) -> None:
        for name, value in tensors.items():
            live = self._get(name)
            if value.shape != live.shape or value.dtype != "F32":
                raise SchemaMismatch([name], "write: not the parameter's F32 shape")
            live.values = Vector.from_bytes(name, value).values

    def _get(self, name: str) -> Vector:
        try:
            return self.parameters[name]
        except KeyError:
            raise SchemaMismatch([name], "not a parameter of the model") from None


def _refuse_nonfinite(tensors: Tensors) -> None:
    """Raise ``NonFinite`` naming the tensors that hold NaN or Inf."""
    bad = sorted(n for n, t in tensors.items() if not all(map(math.isfinite, t.values)))
    if bad:
        raise NonFinite(bad)


def _f32(x: float) -> float:
    """``x`` rounded to the nearest F32 (what storing into ``array('f')`` does)."""
    return array("f", (x,))[0]


class FloatBackend:
    """The ``Backend`` protocol over ``Vector`` tensors, in F32 with one rounding per operation.

    Its tensors are ``dict[str, Vector]``; ``adapter`` takes a ``FloatModel``.
    """

    name = "float"

    def adapter(self, model: object) -> Adapter:
        if not isinstance(model, FloatModel):
            raise TypeError(f"the float backend takes a FloatModel, not {type(model).__qualname__}")
        return model

    def capture(
        self, adapter: Adapter, names: Sequence[str], *, into: Tensors | None = None
    ) -> Tensors:
        """Copies; ``into`` is always empty (``reserve``)."""
        if isinstance(adapter, FloatModel):
            return {n: adapter.parameters[n].copy() for n in names}
        return self.load(adapter.read(names))

    def reserve(self, adapter: Adapter, names: Sequence[str]) -> Tensors:
        """Nothing: a copy of a small list needs no memory prepared."""
        return {}

    def ready(self, tensors: Tensors) -> None:
        """Nothing to wait for: captures are synchronous copies."""

    def load(self, tensors: Mapping[str, TensorBytes]) -> Tensors:
        return {name: Vector.from_bytes(name, value) for name, value in tensors.items()}

    def dump(self, tensors: Tensors) -> dict[str, TensorBytes]:
        return {name: _vector(t).to_bytes() for name, t in tensors.items()}

    def lend(self, tensors: Tensors) -> dict[str, TensorView]:
        return {
            name: TensorView(dtype="F32", shape=v.shape, data=memoryview(v.values).cast("B"))
            for name, v in ((n, _vector(t)) for n, t in tensors.items())
        }

    def delta(
        self,
        base: Tensors,
        local: Tensors,
        residual: Tensors | None = None,
        *,
        owned: bool = False,
    ) -> Tensors:
        names = _matching("delta", base, local, residual)
        out: Tensors = {}
        for n in names:
            d = array("f", map(float.__sub__, base[n].values, local[n].values))
            if residual is not None:
                d = array("f", map(float.__add__, d, residual[n].values))
            if owned:  # as torch does: the spent ``local`` holds the delta, so a later read
                local[n].values[:] = d  # of it as parameters shows in the simulation
                out[n] = local[n]
            else:
                out[n] = Vector(base[n].shape, d)
        return out

    def encode(
        self, delta: Tensors, quantization: Quantized | None, *, owned: bool = False
    ) -> tuple[dict[str, TensorBytes], Tensors]:
        if quantization is not None:
            raise ValueError(
                f"the float backend exchanges F32 deltas only, not {quantization}; "
                "simulate quantized runs with the torch backend"
            )
        _refuse_nonfinite(delta)
        payload = {n: _vector(t).to_bytes() for n, t in delta.items()}
        residual = {
            n: Vector(t.shape, array("f", bytes(4 * len(t.values)))) for n, t in delta.items()
        }
        return payload, residual

    def lend_plain(self, delta: Tensors) -> dict[str, TensorView]:
        _refuse_nonfinite(delta)
        return self.lend(delta)

    def decode(self, payload: Mapping[str, TensorBytes], schema: Schema) -> Tensors:
        problems = {
            s.name: "missing, or not an F32 tensor of the parameter's shape"
            for s in schema.parameters
            if (e := payload.get(s.name)) is None or e.dtype != "F32" or e.shape != s.shape
        }
        problems |= {n: "not in the schema" for n in payload if n not in schema}
        if problems:
            raise SchemaMismatch(problems, "float backend: payload does not match the schema")
        out = {s.name: Vector.from_bytes(s.name, payload[s.name]) for s in schema.parameters}
        _refuse_nonfinite(out)
        return out

    def average(self, weighted: Sequence[tuple[float, Tensors]]) -> Tensors:
        weights = [w for w, _ in weighted]
        if not weights or not all(math.isfinite(w) and w > 0 for w in weights):
            raise ValueError(f"average weights must be finite and positive, got {weights}")
        total = math.fsum(weights)
        return self.weighted_sum([(w / total, t) for w, t in weighted])

    def weighted_sum(self, weighted: Sequence[tuple[float, Tensors]]) -> Tensors:
        if not weighted or not all(math.isfinite(w) for w, _ in weighted):
            raise ValueError(f"a weighted sum needs finite weights, got {[w for w, _ in weighted]}")
        names = _matching("weighted_sum", *(t for _, t in weighted))
        out: Tensors = {}
        for n in names:
            total: array[float] | None = None
            for w, t in weighted:
                term = array("f", (x * _f32(w) for x in t[n].values))
                total = term if total is None else array("f", map(float.__add__, total, term))
            assert total is not None
            out[n] = Vector(weighted[0][1][n].shape, total)
        return out

    def norm(self, tensors: Tensors) -> float:
        total = 0.0
        for t in tensors.values():
            values = _vector(t).values
            peak = max(map(abs, values), default=0.0)
            if not math.isfinite(peak):
                return math.inf if peak == math.inf else math.nan
            if peak > 0.0:
                # Scaled by the peak, as the Backend contract asks: no finite delta overflows.
                scaled = _f32(math.sqrt(math.fsum(_f32(x / peak) ** 2 for x in values)))
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
        reuse: bool = False,  # always computes into fresh arrays
    ) -> tuple[Tensors, Tensors]:
        if not (math.isfinite(lr) and lr > 0 and math.isfinite(beta) and 0 <= beta < 1):
            raise ValueError(f"outer step needs lr > 0 and 0 <= beta < 1, got {lr}, {beta}")
        names = _matching("outer_step", master, gradient, momentum)
        lr32, beta32 = _f32(lr), _f32(beta)
        new_master: Tensors = {}
        new_momentum: Tensors = {}
        for n in names:
            g = gradient[n].values
            if momentum is None:
                m = array("f", g)
            else:
                scaled = array("f", (x * beta32 for x in momentum[n].values))
                m = array("f", map(float.__add__, scaled, g))
            if nesterov:
                u = array("f", map(float.__add__, g, array("f", (x * beta32 for x in m))))
            else:
                u = m
            step = array("f", (x * lr32 for x in u))
            shape = master[n].shape
            new_master[n] = Vector(shape, array("f", map(float.__sub__, master[n].values, step)))
            new_momentum[n] = Vector(shape, m)
        return new_master, new_momentum

    def cast(self, tensors: Tensors, schema: Schema) -> Tensors:
        bad = [
            n
            for n, t in tensors.items()
            if n not in schema or schema[n].dtype != "F32" or schema[n].shape != t.shape
        ]
        if bad:
            raise SchemaMismatch(sorted(bad), "cast: the float backend holds F32 parameters only")
        return {n: _vector(t).copy() for n, t in tensors.items()}

    def merge(
        self, adapter: Adapter, commit: Tensors, *, since: Tensors | None, alpha: float | None
    ) -> None:
        if alpha is not None and not 0 <= alpha < 1:
            raise ValueError(f"alpha must be in [0, 1), got {alpha}")
        names = _matching("merge", commit, since if alpha is None else None)
        if not isinstance(adapter, FloatModel):
            raise TypeError("the float backend merges into a FloatModel")
        for n in names:
            live = adapter.parameters[n]
            c = commit[n].values
            if alpha is not None:
                a, b = _f32(alpha), _f32(1.0 - alpha)
                kept = array("f", (x * a for x in live.values))
                mixed = array("f", map(float.__add__, kept, array("f", (x * b for x in c))))
            elif since is not None:
                progress = array("f", map(float.__sub__, live.values, since[n].values))
                mixed = array("f", map(float.__add__, c, progress))
            else:
                mixed = array("f", c)
            live.values = mixed

    def difference(self, commit: Tensors, since: Tensors, *, owned: bool = False) -> Tensors:
        names = _matching("difference", commit, since)
        return {
            n: Vector(
                _vector(commit[n]).shape,
                array("f", map(float.__sub__, commit[n].values, since[n].values)),
            )
            for n in names
        }

    def shift(self, adapter: Adapter, difference: Tensors) -> None:
        names = _matching("shift", difference)
        if not isinstance(adapter, FloatModel):
            raise TypeError("the float backend shifts a FloatModel")
        for n in names:
            live = adapter.parameters[n]
            if live.shape != _vector(difference[n]).shape:
                raise SchemaMismatch([n], "shift: the tensors differ in shape")
            live.values = array("f", map(float.__add__, live.values, difference[n].values))


def _vector(t: object) -> Vector:
    if not isinstance(t, Vector):
        raise TypeError(f"the float backend's tensors are Vectors, not {type(t).__qualname__}")
    return t


def _matching(what: str, *groups: Tensors | None) -> list[str]:
    present = [g for g in groups if g is not None]
    names = set(present[0])
    differing = set().union(*(names ^ set(g) for g in present))
    if differing:
        raise SchemaMismatch(sorted(differing), f"{what}: the tensors name different parameters")
    order = sorted(names)
    shapes = [n for n in order if len({_vector(g[n]).shape for g in present}) > 1]
    if shapes:
        raise SchemaMismatch(shapes, f"{what}: the tensors differ in shape")
    return order


def backend_for(kind: str) -> Backend:
    """The backend of a simulated model kind: ``float`` (this module's) or ``torch``."""
    if kind == "torch":
        from gradientmail.adapters.torch import TorchBackend

        return TorchBackend(device="cpu")
    return FloatBackend()


def model_for(kind: str, fragments: int) -> Any:
    """A fresh model of ``kind`` with enough layers for ``fragments`` (same values each time)."""
    if kind == "torch":
        import torch

        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    return FloatModel.layered(max(3, fragments), 2)


def train_step(model: Any, target: float, rng: random.Random) -> None:
    """One inner step of honest arithmetic: each parameter moves a tenth of the way toward
    ``target``, plus noise drawn from ``rng`` (F32, rounded per element)."""
    if isinstance(model, FloatModel):
        noise = rng.uniform(-0.01, 0.01)
        for vector in model.parameters.values():
            vector.values = array("f", (v + 0.1 * (target - v) + noise for v in vector.values))
        return
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * (target - p) + rng.uniform(-0.01, 0.01))
