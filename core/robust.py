"""Rules that keep hostile or broken input out of a commit: size bounds known before a download,
outlier deltas, the norm clip, and which reporters count toward a signed round's quorum.

Every rule here is pure: the shell measures (object sizes from a LIST, delta norms from the
backend) and these functions decide, with the reason as a string for the event that reports it.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence

from gradientmail.core.codecs import max_packed_size
from gradientmail.core.envelope import HEADER_BYTES
from gradientmail.core.records import Included
from gradientmail.core.tensors import Schema

__all__ = [
    "DEFAULT_OUTLIER_FACTOR",
    "OUTLIER_MINIMUM",
    "RECORD_BOUND",
    "SNAPSHOT_RECORD_BOUND",
    "clip_scales",
    "members",
    "needs_norms",
    "outliers",
    "oversized",
    "snapshot_bound",
]

RECORD_BOUND = 16 * 1024
"""The largest lease or claim object a node reads, in bytes (a genuine one is under 512)."""

SNAPSHOT_RECORD_BOUND = 16 * 1024
"""Room for a snapshot's record in its envelope, in bytes (a genuine one is under 512)."""

DEFAULT_OUTLIER_FACTOR = 10.0
"""A delta whose H-normalized L2 norm exceeds this many times the round's median is excluded."""

OUTLIER_MINIMUM = 3
"""Deltas a round needs before norms are compared (outliers and the clip): with two, neither is
the odd one out."""


def snapshot_bound(schema: Schema) -> int:
    """The largest snapshot object of a fragment of ``schema`` a closer downloads, in bytes.

    The largest payload layout is a plain F32 delta; a ``"zstd"`` frame of incompressible
    bytes grows by at most 1/256 plus a few bytes a block, and a block ends at every byte plane
    (at most 4 a tensor). Anything larger cannot be a genuine snapshot, whatever its codec."""
    packed = max_packed_size(schema.f32)
    frame = packed + packed // 256 + 64 + 8 * (4 * len(schema.parameters) + 2)
    return HEADER_BYTES + SNAPSHOT_RECORD_BOUND + frame


def oversized(size: int, bound: int) -> str | None:
    """Why an object of ``size`` bytes is skipped before its download, or None when it fits."""
    if size > bound:
        return f"object of {size} bytes exceeds the bound of {bound} bytes; not downloaded"
    return None


def members(reporters: Sequence[str], leased: Collection[str]) -> tuple[str, ...]:
    """The reporters of a signed round that count toward its quorum and closer rotation: those
    with a verified lease. Anyone with write access can create a snapshot key under a made-up
    node name, and the key alone cannot be verified (LIST gives names, not signatures), so a
    name with no lease must not count; genuine nodes write their lease before any snapshot."""
    return tuple(n for n in reporters if n in leased)


def needs_norms(count: int, *, factor: float | None, clip: float | None) -> bool:
    """Whether a closer must compute the norms of a round's ``count`` deltas, all decoded (and so
    finite): the clip weighs every delta by its norm (``clip_scales``), and the outlier test
    compares norms only from ``OUTLIER_MINIMUM`` deltas on. A lone node's rounds need none."""
    return clip is not None or (factor is not None and count >= OUTLIER_MINIMUM)


def outliers(
    included: Sequence[Included],
    norms: Mapping[str, float],
    *,
    inner_steps: int,
    factor: float | None,
) -> list[tuple[str, str]]:
    """The deltas to exclude for their size, as ``(node, reason)``.

    ``norms`` maps each included node to its delta's L2 norm. A norm is first normalized to
    ``inner_steps`` steps (``norm * H / steps``, Decision 5), so a delta that spans more steps
    is not held against its node. With at least ``OUTLIER_MINIMUM`` deltas, one whose
    normalized norm exceeds ``factor`` times the median is excluded; a non-finite norm always
    is. ``factor`` None turns the comparison off (non-finite norms are still excluded).
    """
    if factor is not None and not factor > 1.0:
        raise ValueError(f"outlier factor must be above 1 (or None: off), got {factor!r}")
    scaled = {i.node: norms[i.node] * inner_steps / i.steps for i in included}
    excluded = [(n, f"delta norm is {v}") for n, v in scaled.items() if not math.isfinite(v)]
    finite = sorted(v for v in scaled.values() if math.isfinite(v))
    if factor is None or len(finite) < OUTLIER_MINIMUM:
        return excluded
    median = _median(finite)
    if median <= 0.0:
        return excluded
    for node, value in scaled.items():
        if math.isfinite(value) and value > factor * median:
            excluded.append(
                (
                    node,
                    f"delta norm {value:.6g} (normalized to {inner_steps} steps) exceeds "
                    f"{factor:g} x the round's median {median:.6g}",
                )
            )
    return sorted(excluded)


def clip_scales(
    included: Sequence[Included],
    norms: Mapping[str, float],
    *,
    inner_steps: int,
    clip: float,
) -> dict[str, float]:
    """The factor (at most 1) each included delta is multiplied by before the weighted mean.

    Norms are normalized to ``inner_steps`` steps as in ``outliers``. With at least
    ``OUTLIER_MINIMUM`` deltas and a positive median, a delta whose normalized norm exceeds
    ``clip`` times the median is scaled down to exactly that norm; every other delta keeps
    factor 1.0. The closer excludes non-finite norms first (``outliers``), so one here is a
    ``ValueError``, as is a ``clip`` below 1 (it would clip the median delta itself).
    """
    if not (math.isfinite(clip) and clip >= 1.0):
        raise ValueError(f"clip must be a number >= 1.0, got {clip!r}")
    scaled = {i.node: norms[i.node] * inner_steps / i.steps for i in included}
    bad = sorted(n for n, v in scaled.items() if not math.isfinite(v))
    if bad:
        raise ValueError(f"cannot clip non-finite delta norms of {bad}: exclude them first")
    scales = dict.fromkeys(scaled, 1.0)
    if len(scaled) < OUTLIER_MINIMUM:
        return scales
    bound = clip * _median(sorted(scaled.values()))
    for node, value in scaled.items():
        if bound > 0.0 and value > bound:
            scales[node] = bound / value
    return scales


def _median(values: Sequence[float]) -> float:
    middle = len(values) // 2
    if len(values) % 2:
        return values[middle]
    return (values[middle - 1] + values[middle]) / 2
