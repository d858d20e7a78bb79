"""The quantized payload formats, framework-free: code tables, scale rules and a NumPy reference.

Both backends implement the same rules with their own ops; this module states them once, gives
the exact tables they share (``E2M1_VALUES``, ``E4M3_VALUES``, ``E8M0_VALUES``) and a slow
reference encoder that picks each code by enumerating every code of the format, which is what
the tests hold the backends to. ``payload_layout`` checks a payload against a schema before a
backend decodes it.

``F8_E4M3``: one F32 scale per tensor, the smallest power of two ``2**k`` (``k >= -126``, so it
is a normal F32) with ``max|x| / 2**k <= 448``; elements ``x / 2**k`` rounded to nearest even and
saturated to ±448, or to ±240 when ``k`` is 120 (``max|x|`` above ``1.75 * 2**127``), so that no
element rounds up to ``256 * 2**120``, which is F32's infinity. The sign bit is kept, as the
casts of torch and MLX keep it: a negative value that rounds to zero is code ``0x80`` (``-0``).

``F4`` (MXFP4, OCP Microscaling Formats v1.0): the tensor flattened, zero-padded to blocks of 32;
per block the E8M0 scale ``2**(floor(log2(amax)) - 2)`` (2 is the largest exponent of E2M1),
stored as the byte ``exponent + 127`` and clamped to the byte 0 (``2**-127``), which is also the
scale of an all-zero block; elements E2M1 rounded to nearest even and saturated to ±6, two a
byte with the first in the low nibble. The sign bit is kept here too: a negative value that
rounds to zero, or ``-0.0``, is code 8 (``-0``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import numpy as np

from gradientmail.core.tensors import (
    DTYPES,
    F4_BLOCK,
    PayloadDType,
    Schema,
    SchemaMismatch,
    TensorBytes,
    quantized_specs,
    scale_name,
)

__all__ = [
    "E2M1_MAX",
    "E2M1_STEPS",
    "E2M1_VALUES",
    "E4M3_MAX",
    "E4M3_VALUES",
    "E8M0_VALUES",
    "check_alpha",
    "check_outer",
    "check_weights",
    "decode_f4",
    "decode_f8",
    "e2m1_code",
    "e4m3_code",
    "encode_f4",
    "encode_f8",
    "f8_limit",
    "f8_scale_exponent",
    "normalized_weights",
    "payload_layout",
]

E4M3_MAX: Final = 448.0
E4M3_TOP_EXPONENT: Final = 120
"""The largest F8_E4M3 scale exponent, that of ``max|x|`` near F32's maximum."""
E4M3_TOP_LIMIT: Final = 240.0
"""The saturation bound under the scale ``2**120``: 256 (the next code) would overflow F32."""
E2M1_MAX: Final = 6.0
E8M0_NAN: Final = 0xFF


def _e4m3(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * math.ldexp(mantissa, -9)
    return sign * math.ldexp(8 + mantissa, exponent - 10)


def _e2m1(code: int) -> float:
    sign = -1.0 if code & 0x8 else 1.0
    exponent, mantissa = (code >> 1) & 0x3, code & 0x1
    if exponent == 0:
        return sign * 0.5 * mantissa
    return sign * math.ldexp(2 + mantissa, exponent - 2)


E4M3_VALUES: Final = tuple(_e4m3(c) for c in range(256))
"""Value of each F8_E4M3 code (``0x7F`` and ``0xFF`` are NaN; there is no infinity)."""

E2M1_VALUES: Final = tuple(_e2m1(c) for c in range(16))
"""Value of each E2M1 code: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (code + 8)."""

E8M0_VALUES: Final = tuple(
    math.nan if b == E8M0_NAN else math.ldexp(1.0, b - 127) for b in range(256)
)
"""Value of each F8_E8M0 scale byte: ``2**(byte - 127)``; ``0xFF`` is NaN."""

E2M1_STEPS: Final = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)
"""The E2M1 magnitude code of ``a >= 0`` is the number of steps ``(t, inclusive)`` it passes
(``a >= t`` when inclusive, else ``a > t``): the midpoints between neighbouring values, each tie
going to the even code, and everything above 5 saturating to 6 (code 7)."""


def f8_scale_exponent(amax: float) -> int:
    """``k`` of the F8_E4M3 scale ``2**k`` for a tensor whose largest magnitude is ``amax``."""
    if amax == 0.0:
        return -126
    mantissa, exponent = math.frexp(amax)
    return max(exponent - 9 if mantissa <= 0.875 else exponent - 8, -126)


def _nearest(
    values: np.ndarray[Any, Any], table: tuple[float, ...], limit: float
) -> np.ndarray[Any, Any]:
    """The code of ``table`` nearest each of ``values`` (|v| <= limit), ties to the even code."""
    codes = np.array([c for c, v in enumerate(table) if v >= 0.0 and not math.isnan(v)])
    levels = np.array([table[c] for c in codes])
    magnitude = np.minimum(np.abs(values.astype(np.float64)), limit)
    distance = np.abs(magnitude[..., None] - levels)
    best = distance.min(axis=-1, keepdims=True)
    # Among the (at most two) nearest codes, an even one wins the tie.
    tied = distance == best
    even = tied & (codes % 2 == 0)
    choice = np.where(even.any(axis=-1), np.argmax(even, axis=-1), np.argmax(tied, axis=-1))
    return np.asarray(codes[choice], dtype=np.int64)


def e4m3_code(values: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """F8_E4M3 codes of finite ``values``, by enumeration of all 256 codes (sign as signbit)."""
    sign = np.signbit(values).astype(np.uint8) << 7
    return np.asarray(_nearest(values, E4M3_VALUES[:0x7F], E4M3_MAX) | sign, dtype=np.uint8)


def e2m1_code(values: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """E2M1 codes of finite ``values``, by enumeration of all 16 codes (sign as signbit)."""
    sign = np.signbit(values).astype(np.uint8) << 3
    return np.asarray(_nearest(values, E2M1_VALUES[:8], E2M1_MAX) | sign, dtype=np.uint8)


def f8_limit(k: int) -> float:
    """The largest magnitude F8_E4M3 elements take under the scale ``2**k``."""
    return E4M3_TOP_LIMIT if k >= E4M3_TOP_EXPONENT else E4M3_MAX


def encode_f8(x: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], float]:
    """Reference F8_E4M3 codes (shape of ``x``) and scale of an F32 array."""
    x = np.asarray(x, dtype=np.float32)
    amax = float(np.abs(x).max()) if x.size else 0.0
    k = f8_scale_exponent(amax)
    limit = f8_limit(k)
    scaled = np.clip(x.astype(np.float64) * math.ldexp(1.0, -k), -limit, limit)
    return e4m3_code(scaled), math.ldexp(1.0, k)


def decode_f8(codes: np.ndarray[Any, Any], scale: float) -> np.ndarray[Any, Any]:
    return np.asarray(np.array(E4M3_VALUES)[codes] * scale, dtype=np.float32)


def encode_f4(x: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Reference MXFP4 of an F32 array: packed bytes and E8M0 scale bytes."""
    flat = np.asarray(x, dtype=np.float32).reshape(-1)
    blocks = -(-flat.size // F4_BLOCK)
    padded = np.zeros(blocks * F4_BLOCK, np.float32)
    padded[: flat.size] = flat
    rows = padded.reshape(blocks, F4_BLOCK)
    scales = np.empty(blocks, np.uint8)
    for i, row in enumerate(rows):
        amax = float(np.abs(row).max())
        scales[i] = 0 if amax == 0.0 else max(math.frexp(amax)[1] - 1 - 2 + 127, 0)
    inverse = np.array([math.ldexp(1.0, 127 - int(b)) for b in scales])
    codes = e2m1_code(rows.astype(np.float64) * inverse[:, None]).reshape(-1)
    return np.asarray(codes[0::2] | (codes[1::2] << 4), dtype=np.uint8), scales


def decode_f4(
    packed: np.ndarray[Any, Any], scales: np.ndarray[Any, Any], numel: int
) -> np.ndarray[Any, Any]:
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(-1, F4_BLOCK)
    values = np.array(E2M1_VALUES, np.float64)[codes] * np.array(E8M0_VALUES)[scales][:, None]
    return np.asarray(values.reshape(-1)[:numel], dtype=np.float32)


def payload_layout(payload: Mapping[str, TensorBytes], schema: Schema) -> dict[str, PayloadDType]:
    """The dtype each parameter of ``schema`` travels as in ``payload``.

    A parameter travels plain (F32, F16 or BF16, its shape), or quantized (``F8_E4M3`` or
    ``F4`` with its scales under ``scale_name``, in the ``quantized_specs`` layout). Raises
    ``SchemaMismatch`` naming every parameter that is missing, of the wrong shape or dtype, or
    has bad scales, and every entry that belongs to no parameter.
    """
    layout: dict[str, PayloadDType] = {}
    problems: dict[str, str] = {}
    expected: set[str] = set()
    for spec in schema.parameters:
        expected.add(spec.name)
        entry = payload.get(spec.name)
        if entry is None:
            problems[spec.name] = "missing"
            continue
        if entry.dtype in DTYPES:
            if entry.shape != spec.shape:
                problems[spec.name] = f"shape {entry.shape}, the schema has {spec.shape}"
            layout[spec.name] = entry.dtype
            continue
        if entry.dtype not in ("F8_E4M3", "F4"):
            problems[spec.name] = f"dtype {entry.dtype} is no parameter layout"
            continue
        data, scales = quantized_specs(spec.name, entry.dtype, spec.shape)
        expected.add(scales.name)
        found = payload.get(scales.name)
        if entry.shape != data.shape:
            problems[spec.name] = f"{entry.dtype} shape {entry.shape}, expected {data.shape}"
        elif found is None or (found.dtype, found.shape) != (scales.dtype, scales.shape):
            got = "none" if found is None else f"{found.dtype} {found.shape}"
            problems[spec.name] = (
                f"scales {scale_name(spec.name)!r}: {got}, expected {scales.dtype} {scales.shape}"
            )
        layout[spec.name] = entry.dtype
    for name in sorted(set(payload) - expected):
        problems[name] = "not in the schema"
    if problems:
        detail = "; ".join(f"{name}: {why}" for name, why in problems.items())
        raise SchemaMismatch(problems, f"payload does not match the schema ({detail})")
    return layout


def normalized_weights(weights: Sequence[float]) -> list[float]:
    """``w_i / sum(w)`` for an average's weights, which must be finite and positive."""
    if not weights:
        raise ValueError("average needs at least one weighted set of tensors")
    bad = [w for w in weights if not (math.isfinite(w) and w > 0)]
    if bad:
        raise ValueError(f"average weights must be finite and positive, got {bad}")
    total = math.fsum(weights)
    return [w / total for w in weights]


def check_weights(weights: Iterable[float]) -> None:
    """Raise ``ValueError`` unless a weighted sum has weights, all of them finite."""
    weights = list(weights)
    if not weights:
        raise ValueError("a weighted sum needs at least one weighted set of tensors")
    bad = [w for w in weights if not math.isfinite(w)]
    if bad:
        raise ValueError(f"weighted sum weights must be finite, got {bad}")


def check_outer(lr: float, beta: float) -> None:
    """Raise ``ValueError`` for an outer learning rate or momentum SGD would not take."""
    if not (math.isfinite(lr) and lr >= 0):
        raise ValueError(f"outer lr must be finite and non-negative, got {lr}")
    if not 0 <= beta < 1:
        raise ValueError(f"outer momentum beta must lie in [0, 1), got {beta}")


def check_alpha(alpha: float | None) -> None:
    """Raise ``ValueError`` for a merge's mixing weight outside [0, 1]."""
    if alpha is not None and not 0 <= alpha <= 1:
        raise ValueError(f"merge alpha must lie in [0, 1], got {alpha}")
