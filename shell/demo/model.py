"""The demo's GPT in torch, and a trainer around it (AdamW inner optimizer, as DiLoCo).

Parameter names and shapes equal ``model_mlx``'s, so torch and MLX nodes share one run.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from torch import nn

from gradientmail.demo.config import GPTConfig, initial_parameters, learning_rate

__all__ = ["GPT", "TorchTrainer", "build", "heldout_loss", "loss_of", "parameters_of"]


class Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.proj = nn.Linear(config.dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(b, t, d))
        return out


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.dim, config.mlp_ratio * config.dim)
        self.proj = nn.Linear(config.mlp_ratio * config.dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(F.gelu(self.fc(x)))
        return out


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.dim)
        self.attn = Attention(config)
        self.ln2 = nn.LayerNorm(config.dim)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    """Pre-LN GPT over bytes; the output layer reuses ``embed.weight`` (tied)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.dim)
        self.pos = nn.Embedding(config.context, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, time, vocab)`` for integer ``tokens`` ``(batch, time)``."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        for layer in self.layers:
            x = layer(x)
        return F.linear(self.norm(x), self.embed.weight)


def build(config: GPTConfig, *, seed: int = 0) -> GPT:
    """A model holding ``initial_parameters(config, seed)``, the same as ``model_mlx.build``'s."""
    model = GPT(config)
    state = {k: torch.from_numpy(v) for k, v in initial_parameters(config, seed).items()}
    model.load_state_dict(state, strict=True)
    return model


def parameters_of(model: GPT) -> dict[str, npt.NDArray[np.float32]]:
    """Host copies of every parameter, by name."""
    return {k: v.detach().cpu().numpy().copy() for k, v in model.named_parameters()}


def loss_of(model: GPT, windows: npt.NDArray[np.uint8]) -> torch.Tensor:
    """Mean next-byte cross entropy (nats) over ``windows`` ``(batch, context + 1)``."""
    tokens = torch.from_numpy(windows.astype(np.int64))
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


@torch.no_grad()
def heldout_loss(model: GPT, windows: npt.NDArray[np.uint8], *, chunk: int = 32) -> float:
    """Mean loss (nats per byte) over ``windows``, evaluated ``chunk`` windows at a time."""
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(0, len(windows), chunk):
        part = windows[i : i + chunk]
        total += float(loss_of(model, part)) * len(part)
    model.train(was_training)
    return total / len(windows)


class TorchTrainer:
    """AdamW inner steps with warmup, cosine decay, weight decay 0.1 and clipping at norm 1."""

    framework = "torch"

    def __init__(
        self, config: GPTConfig, *, seed: int, lr: float, warmup: int, total_steps: int
    ) -> None:
        self.model = build(config, seed=seed)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1
        )
        self._schedule = (lr, warmup, total_steps)
        self._step = 0

    def train_step(self, windows: npt.NDArray[np.uint8]) -> float:
        """One optimizer step on ``windows``; returns its training loss (nats per byte)."""
        peak, warmup, total = self._schedule
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self._step, peak=peak, warmup=warmup, total=total)
        loss = loss_of(self.model, windows)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._step += 1
        value = float(loss.detach())
        if not math.isfinite(value):
            raise FloatingPointError(f"training loss is {value} at step {self._step}")
        return value

    def heldout(self, windows: npt.NDArray[np.uint8]) -> float:
        """Held-out loss of the model as it is now."""
        return heldout_loss(self.model, windows)

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())
