"""The quantized formats of ``formats`` as array kernels, written once for every framework.

``ArrayKernels`` encodes and decodes F8_E4M3 and F4 step by step as ``formats`` states them.
An encode takes two passes over a tensor: ``_peaks`` (its largest magnitude, or each block's,
which also tells a NaN or Inf apart, as they propagate) and ``_quantize``, which derives the
scales from the peaks here, once for every framework, and hands the bulk rounding to
``_round_f8`` and ``_round_f4``: the codes and the error-feedback residual ``x - decoded``.

The default steps use directly only what torch tensors and MLX arrays do alike, bit for bit:
Python's arithmetic, comparison and bitwise operators, indexing, ``.shape``, ``.reshape`` and
``.abs()`` (``+=`` only on an array the same function has just made: torch adds in place, MLX
makes a new array under the same name). Every other op is a primitive, an abstract ``_`` method
that a framework's backend supplies. A backend may replace a whole bulk step (``_round_f8``,
``_round_f4``, ``_dequantize_f8``, ``_dequantize_f4``) with a faster one of its own, in place
on buffers it made or by table lookups; the tests hold every step of every backend to the
NumPy reference of ``formats`` bit for bit, so a payload is the same bytes whichever framework
wrote it.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, TypeAlias

from gradientmail.adapters import formats
from gradientmail.core.tensors import F4_BLOCK, Quantized

__all__ = ["Array", "ArrayKernels", "numel"]

Array: TypeAlias = Any
"""A backend's own array: a torch tensor or an MLX array."""


class ArrayKernels(ABC):
    """The F8_E4M3 and F4 kernels over a framework's array primitives."""

    def _peaks(self, quantization: Quantized, x: Array) -> Array:
        """``max|x|`` (F8_E4M3, 0-d) or that of each block of ``F4_BLOCK`` (F4) of the F32
        ``x``: NaN or Inf where ``x`` holds them, which is how ``encode`` refuses them."""
        if quantization == "F8_E4M3":
            return self._amax(x)
        return self._amax_rows(self._blocks(x))

    def _blocks(self, x: Array) -> Array:
        """``x`` flattened and zero-padded to rows of ``F4_BLOCK``."""
        n = numel(x)
        return self._padded(x.reshape(-1), (-n) % F4_BLOCK).reshape(-1, F4_BLOCK)

    def _quantize(
        self, quantization: Quantized, x: Array, peaks: Array, owned: bool = False
    ) -> tuple[Array, Array, Array]:
        """The codes, the scales and the residual ``x - decoded`` of the F32 ``x``, whose
        ``_peaks`` are ``peaks``; ``owned``: the residual may be written into ``x``."""
        if quantization == "F8_E4M3":
            return self._quantize_f8(x, peaks, owned)
        return self._quantize_f4(x, peaks, owned)

    def _quantize_f8(self, x: Array, amax: Array, owned: bool) -> tuple[Array, Array, Array]:
        bits = self._bits(amax)
        # ``formats.f8_scale_exponent`` from the bits of amax: the smallest ``k`` with
        # ``amax <= 448 * 2**k``, at least -126. A mantissa beyond 1.75 (448 = 1.75 * 2**8)
        # needs the next power.
        above = self._int32((bits & 0x7FFFFF) > 0x600000)
        k = self._at_least(((bits >> 23) & 0xFF) - 135 + above, -126)
        scale = self._from_bits((k + 127) << 23)
        inverse = self._from_bits((127 - k) << 23)
        limit = self._where(
            k >= formats.E4M3_TOP_EXPONENT, formats.E4M3_TOP_LIMIT, formats.E4M3_MAX
        )
        codes, residual = self._round_f8(x, inverse, limit, scale, owned)
        return codes, scale, residual

    def _quantize_f4(self, x: Array, amax_rows: Array, owned: bool) -> tuple[Array, Array, Array]:
        biased = (self._bits(amax_rows) >> 23) & 0xFF
        exponents = self._at_least(biased - 2, 0)
        inverse = self._from_bits((254 - exponents) << 23)
        exponents = self._uint8(exponents)
        scales = self._lookup(formats.E8M0_VALUES, exponents)
        packed, residual = self._round_f4(x, inverse, scales, owned)
        return packed, exponents, residual

    def _round_f8(
        self, x: Array, inverse: Array, limit: Array, scale: Array, owned: bool = False
    ) -> tuple[Array, Array]:
        """The F8_E4M3 codes of ``x * inverse`` saturated to ±``limit``, and the residual
        ``x - decoded`` (decoded: a code's value times ``scale``); 0-d F32 ``inverse``,
        ``limit`` and ``scale``. ``owned``: ``x`` is spent, and a backend that writes in place
        may leave the residual in its memory (these default steps make new arrays)."""
        codes = self._to_e4m3(self._clip(x * inverse, -limit, limit))
        return codes, x - self._from_e4m3(codes) * scale

    def _round_f4(
        self, x: Array, inverse: Array, scales: Array, owned: bool = False
    ) -> tuple[Array, Array]:
        """The packed E2M1 codes of ``_blocks(x)`` times ``inverse`` by block, and the
        residual ``x - decoded`` (decoded: a code's value times its block's F32 ``scales``);
        ``owned`` as for ``_round_f8``."""
        n = numel(x)
        scaled = self._blocks(x) * inverse[:, None]
        magnitude = scaled.abs()
        codes = self._uint8(self._bits(scaled) < 0) << 3
        for threshold, inclusive in formats.E2M1_STEPS:
            codes += (magnitude >= threshold) if inclusive else (magnitude > threshold)
        pairs = codes.reshape(-1, 2)
        packed = pairs[:, 0] | (pairs[:, 1] << 4)
        values = self._lookup(formats.E2M1_VALUES, codes.reshape(-1)).reshape(-1, F4_BLOCK)
        decoded = (values * scales[:, None]).reshape(-1)[:n].reshape(x.shape)
        return packed, x - decoded

    def _dequantize_f8(self, codes: Array, scale: Array, shape: tuple[int, ...]) -> Array:
        return (self._from_e4m3(codes) * scale).reshape(shape)

    def _dequantize_f4(self, packed: Array, exponents: Array, shape: tuple[int, ...]) -> Array:
        codes = self._interleave(packed & 0xF, packed >> 4)
        values = self._lookup(formats.E2M1_VALUES, codes).reshape(-1, F4_BLOCK)
        scales = self._lookup(formats.E8M0_VALUES, exponents)
        decoded = (values * scales[:, None]).reshape(-1)
        return decoded[: math.prod(shape)].reshape(shape)

    # The primitives the kernels need; arrays returned are on the device of those handed in.

    @abstractmethod
    def _int32(self, a: Array) -> Array: ...

    @abstractmethod
    def _uint8(self, a: Array) -> Array: ...

    @abstractmethod
    def _bits(self, a: Array) -> Array:
        """The bits of the F32 ``a`` as int32."""

    @abstractmethod
    def _from_bits(self, a: Array) -> Array:
        """The F32 whose bits are the int32 ``a``."""

    @abstractmethod
    def _at_least(self, a: Array, low: int) -> Array:
        """``max(a, low)`` elementwise."""

    @abstractmethod
    def _clip(self, a: Array, low: Array, high: Array) -> Array: ...

    @abstractmethod
    def _where(self, condition: Array, yes: float, no: float) -> Array:
        """F32 ``yes`` where ``condition`` holds, else ``no``."""

    @abstractmethod
    def _amax(self, a: Array) -> Array:
        """``max|a|`` as a 0-d F32 array, NaN or Inf when ``a`` holds them; 0 for an empty
        ``a``."""

    @abstractmethod
    def _amax_rows(self, rows: Array) -> Array:
        """``max|row|`` of each row of the 2-d F32 ``rows``, NaN or Inf as ``_amax``."""

    @abstractmethod
    def _to_e4m3(self, a: Array) -> Array:
        """F8_E4M3 codes (uint8) of the F32 ``a``, rounded to nearest even."""

    @abstractmethod
    def _from_e4m3(self, codes: Array) -> Array:
        """F32 values of the F8_E4M3 ``codes`` (uint8)."""

    @abstractmethod
    def _padded(self, flat: Array, count: int) -> Array:
        """The 1-d ``flat`` followed by ``count`` zeros."""

    @abstractmethod
    def _lookup(self, table: tuple[float, ...], indices: Array) -> Array:
        """F32 ``table[i]`` for each of the integer ``indices``."""

    @abstractmethod
    def _interleave(self, a: Array, b: Array) -> Array:
        """``a[0], b[0], a[1], b[1], ...`` of the 1-d ``a`` and ``b``."""


def numel(a: Array) -> int:
    """The number of elements of ``a``."""
    return math.prod(a.shape)
