"""The demo's GPT in MLX: ``model.GPT``'s architecture, parameter names and shapes.

``tree_flatten(model.trainable_parameters())`` names equal torch's ``named_parameters()``, so a
run may mix torch and MLX nodes; the trainer matches ``TorchTrainer`` (AdamW with bias
correction, as torch computes it).
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn
import mlx.optimizers
import mlx.utils
import numpy as np
import numpy.typing as npt

from gradientmail.demo.config import GPTConfig, initial_parameters, learning_rate

__all__ = ["GPT", "MLXTrainer", "build", "heldout_loss", "loss_of", "parameters_of"]

# mlx.nn, mlx.optimizers and mlx.utils ship without complete annotations (re-exports mypy cannot
# see), so they are used untyped here; mlx.core has stubs and stays typed.
nn: Any = mlx.nn
optim: Any = mlx.optimizers
tree_flatten: Any = mlx.utils.tree_flatten
tree_unflatten: Any = mlx.utils.tree_unflatten


class Attention(nn.Module):  # type: ignore[misc]
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.proj = nn.Linear(config.dim, config.dim)

    def __call__(self, x: mx.array) -> mx.array:
        b, t, d = x.shape
        qkv = self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads).transpose(2, 0, 3, 1, 4)
        scale = 1.0 / math.sqrt(d // self.heads)
        y = mx.fast.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], scale=scale, mask="causal")
        out: mx.array = self.proj(y.transpose(0, 2, 1, 3).reshape(b, t, d))
        return out


class MLP(nn.Module):  # type: ignore[misc]
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.dim, config.mlp_ratio * config.dim)
        self.proj = nn.Linear(config.mlp_ratio * config.dim, config.dim)

    def __call__(self, x: mx.array) -> mx.array:
        # torch's F.gelu default is the exact erf form; nn.gelu is the same.
        out: mx.array = self.proj(nn.gelu(self.fc(x)))
        return out


class Block(nn.Module):  # type: ignore[misc]
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.dim)
        self.attn = Attention(config)
        self.ln2 = nn.LayerNorm(config.dim)
        self.mlp = MLP(config)

    def __call__(self, x: mx.array) -> mx.array:
        x = x + self.attn(self.ln1(x))
        out: mx.array = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):  # type: ignore[misc]
    """Pre-LN GPT over bytes; the output layer reuses ``embed.weight`` (tied)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.dim)
        self.pos = nn.Embedding(config.context, config.dim)
        self.layers = [Block(config) for _ in range(config.layers)]
        self.norm = nn.LayerNorm(config.dim)

    def __call__(self, tokens: mx.array) -> mx.array:
        """Logits ``(batch, time, vocab)`` for integer ``tokens`` ``(batch, time)``."""
        x = self.embed(tokens) + self.pos(mx.arange(tokens.shape[1]))
        for layer in self.layers:
            x = layer(x)
        logits: mx.array = self.embed.as_linear(self.norm(x))
        return logits


def build(config: GPTConfig, *, seed: int = 0) -> GPT:
    """A model holding ``initial_parameters(config, seed)``, the same as ``model.build``'s."""
    model = GPT(config)
    load(model, initial_parameters(config, seed))
    return model


def load(model: GPT, params: dict[str, npt.NDArray[np.float32]]) -> None:
    """Overwrite every parameter from host arrays by name; a missing or extra name raises."""
    have = dict(tree_flatten(model.trainable_parameters()))
    if set(have) != set(params):
        raise KeyError(f"parameter names differ: {sorted(set(have) ^ set(params))}")
    model.update(tree_unflatten([(k, mx.array(v)) for k, v in params.items()]))
    mx.eval(model.parameters())


def parameters_of(model: GPT) -> dict[str, npt.NDArray[np.float32]]:
    """Host copies of every trainable parameter, by name."""
    return {k: np.array(v) for k, v in tree_flatten(model.trainable_parameters())}


def loss_of(model: GPT, windows: mx.array) -> mx.array:
    """Mean next-byte cross entropy (nats) over ``windows`` ``(batch, context + 1)``."""
    logits = model(windows[:, :-1])
    loss: mx.array = nn.losses.cross_entropy(logits, windows[:, 1:], reduction="mean")
    return loss


def heldout_loss(model: GPT, windows: npt.NDArray[np.uint8], *, chunk: int = 32) -> float:
    """Mean loss (nats per byte) over ``windows``, evaluated ``chunk`` windows at a time."""
    total = 0.0
    for i in range(0, len(windows), chunk):
        part = windows[i : i + chunk]
        total += float(loss_of(model, mx.array(part.astype(np.int32)))) * len(part)
    return total / len(windows)


class MLXTrainer:
    """AdamW inner steps with warmup, cosine decay, weight decay 0.1 and clipping at norm 1."""

    framework = "mlx"

    def __init__(
        self, config: GPTConfig, *, seed: int, lr: float, warmup: int, total_steps: int
    ) -> None:
        self.model = build(config, seed=seed)
        self.optimizer = optim.AdamW(
            learning_rate=lr, betas=[0.9, 0.95], weight_decay=0.1, bias_correction=True
        )
        self._schedule = (lr, warmup, total_steps)
        self._step = 0
        self._loss_and_grad: Any = nn.value_and_grad(self.model, loss_of)

    def train_step(self, windows: npt.NDArray[np.uint8]) -> float:
        """One optimizer step on ``windows``; returns its training loss (nats per byte)."""
        peak, warmup, total = self._schedule
        self.optimizer.learning_rate = learning_rate(
            self._step, peak=peak, warmup=warmup, total=total
        )
        loss, grads = self._loss_and_grad(self.model, mx.array(windows.astype(np.int32)))
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        self.optimizer.update(self.model, grads)
        mx.eval(self.model.parameters(), self.optimizer.state, loss)
        self._step += 1
        value = float(loss.item())
        if not math.isfinite(value):
            raise FloatingPointError(f"training loss is {value} at step {self._step}")
        return value

    def heldout(self, windows: npt.NDArray[np.uint8]) -> float:
        """Held-out loss of the model as it is now."""
        return heldout_loss(self.model, windows)

    def parameter_count(self) -> int:
        return sum(int(v.size) for _, v in tree_flatten(self.model.trainable_parameters()))
