"""torch: the adapter of a ``torch.nn.Module`` and the backend doing a node's tensor work.

The backend's tensors live on its ``device``; the quantized formats are those of the
``formats`` module, computed with torch ops so a payload is the same bytes whichever framework
wrote it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch

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

__all__ = ["TorchAdapter", "TorchBackend"]

_DTYPE: dict[torch.dtype, DType] = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
}
_TORCH: dict[PayloadDType, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.uint8,
    "F8_E8M0": torch.uint8,
    "F4": torch.uint8,
}


class TorchAdapter:
    """The trainable parameters of a ``torch.nn.Module`` (those with ``requires_grad``), named as
    ``named_parameters`` names them: tied weights appear once, buffers and frozen parameters not
    at all. The set is fixed when the adapter is made.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"TorchAdapter takes a torch.nn.Module, not {type(module).__name__}")
        self.module = module
        self._live: dict[str, torch.nn.Parameter] = {}
        specs = []
        for name, parameter in module.named_parameters():
            if not parameter.requires_grad:
                continue
            dtype = _DTYPE.get(parameter.dtype)
            if dtype is None:
                raise TypeError(
                    f"parameter {name!r} is {parameter.dtype}; gradientmail exchanges float32, "
                    "float16 and bfloat16 parameters (convert it, or freeze it)"
                )
            self._live[name] = parameter
            specs.append(ParameterSpec(name=name, dtype=dtype, shape=tuple(parameter.shape)))
        self._schema = Schema.of(specs)

    @property
    def schema(self) -> Schema:
        return self._schema

    def tensors(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The live parameters themselves (not copies), by name."""
        names = list(names)
        unknown = [name for name in names if name not in self._live]
        if unknown:
            raise SchemaMismatch(unknown, "not trainable parameters of the model")
        return {name: self._live[name] for name in names}

    def read(self, names: Sequence[str]) -> dict[str, TensorBytes]:
        return {name: _to_bytes(t) for name, t in self.tensors(names).items()}

    def write(self, tensors: Mapping[str, TensorBytes]) -> None:
        validate(self._schema, tensors, tensors)
        with torch.no_grad():
            for name, value in tensors.items():
                self._live[name].copy_(_from_bytes(value))


class _Captured(dict[str, torch.Tensor]):
    """Captured copies, with the CUDA event that marks their completion."""

    event: torch.cuda.Event | None = None


class TorchBackend:
    """The tensor work of a node in torch, on ``device``.

    ``device`` defaults to the current CUDA device when there is one, else the CPU; tensors
    handed in from another device are moved to it.
    """

    name = "torch"

    def __init__(self, device: torch.device | str | None = None) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)

    def __repr__(self) -> str:
        return f"TorchBackend(device={str(self.device)!r})"

    def adapter(self, model: object) -> Adapter:
        if isinstance(model, TorchAdapter):
            return model
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"the torch backend takes a torch.nn.Module, not {type(model).__qualname__}"
            )
        return TorchAdapter(model)

    def capture(self, adapter: Adapter, names: Sequence[str]) -> Tensors:
        if not isinstance(adapter, TorchAdapter):
            return self.load(adapter.read(names))
        captured = _Captured()
        with torch.no_grad():
            for name, live in adapter.tensors(names).items():
                # On CUDA the clone is queued on the training thread's current stream, after
                # the steps that wrote the parameter, and the event marks its end.
                captured[name] = live.detach().clone(memory_format=torch.contiguous_format)
        if any(t.is_cuda for t in captured.values()):
            captured.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            captured.event.record()
        return captured

    def ready(self, tensors: Tensors) -> None:
        event = getattr(tensors, "event", None)
        if event is None:
            return
        event.synchronize()
        for t in tensors.values():
            # The copies were allocated on the training stream; tell the caching allocator
            # they are used on this thread's stream too, so it does not reuse them early.
            t.record_stream(torch.cuda.current_stream(t.device))

    def load(self, tensors: Mapping[str, TensorBytes]) -> Tensors:
        loaded = {}
        for name, value in tensors.items():
            if value.dtype not in ("F32", "F16", "BF16"):
                raise TypeError(f"tensor {name!r}: load takes F32, F16 or BF16, not {value.dtype}")
            loaded[name] = _from_bytes(value).to(self.device)
        return loaded

    def dump(self, tensors: Tensors) -> dict[str, TensorBytes]:
        return {name: _to_bytes(t) for name, t in tensors.items()}

    def delta(self, base: Tensors, local: Tensors, residual: Tensors | None = None) -> Tensors:
        names = _matching("delta", base, local, residual)
        out = {}
        for name in names:
            d = self._f32(base[name]) - self._f32(local[name])
            if residual is not None:
                d += self._f32(residual[name])
            out[name] = d
        return out

    def encode(
        self, delta: Tensors, quantization: Quantized | None
    ) -> tuple[dict[str, TensorBytes], Tensors]:
        delta = {name: self._f32(t) for name, t in delta.items()}
        bad = _nonfinite(delta)
        if bad:
            raise NonFinite(bad)
        payload: dict[str, TensorBytes] = {}
        residual: Tensors = {}
        for name, x in delta.items():
            if quantization is None:
                payload[name] = _to_bytes(x)
                residual[name] = torch.zeros_like(x)
                continue
            encoded, scales, decoded = _QUANTIZE[quantization](x)
            shape = (x.numel() + (-x.numel()) % F4_BLOCK,) if quantization == "F4" else x.shape
            payload[name] = _raw(quantization, tuple(shape), encoded)
            payload[scale_name(name)] = _raw(
                "F32" if quantization == "F8_E4M3" else "F8_E8M0", tuple(scales.shape), scales
            )
            residual[name] = x - decoded
        return payload, residual

    def decode(self, payload: Mapping[str, TensorBytes], schema: Schema) -> Tensors:
        layout = formats.payload_layout(payload, schema)
        out: Tensors = {}
        for spec in schema.parameters:
            entry = payload[spec.name]
            data = _from_bytes(entry).to(self.device)
            if layout[spec.name] == "F8_E4M3":
                scale = _from_bytes(payload[scale_name(spec.name)]).to(self.device)
                out[spec.name] = _dequantize_f8(data, scale).view(spec.shape)
            elif layout[spec.name] == "F4":
                scales = _from_bytes(payload[scale_name(spec.name)]).to(self.device)
                out[spec.name] = _dequantize_f4(data, scales, spec.shape)
            else:
                out[spec.name] = data.to(torch.float32)
        bad = _nonfinite(out)
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
            # One rounding a product and one a sum, in order, as the MLX backend rounds.
            terms = (self._f32(t[name]) * w for w, t in weighted)
            total = next(terms)
            for term in terms:
                total = total + term
            out[name] = total
        return out

    def norm(self, tensors: Tensors) -> float:
        total = 0.0
        for t in tensors.values():
            a = self._f32(t)
            if a.numel() == 0:
                continue
            peak = float(a.abs().max())
            if not math.isfinite(peak):
                return math.inf if peak == math.inf else math.nan
            if peak > 0.0:
                # Scaled by the peak: squares of F32 values above 1.8e19 would overflow.
                total += (peak * float(torch.linalg.vector_norm(a / peak))) ** 2
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
            # The ops and their order are torch.optim.SGD's (_single_tensor_sgd), so the
            # results are bit for bit what it would give.
            g = self._f32(gradient[name])
            m = g.clone() if momentum is None else self._f32(momentum[name]).mul(beta).add_(g)
            update = g.add(m, alpha=beta) if nesterov else m
            new_master[name] = self._f32(master[name]).add(update, alpha=-lr)
            new_momentum[name] = m
        return new_master, new_momentum

    def cast(self, tensors: Tensors, schema: Schema) -> Tensors:
        _check_shapes("cast", schema, tensors)
        return {name: t.to(_TORCH[schema[name].dtype]) for name, t in tensors.items()}

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
        if not isinstance(adapter, TorchAdapter):
            live = self.load(adapter.read(names))
            merged = {n: self._merged(live[n], commit[n], since, alpha, n) for n in names}
            adapter.write(self.dump(self.cast(merged, adapter.schema)))
            return
        with torch.no_grad():
            for name, parameter in adapter.tensors(names).items():
                c = commit[name]
                if alpha is None and since is not None and _same_f32(parameter, c, since[name]):
                    # (live - since) + commit, the same two roundings as ``_merged`` (addition
                    # commutes bit for bit), with no temporaries.
                    parameter.sub_(since[name]).add_(c)
                    continue
                # copy_ rounds to the parameter's dtype in place: optimizers keep their tensor.
                parameter.copy_(self._merged(parameter, c, since, alpha, name))

    def _merged(
        self,
        live: torch.Tensor,
        commit: torch.Tensor,
        since: Tensors | None,
        alpha: float | None,
        name: str,
    ) -> torch.Tensor:
        c = commit.to(live.device, torch.float32)
        if alpha is not None:
            return alpha * live.to(torch.float32) + (1.0 - alpha) * c
        if since is not None:
            start: torch.Tensor = since[name]
            return c + (live.to(torch.float32) - start.to(live.device, torch.float32))
        return c

    def _f32(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, torch.float32)


def _same_f32(*tensors: torch.Tensor) -> bool:
    """Whether ``tensors`` are all F32 on one device (merge arithmetic needs no conversion)."""
    first = tensors[0]
    return all(t.dtype == torch.float32 and t.device == first.device for t in tensors)


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
    bad = [n for n, t in tensors.items() if n not in schema or tuple(t.shape) != schema[n].shape]
    if bad:
        raise SchemaMismatch(sorted(bad), f"{what}: not parameters of the schema, or other shapes")


def _nonfinite(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    named = [(name, t) for name, t in tensors.items() if t.numel()]
    if not named:
        return []
    # min and max propagate NaN and hold any infinity: one pass and no boolean tensor, and
    # one host transfer for all the tensors.
    extremes = torch.stack([torch.stack(torch.aminmax(t)).to("cpu") for _, t in named])
    flags = torch.isfinite(extremes).all(dim=1).tolist()
    return sorted(name for (name, _), ok in zip(named, flags, strict=True) if not ok)


def _to_bytes(t: torch.Tensor) -> TensorBytes:
    dtype = _DTYPE.get(t.dtype)
    if dtype is None:
        raise TypeError(f"a tensor of {t.dtype} has no F32/F16/BF16 bytes")
    return _raw(dtype, tuple(t.shape), t)


def _raw(dtype: PayloadDType, shape: tuple[int, ...], t: torch.Tensor) -> TensorBytes:
    if t.numel() == 0:
        return TensorBytes(dtype=dtype, shape=shape, data=b"")
    host = t.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
    return TensorBytes(dtype=dtype, shape=shape, data=host.numpy().tobytes())


def _from_bytes(value: TensorBytes) -> torch.Tensor:
    """A CPU tensor of ``value``: its dtype for F32/F16/BF16, else its raw bytes (uint8)."""
    dtype = _TORCH[value.dtype]
    shape = value.shape if dtype != torch.uint8 else (len(value.data),)
    if not value.data:
        return torch.empty(shape, dtype=dtype)
    # frombuffer wants a writable buffer; the copy is the one the host tensor needs anyway.
    raw = torch.frombuffer(bytearray(value.data), dtype=torch.uint8)
    tensor: torch.Tensor = raw.view(dtype).reshape(shape)
    return tensor


def _f8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    amax = x.abs().amax() if x.numel() else x.new_zeros(())
    k = _f8_exponent(amax.view(torch.int32))
    scale = ((k + 127) << 23).view(torch.float32)
    inverse = ((127 - k) << 23).view(torch.float32)
    limit = torch.where(k >= formats.E4M3_TOP_EXPONENT, formats.E4M3_TOP_LIMIT, formats.E4M3_MAX)
    codes = torch.minimum(torch.maximum(x * inverse, -limit), limit).to(torch.float8_e4m3fn)
    return codes.view(torch.uint8), scale, codes.to(torch.float32) * scale


def _f8_exponent(bits: torch.Tensor) -> torch.Tensor:
    """``formats.f8_scale_exponent`` from the bits of a non-negative F32: the smallest ``k``
    with ``amax <= 448 * 2**k``, at least -126."""
    above = ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)  # mantissa beyond 1.75 (448 = 1.75*2**8)
    return (((bits >> 23) & 0xFF) - 135 + above).clamp(min=-126)


def _f4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = x.numel()
    flat = x.reshape(-1)
    if n % F4_BLOCK:
        flat = torch.nn.functional.pad(flat, (0, (-n) % F4_BLOCK))
    rows = flat.view(-1, F4_BLOCK)
    biased = (rows.abs().amax(dim=1).view(torch.int32) >> 23) & 0xFF
    exponents = (biased - 2).clamp(min=0)
    inverse = ((254 - exponents) << 23).view(torch.float32)
    scaled = rows * inverse[:, None]
    magnitude = scaled.abs()
    codes = (scaled.view(torch.int32) < 0).to(torch.uint8) << 3
    for threshold, inclusive in formats.E2M1_STEPS:
        codes += (magnitude >= threshold) if inclusive else (magnitude > threshold)
    pairs = codes.view(-1, 2)
    packed = pairs[:, 0] | (pairs[:, 1] << 4)
    exponents = exponents.to(torch.uint8)
    decoded = _dequantize_codes(codes.view(-1), exponents)[:n].view(x.shape)
    return packed, exponents, decoded


def _dequantize_codes(codes: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    values = torch.take(_table(formats.E2M1_VALUES, codes.device), codes.long())
    scales = torch.take(_table(formats.E8M0_VALUES, codes.device), exponents.long())
    values = values.view(-1, F4_BLOCK)
    return (values * scales[:, None]).view(-1)


def _dequantize_f4(
    packed: torch.Tensor, exponents: torch.Tensor, shape: tuple[int, ...]
) -> torch.Tensor:
    codes = torch.stack((packed & 0xF, packed >> 4), dim=1).view(-1)
    return _dequantize_codes(codes, exponents)[: math.prod(shape)].view(shape)


def _dequantize_f8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).to(torch.float32) * scale.view(torch.float32)


def _table(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


_QUANTIZE = {"F8_E4M3": _f8, "F4": _f4}
