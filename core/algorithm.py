"""The algorithm's configuration: DiLoCo and its streaming, overlapping, quantized variants.

One ``DiLoCo`` value describes a run; its canonical form is stored in the manifest, and a node
whose configuration differs in any field is refused at join (``ConfigMismatch`` names each
field). References: DiLoCo (Douillard et al. 2023, arXiv:2311.08105) and Streaming DiLoCo
(Douillard et al. 2025, arXiv:2501.18512).
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from gradientmail.core.errors import ConfigMismatch, FormatError
from gradientmail.core.tensors import QUANTIZED, Quantized

__all__ = ["DiLoCo"]


def _int_at_least(low: int) -> Any:
    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{attribute.name} must be an integer >= {low}, got {value!r}")

    return check


def _optional(check: Any) -> Any:
    def wrapped(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value is not None:
            check(instance, attribute, value)

    return wrapped


def _real_in(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Any:
    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        ok = (
            isinstance(value, int | float)
            and not isinstance(value, bool)
            and math.isfinite(value)
            and (value > low if low_open else value >= low)
            and (value < high if high_open else value <= high)
        )
        if not ok:
            interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
            raise ValueError(f"{attribute.name} must be a number in {interval}, got {value!r}")

    return check


def _boolean(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{attribute.name} must be True or False, got {value!r}")


def _clip(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    ok = value is None or (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 1.0
    )
    if not ok:
        raise ValueError(
            f"clip must be a number >= 1.0 (a multiple of the round's median delta norm), "
            f"or None: off; got {value!r}"
        )


def _quantization(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and value not in QUANTIZED:
        raise ValueError(f"quantization must be None, 'F8_E4M3' or 'F4', got {value!r}")


@attrs.frozen(kw_only=True)
class DiLoCo:
    """DiLoCo's outer loop, with the streaming, asynchronous and quantized options.

    Attributes
    ----------
    inner_steps
        H: local optimizer steps between two syncs of the same fragment.
    fragments
        K: the parameters are split into K fragments that sync at staggered times, one every
        H/K steps (Streaming DiLoCo). 1 is plain DiLoCo. At most ``inner_steps``.
    outer_lr, outer_momentum, nesterov
        The outer optimizer: SGD with (Nesterov) momentum on the averaged delta, per fragment.
    quorum_size
        Snapshots after which a round may close once ``grace`` seconds have passed; a round also
        closes as soon as every expected node has reported (see docs/protocol.md).
    grace
        Seconds a round with a quorum waits for the nodes still expected before closing.
    overlap_steps
        Inner steps a node may take after publishing before it must have merged the round's
        commit (tau in Streaming DiLoCo); 0 is synchronous DiLoCo; None never blocks and
        defers a fragment's next publish until its previous commit is merged. Below H/K when
        set, so a fragment is merged before its next sync.
    alpha
        Streaming DiLoCo's merge ``theta = alpha * local + (1 - alpha) * global``; None keeps
        the local progress made since the snapshot instead (``global + (local - snapshot)``).
    global_batch
        Tokens (samples) per step over all nodes; each node's ``batch_size`` is its share.
    quantization
        How deltas travel: None (F32), "F8_E4M3" or "F4" (MXFP4), with error feedback.
    clip
        Norm clip (None: off, the default): with at least 3 deltas in a round, a delta whose
        L2 norm, normalized to H steps, exceeds ``clip`` times the round's median is scaled
        down to that norm before the weighted mean (``core.robust.clip_scales``). At least 1.0.
    """

    inner_steps: int = attrs.field(default=500, validator=_int_at_least(1))
    fragments: int = attrs.field(default=1, validator=_int_at_least(1))
    outer_lr: float = attrs.field(default=0.7, validator=_real_in(0, 10, low_open=True))
    outer_momentum: float = attrs.field(default=0.9, validator=_real_in(0, 1, high_open=True))
    nesterov: bool = attrs.field(default=True, validator=_boolean)
    quorum_size: int = attrs.field(default=1, validator=_int_at_least(1))
    grace: float = attrs.field(default=30.0, validator=_real_in(0, 86_400))
    overlap_steps: int | None = attrs.field(default=0, validator=_optional(_int_at_least(0)))
    alpha: float | None = attrs.field(
        default=None, validator=_optional(_real_in(0, 1, high_open=True))
    )
    global_batch: int | None = attrs.field(default=None, validator=_optional(_int_at_least(1)))
    quantization: Quantized | None = attrs.field(default=None, validator=_quantization)
    clip: float | None = attrs.field(default=None, validator=_clip)

    def __attrs_post_init__(self) -> None:
        if self.fragments > self.inner_steps:
            raise ValueError(
                f"fragments ({self.fragments}) must be at most inner_steps ({self.inner_steps}):"
                " each fragment syncs once every inner_steps steps, one every inner_steps/K"
            )
        if self.overlap_steps is not None and self.overlap_steps >= self.slot:
            raise ValueError(
                f"overlap_steps ({self.overlap_steps}) must be below inner_steps/fragments "
                f"({self.slot}), or None"
            )

    @property
    def slot(self) -> int:
        """The fewest steps between two consecutive rounds of one node: floor(H/K)."""
        return self.inner_steps // self.fragments

    @classmethod
    def paper(cls, **changes: Any) -> DiLoCo:
        """DiLoCo as in Douillard et al. 2023: H=500, Nesterov 0.7/0.9, synchronous."""
        return cls(**{"inner_steps": 500, "fragments": 1, "overlap_steps": 0, **changes})

    @classmethod
    def streaming(cls, **changes: Any) -> DiLoCo:
        """Streaming DiLoCo as in Douillard et al. 2025: H=100, fragments synced at staggered
        times, one step of overlap, alpha=0.5 merging, 4-bit deltas."""
        defaults: dict[str, Any] = {
            "inner_steps": 100,
            "fragments": 4,
            "overlap_steps": 1,
            "alpha": 0.5,
            "quantization": "F4",
        }
        return cls(**{**defaults, **changes})

    def to_json(self) -> dict[str, Any]:
        """The canonical form stored in the manifest."""
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, value: object) -> DiLoCo:
        if not isinstance(value, dict):
            raise FormatError("algorithm must be a JSON object")
        known = {a.name for a in attrs.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise FormatError(f"unknown algorithm fields {unknown}")
        try:
            return cls(**value)
        except (TypeError, ValueError) as exc:
            raise FormatError(f"bad algorithm: {exc}") from None

    def require_same(self, run: DiLoCo) -> None:
        """Raise ``ConfigMismatch`` naming every field where this node differs from the run."""
        theirs, ours = run.to_json(), self.to_json()
        differing = [
            (name, theirs[name], ours[name]) for name in ours if theirs[name] != ours[name]
        ]
        if differing:
            raise ConfigMismatch(differing)
