"""torch: the adapter of a ``torch.nn.Module`` and the backend doing a node's tensor work.

The backend's tensors live on its ``device``. What the protocol computes, and in which order, is
``arrays.ArrayBackend``'s, shared with MLX so that a payload is the same bytes whichever
framework wrote it; this module supplies torch's primitives, the captures its CUDA streams need
and the in-place merge that keeps the tensors optimizers hold.

The bulk quantization steps are torch's own (``_round_f8``, ``_round_f4`` and the two
dequantizations): a fresh tensor costs its page faults on the CPU, so each step allocates only
what it returns and works in place in it, and it decodes codes by table lookup
(``index_select`` into that tensor) with an int32 index in a scratch buffer that one ``encode``
or ``decode`` reuses across its tensors.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from gradientmail.adapters import formats
from gradientmail.adapters.arrays import ArrayBackend, plain_bytes, served
from gradientmail.adapters.base import Tensors
from gradientmail.core import fragments
from gradientmail.core.tensors import (
    DTYPES,
    F4_BLOCK,
    DType,
    ParameterSpec,
    PayloadDType,
    Schema,
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

_F4_KEY_BITS = 21
"""``_round_f4`` classes a scaled F32 value ``a`` (``|a| < 8``) by a 12-bit key: the floor and
the ceiling of its bits on the grid of its sign, exponent and two leading mantissa bits, added
(twice the floor, plus one if any bit below is set). The E2M1 thresholds all lie on that grid,
so ``a`` passes a threshold exactly when every value of its key does."""


def _f4_key_tables() -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The E2M1 code (sign included) and its F32 value for each of the 4096 keys."""
    keys = np.arange(4096, dtype=np.uint32)
    # A value of each key: the floor itself, or half a step above it when bits below were set.
    bits = (((keys >> 1) & 0x3FF) << _F4_KEY_BITS) | ((keys & 1) << (_F4_KEY_BITS - 1))
    magnitude = bits.view(np.float32)
    magnitude = np.where(np.isfinite(magnitude), np.minimum(magnitude, 8.0), 8.0)
    grid = np.where(keys >> 11 == 1, -magnitude, magnitude).astype(np.float32)
    codes = formats.e2m1_code(grid)
    return codes, np.array(formats.E2M1_VALUES, np.float32)[codes]


_F4_KEY_CODES, _F4_KEY_VALUES = _f4_key_tables()
_F4_PAIRS = np.array(
    [[formats.E2M1_VALUES[b & 0xF], formats.E2M1_VALUES[b >> 4]] for b in range(256)], np.float32
)
"""The two values of each packed F4 byte, the low nibble first."""


class _Scratch(threading.local):
    """A thread's scratch buffers, one a role, kept while an ``encode`` or ``decode`` runs."""

    def __init__(self) -> None:
        self.depth = 0
        self.buffers: dict[str, torch.Tensor] = {}


class TorchAdapter:
    """The trainable parameters of a ``torch.nn.Module`` (those with ``requires_grad``), named as
    ``named_parameters`` names them: tied weights appear once, buffers and frozen parameters not
    at all. The set is fixed when the adapter is made.
    """

    row_blocks = True
    """Serves row blocks of its parameters (``core.fragments``): a run it creates may split a
    large parameter across fragments."""

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
        """The live parameters themselves (not copies), by name; a row block
        (``name[start:stop]``, ``core.fragments``) is a view of its parameter's rows, so
        writing it in place writes the parameter."""
        names = list(names)
        unknown = [name for name in names if name not in self._live]
        if unknown:
            served(self._schema, unknown)  # raises unless every one is a row block
        out: dict[str, torch.Tensor] = {}
        for name in names:
            live = self._live.get(name)
            if live is None:
                found = fragments.block(name, self._schema)
                assert found is not None
                parent, start, stop = found
                out[name] = self._live[parent].detach()[start:stop]
            else:
                out[name] = live
        return out

    def read(self, names: Sequence[str]) -> dict[str, TensorBytes]:
        return {name: _to_bytes(t) for name, t in self.tensors(names).items()}

    def write(self, tensors: Mapping[str, TensorBytes]) -> None:
        validate(served(self._schema, tensors), tensors, tensors)
        with torch.no_grad():
            for name, live in self.tensors(tensors).items():
                live.copy_(_from_bytes(tensors[name]))


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
        self._tables: dict[tuple[str, torch.device], torch.Tensor] = {}
        self._scratch = _Scratch()

    def __repr__(self) -> str:
        return f"TorchBackend(device={str(self.device)!r})"

    @property
    def spills_base(self) -> bool:
        """Whether a node keeps its fragments' base in a file by default: on the CPU, where it
        shares the model's memory (``Session(spill_base=...)``)."""
        return self.device.type == "cpu"

    def ready(self, tensors: Tensors) -> None:
        event = getattr(tensors, "event", None)
        if event is None:
            return
        event.synchronize()
        for t in tensors.values():
            # The copies were allocated on the training stream; tell the caching allocator
            # they are used on this thread's stream too, so it does not reuse them early.
            t.record_stream(torch.cuda.current_stream(t.device))

    def _capture(self, adapter: TorchAdapter, names: Sequence[str], into: Tensors) -> Tensors:
        captured = _Captured()
        with torch.no_grad():
            for name, live in adapter.tensors(names).items():
                # On CUDA the clone is queued on the training thread's current stream, after
                # the steps that wrote the parameter, and the event marks its end.
                kept = into.get(name)
                if kept is not None and _same_layout(kept, live):
                    captured[name] = kept.copy_(live)
                else:
                    captured[name] = live.detach().clone(memory_format=torch.contiguous_format)
        if any(t.is_cuda for t in captured.values()):
            captured.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            captured.event.record()
        return captured

    def _reserve(self, adapter: TorchAdapter, names: Sequence[str]) -> Tensors:
        # Host tensors only: CUDA's caching allocator keeps freed blocks, and a block taken on
        # another thread's stream would need that stream's ordering.
        reserved = {}
        for name, live in adapter.tensors(names).items():
            if live.device.type == "cpu":
                reserved[name] = torch.empty_like(live, memory_format=torch.contiguous_format)
                reserved[name].fill_(0)  # touches every page
        return reserved

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

    def _difference(
        self, commit: torch.Tensor, since: torch.Tensor, *, owned: bool
    ) -> torch.Tensor:
        if owned and since.dtype == torch.float32 and since.device == commit.device:
            # Written over the spent ``since``: F32 ``commit`` values, or exact F32 values of
            # F16/BF16 ones (type promotion), less ``since``: one rounding, as ``_f32(c) - s``.
            return torch.sub(commit, since, out=since)
        difference: torch.Tensor = super()._difference(commit, since, owned=owned)
        return difference

    def _delta(
        self,
        base: torch.Tensor,
        local: torch.Tensor,
        residual: torch.Tensor | None,
        *,
        owned: bool,
    ) -> torch.Tensor:
        if owned and local.dtype == torch.float32 and local.device == base.device:
            # Written over the spent ``local``: ``base`` (exact in F32 if F16/BF16) less
            # ``local``, one rounding, then the residual's, as ``_f32(b) - l + r``.
            d = torch.sub(base, local, out=local)
            if residual is not None:
                d.add_(residual)
            return d
        delta: torch.Tensor = super()._delta(base, local, residual, owned=owned)
        return delta

    def _shift_live(self, adapter: TorchAdapter, names: Sequence[str], difference: Tensors) -> None:
        with torch.no_grad():
            for name, parameter in adapter.tensors(names).items():
                d = difference[name]
                if parameter.dtype == torch.float32 and d.device == parameter.device:
                    parameter.add_(d)
                else:  # copy_ rounds to the parameter's dtype in place
                    parameter.copy_(parameter.float() + d.to(parameter.device))

    def _array(self, value: TensorBytes) -> torch.Tensor:
        return _from_bytes(value).to(self.device)

    def read_tensor(
        self, dtype: PayloadDType, shape: tuple[int, ...], fill: Callable[[memoryview], None]
    ) -> torch.Tensor:
        """A tensor of ``dtype`` (F32, F16 or BF16) and ``shape`` whose bytes ``fill`` writes
        into the writable buffer it is handed: the new host tensor's own memory, so bytes read
        from a file are copied once (``spill.SpilledBase``), never through a ``bytes`` object."""
        if dtype not in DTYPES:
            raise TypeError(f"read_tensor takes F32, F16 or BF16, not {dtype}")
        host = torch.empty(shape, dtype=_TORCH[dtype])
        if host.numel():
            fill(host.reshape(-1).view(torch.uint8).numpy().data.cast("B"))
        return host.to(self.device)

    def _plain_bytes(self, t: torch.Tensor) -> TensorBytes:
        return _to_bytes(t)

    def _host(self, t: torch.Tensor) -> bytes:
        return _host_bytes(t)

    def _lent(self, t: torch.Tensor) -> memoryview:
        flat = t.detach().to("cpu").reshape(-1)
        if not flat.is_contiguous():
            flat = flat.clone(memory_format=torch.contiguous_format)
        if flat.numel() == 0:
            return memoryview(b"")
        return flat.view(torch.uint8).numpy().data.cast("B")

    def _dtype_code(self, t: torch.Tensor) -> DType:
        dtype = _DTYPE.get(t.dtype)
        if dtype is None:
            raise TypeError(f"a tensor of {t.dtype} has no F32/F16/BF16 bytes")
        return dtype

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

    def _zeros(self, t: torch.Tensor) -> torch.Tensor:
        return torch.zeros((), dtype=torch.float32, device=t.device).expand(t.shape)

    @contextmanager
    def _workspace(self) -> Iterator[None]:
        self._scratch.depth += 1
        try:
            yield
        finally:
            self._scratch.depth -= 1
            if not self._scratch.depth:
                self._scratch.buffers.clear()

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

    def _plus_times_over(self, a: torch.Tensor, b: torch.Tensor, s: float) -> torch.Tensor:
        return torch.add(a, b, alpha=s, out=b)

    def _plus_times_to(
        self, a: torch.Tensor, b: torch.Tensor, s: float, out: torch.Tensor
    ) -> torch.Tensor:
        return torch.add(a, b, alpha=s, out=out)

    def _at_least(self, t: torch.Tensor, low: int) -> torch.Tensor:
        return t.clamp(min=low)

    def _clip(self, t: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        return torch.minimum(torch.maximum(t, low), high)

    def _where(self, condition: torch.Tensor, yes: float, no: float) -> torch.Tensor:
        return torch.where(condition, yes, no)

    def _amax(self, t: torch.Tensor) -> torch.Tensor:
        if not t.numel():
            return t.new_zeros(())
        # One pass and no temporary; min and max propagate NaN.
        low, high = torch.aminmax(t)
        return torch.maximum(high, low.neg())

    def _amax_rows(self, rows: torch.Tensor) -> torch.Tensor:
        # Faster than aminmax along a short row, and no temporary of the rows' size.
        return torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg_())

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

    def _round_f8(
        self,
        x: torch.Tensor,
        inverse: torch.Tensor,
        limit: torch.Tensor,
        scale: torch.Tensor,
        owned: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # r is x scaled, then decoded, in place; then x minus that (``_values``).
        r, into = self._values(x, x.numel(), owned)
        r = r.view(x.shape)
        torch.mul(x, inverse, out=r)
        # |x * inverse| <= 448 by the choice of the scale, so only the lower limit of the
        # largest scale needs a pass. On the CPU reading the limit costs nothing; on CUDA it
        # would wait for the device, so the clamp runs there unread.
        if r.is_cuda:
            r.clamp_(-limit, limit)
        elif (high := float(limit)) < formats.E4M3_MAX:
            r.clamp_(-high, high)
        codes = r.to(torch.float8_e4m3fn).view(torch.uint8)
        values = self._table("e4m3", formats.E4M3_VALUES, x.device) * scale
        torch.index_select(values, 0, self._index(codes), out=r.view(-1))
        return codes, torch.sub(x, r, out=x if into else r)

    def _round_f4(
        self, x: torch.Tensor, inverse: torch.Tensor, scales: torch.Tensor, owned: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.numel()
        pad = (-n) % F4_BLOCK
        r, into = self._values(x, n + pad, owned)
        rows = r.view(-1, F4_BLOCK)
        if pad:
            r[:n].copy_(x.reshape(-1))
            r[n:].zero_()
            rows.mul_(inverse[:, None])
        else:
            torch.mul(x.reshape(-1, F4_BLOCK), inverse[:, None], out=rows)
        key, bits = self._scratch_index(n + pad, x.device), r.view(torch.int32)
        torch.bitwise_right_shift(bits, _F4_KEY_BITS, out=key)
        key.add_(bits.add_((1 << _F4_KEY_BITS) - 1).bitwise_right_shift_(_F4_KEY_BITS))
        key.bitwise_and_(0xFFF)
        codes = self._scratch_buffer("codes", n + pad, torch.uint8, x.device)
        torch.index_select(self._table("f4 codes", _F4_KEY_CODES, x.device), 0, key, out=codes)
        torch.index_select(self._table("f4 values", _F4_KEY_VALUES, x.device), 0, key, out=r)
        rows.mul_(scales[:, None])
        flat = x.view(-1) if into else x.reshape(-1)
        residual = torch.sub(flat, r[:n], out=flat if into else r[:n])
        # Two codes a byte, the first low: an int16 of a pair (little-endian) is c0 | c1 << 8.
        pairs = codes.view(torch.int16)
        high = self._scratch_buffer("pairs", pairs.numel(), torch.int16, x.device)
        packed = torch.bitwise_right_shift(pairs, 4, out=high).bitwise_or_(pairs).to(torch.uint8)
        return packed, residual.view(x.shape)

    def _values(self, x: torch.Tensor, n: int, owned: bool) -> tuple[torch.Tensor, bool]:
        """The rounding's ``n`` F32 of work for ``x``, and whether the residual goes into ``x``:
        when ``x`` is spent (``owned``) and contiguous, the work is scratch and ``x`` takes the
        residual; otherwise the work is a fresh tensor that becomes the residual."""
        if owned and x.is_contiguous():
            return self._scratch_buffer("values", n, torch.float32, x.device), True
        return torch.empty(n, dtype=torch.float32, device=x.device), False

    def _dequantize_f8(
        self, codes: torch.Tensor, scale: torch.Tensor, shape: tuple[int, ...]
    ) -> torch.Tensor:
        values = self._table("e4m3", formats.E4M3_VALUES, codes.device) * scale
        out = torch.empty(codes.numel(), dtype=torch.float32, device=codes.device)
        return torch.index_select(values, 0, self._index(codes), out=out).view(shape)

    def _dequantize_f4(
        self, packed: torch.Tensor, exponents: torch.Tensor, shape: tuple[int, ...]
    ) -> torch.Tensor:
        out = torch.empty(2 * packed.numel(), dtype=torch.float32, device=packed.device)
        pairs = self._table("f4 pairs", _F4_PAIRS, packed.device)
        torch.index_select(pairs, 0, self._index(packed), out=out.view(-1, 2))
        scales = self._lookup(formats.E8M0_VALUES, exponents)
        out.view(-1, F4_BLOCK).mul_(scales[:, None])
        return out[: math.prod(shape)].view(shape)

    def _table(self, name: str, values: Any, device: torch.device) -> torch.Tensor:
        """The constant table ``values`` on ``device``, made once."""
        table = self._tables.get((name, device))
        if table is None:
            array = np.asarray(values, dtype=np.uint8 if name == "f4 codes" else np.float32)
            table = self._tables[(name, device)] = torch.from_numpy(array).to(device)
        return table

    def _index(self, small: torch.Tensor) -> torch.Tensor:
        """The unsigned bytes ``small`` as an int32 index (the scratch buffer)."""
        index = self._scratch_index(small.numel(), small.device)
        return index.copy_(small.view(-1))

    def _scratch_index(self, n: int, device: torch.device) -> torch.Tensor:
        """``n`` int32 of the thread's scratch index buffer."""
        return self._scratch_buffer("index", n, torch.int32, device)

    def _scratch_buffer(
        self, role: str, n: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """``n`` elements of ``dtype`` from the thread's scratch buffer for ``role``, kept
        until the workspace ends (the largest asked for); a fresh tensor outside a workspace.
        Its contents are whatever the last use left."""
        size = n * dtype.itemsize
        buffer = self._scratch.buffers.get(role)
        if buffer is None or buffer.numel() < size or buffer.device != device:
            buffer = torch.empty(size, dtype=torch.uint8, device=device)
            if self._scratch.depth:
                self._scratch.buffers[role] = buffer
        return buffer[:size].view(dtype)

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
    flat = t.detach().to("cpu").reshape(-1)
    if flat.stride(0) != 1:  # an expanded tensor (the residual's broadcast zeros)
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8).numpy().tobytes()


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


def _same_layout(kept: torch.Tensor, live: torch.Tensor) -> bool:
    """Whether ``kept`` (``reserve``'s) can hold a contiguous copy of ``live``."""
    return (
        kept.shape == live.shape
        and kept.dtype == live.dtype
        and kept.device == live.device
        and kept.is_contiguous()
    )
