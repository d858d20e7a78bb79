"""The demo model's shape, its framework-neutral initial parameters and the learning-rate schedule.

Both frameworks build their model from ``initial_parameters`` so every node of a run, torch or
MLX, starts from the same weights under the same names; a mixed run depends on that.
"""

from __future__ import annotations

import math

import attrs
import numpy as np
import numpy.typing as npt

__all__ = ["GPTConfig", "initial_parameters", "learning_rate", "parameter_shapes"]

Array = npt.NDArray[np.float32]


def _positive(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value <= 0:
        raise ValueError(f"GPTConfig.{attribute.name} must be positive, got {value}")


@attrs.frozen(kw_only=True)
class GPTConfig:
    """A pre-LN decoder-only transformer over bytes, with tied input and output embeddings.

    ``context`` is the sequence length in tokens (bytes); ``dim`` the model width, split over
    ``heads`` attention heads; the MLP is ``mlp_ratio * dim`` wide.
    """

    vocab: int = attrs.field(default=256, validator=_positive)
    context: int = attrs.field(default=128, validator=_positive)
    layers: int = attrs.field(default=4, validator=_positive)
    dim: int = attrs.field(default=128, validator=_positive)
    heads: int = attrs.field(default=4, validator=_positive)
    mlp_ratio: int = attrs.field(default=4, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.dim % self.heads:
            raise ValueError(
                f"GPTConfig.dim ({self.dim}) must be a multiple of heads ({self.heads})"
            )


def parameter_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every trainable parameter by the name both frameworks give it, with its shape."""
    d, hidden = config.dim, config.mlp_ratio * config.dim
    shapes: dict[str, tuple[int, ...]] = {
        "embed.weight": (config.vocab, d),
        "pos.weight": (config.context, d),
        "norm.weight": (d,),
        "norm.bias": (d,),
    }
    for i in range(config.layers):
        p = f"layers.{i}"
        shapes |= {
            f"{p}.ln1.weight": (d,),
            f"{p}.ln1.bias": (d,),
            f"{p}.attn.qkv.weight": (3 * d, d),
            f"{p}.attn.qkv.bias": (3 * d,),
            f"{p}.attn.proj.weight": (d, d),
            f"{p}.attn.proj.bias": (d,),
            f"{p}.ln2.weight": (d,),
            f"{p}.ln2.bias": (d,),
            f"{p}.mlp.fc.weight": (hidden, d),
            f"{p}.mlp.fc.bias": (hidden,),
            f"{p}.mlp.proj.weight": (d, hidden),
            f"{p}.mlp.proj.bias": (d,),
        }
    return dict(sorted(shapes.items()))


def initial_parameters(config: GPTConfig, seed: int) -> dict[str, Array]:
    """GPT-2 style initial weights, identical for a given ``(config, seed)`` on every machine.

    Weights are normal with std 0.02; the projections back into the residual stream are scaled
    by ``1/sqrt(2 * layers)`` (GPT-2) so the residual's variance does not grow with depth.
    Biases start at zero, layer-norm gains at one.
    """
    rng = np.random.default_rng(seed)
    residual_std = 0.02 / math.sqrt(2 * config.layers)
    params: dict[str, Array] = {}
    for name, shape in parameter_shapes(config).items():
        if name.endswith("bias"):
            params[name] = np.zeros(shape, np.float32)
        elif len(shape) == 1:
            params[name] = np.ones(shape, np.float32)
        else:
            std = residual_std if name.endswith("proj.weight") else 0.02
            params[name] = rng.normal(0.0, std, shape).astype(np.float32)
    return params


def learning_rate(step: int, *, peak: float, warmup: int, total: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to a tenth of ``peak`` at ``total``.

    ``step`` counts from 0; the same schedule drives both frameworks and every variant of the
    benchmark, so none of them is tuned on its own.
    """
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))
