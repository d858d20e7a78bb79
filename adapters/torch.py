"""torch: the adapter of a ``torch.nn.Module`` and the backend doing a node's tensor work.

The backend's tensors live on its ``device``. What the protocol computes, and in which order, is
``arrays.ArrayBackend``'s, shared with MLX so that a payload is the same bytes whichever
framework wrote it; this module supplies torch's primitives, the captures its CUDA streams need
and the in-place merge that keeps the tensors optimizers hold.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from gradientmail.adapters.arrays import ArrayBackend, plain_bytes
from gradientmail.adapters.base import Tensors
from gradientmail.core.tensors import (
    DType,
    ParameterSpec,
    PayloadDType,
    Schema,
    SchemaMismatch,
    TensorBytes,
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


class TorchBackend(ArrayBackend):
    """The tensor work of a node in torch, on ``device``.

    ``device`` defaults to the current CUDA device when there is one, else the CPU; tensors
    handed in from another device are moved to it.
    """

    name = "torch"
    _adapter_type = TorchAdapter
    _module_type = torch.nn.Module
    _takes = "the torch backend takes a torch.nn.Module"

    def __init__(self, device: torch.device | str | None = None) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)

    def __repr__(self) -> str:
        return f"TorchBackend(device={str(self.device)!r})"

    def ready(self, tensors: Tensors) -> None:
        event = getattr(tensors, "event", None)
        if event is None:
            return
        event.synchronize()
        for t in tensors.values():
            # The copies were allocated on the training stream; tell the caching allocator
            # they are used on this thread's stream too, so it does not reuse them early.
            t.record_stream(torch.cuda.current_stream(t.device))

    def _capture(self, adapter: TorchAdapter, names: Sequence[str]) -> Tensors:
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

    def _merge_live(
        self,
        adapter: TorchAdapter,
        names: Sequence[str],
        commit: Tensors,
        since: Tensors | None,
        alpha: float | None,
    ) -> None:
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

    def _array(self, value: TensorBytes) -> torch.Tensor:
        return _from_bytes(value).to(self.device)

    def _plain_bytes(self, t: torch.Tensor) -> TensorBytes:
        return _to_bytes(t)

    def _host(self, t: torch.Tensor) -> bytes:
        return _host_bytes(t)

    def _f32(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, torch.float32)

    def _f32_at(self, t: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        return t.to(live.device, torch.float32)

    def _cast(self, t: torch.Tensor, dtype: PayloadDType) -> torch.Tensor:
        return t.to(_TORCH[dtype])

    def _int32(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.int32)

    def _uint8(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.uint8)

    def _bits(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.int32)

    def _from_bits(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.float32)

    def _zeros_like(self, t: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(t)

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    def _times_plus(self, a: torch.Tensor, s: float, b: torch.Tensor) -> torch.Tensor:
        return a.mul(s).add_(b)

    def _plus_times(self, a: torch.Tensor, b: torch.Tensor, s: float) -> torch.Tensor:
        return a.add(b, alpha=s)

    def _times_plus_into(self, a: torch.Tensor, s: float, b: torch.Tensor) -> torch.Tensor:
        return a.mul_(s).add_(b)

    def _plus_times_into(self, a: torch.Tensor, b: torch.Tensor, s: float) -> torch.Tensor:
        return a.add_(b, alpha=s)

    def _at_least(self, t: torch.Tensor, low: int) -> torch.Tensor:
        return t.clamp(min=low)

    def _clip(self, t: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        return torch.minimum(torch.maximum(t, low), high)

    def _where(self, condition: torch.Tensor, yes: float, no: float) -> torch.Tensor:
        return torch.where(condition, yes, no)

    def _amax(self, t: torch.Tensor) -> torch.Tensor:
        return t.abs().amax() if t.numel() else t.new_zeros(())

    def _amax_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.abs().amax(dim=1)

    def _l2(self, t: torch.Tensor) -> float:
        return float(torch.linalg.vector_norm(t))

    def _finite(self, tensors: list[torch.Tensor]) -> list[bool]:
        # min and max propagate NaN and hold any infinity: one pass and no boolean tensor, and
        # one host transfer for all the tensors.
        extremes = torch.stack([torch.stack(torch.aminmax(t)).to("cpu") for t in tensors])
        flags: list[bool] = torch.isfinite(extremes).all(dim=1).tolist()
        return flags

    def _to_e4m3(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float8_e4m3fn).view(torch.uint8)

    def _from_e4m3(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.view(torch.float8_e4m3fn).to(torch.float32)

    def _padded(self, flat: torch.Tensor, count: int) -> torch.Tensor:
        return torch.nn.functional.pad(flat, (0, count)) if count else flat

    def _lookup(self, table: tuple[float, ...], indices: torch.Tensor) -> torch.Tensor:
        values = torch.tensor(table, dtype=torch.float32, device=indices.device)
        return torch.take(values, indices.long())

    def _interleave(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.stack((a, b), dim=1).view(-1)


def _same_f32(*tensors: torch.Tensor) -> bool:
    """Whether ``tensors`` are all F32 on one device (merge arithmetic needs no conversion)."""
    first = tensors[0]
    return all(t.dtype == torch.float32 and t.device == first.device for t in tensors)


def _to_bytes(t: torch.Tensor) -> TensorBytes:
    return plain_bytes(t, _DTYPE, _host_bytes)


def _host_bytes(t: torch.Tensor) -> bytes:
    if t.numel() == 0:
        return b""
    return t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().tobytes()


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
