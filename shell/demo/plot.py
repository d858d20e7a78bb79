"""PNG plots of the demo and the benchmark (matplotlib with the Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_curves", "plot_nodes"]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_nodes(
    progress: Mapping[str, Sequence[Mapping[str, Any]]],
    path: Path,
    *,
    title: str,
    aligned: float | None = None,
) -> Path:
    """Training loss against tokens for every node, with held-out losses as markers and the
    aligned final model's held-out loss as a horizontal line; returns ``path``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, records in sorted(progress.items()):
        steps = [r for r in records if "loss" in r and not r.get("final")]
        (line,) = ax.plot([r["tokens"] for r in steps], [r["loss"] for r in steps], label=name)
        held = [r for r in records if "heldout" in r]
        if held:
            ax.plot(
                [r["tokens"] for r in held],
                [r["heldout"] for r in held],
                "o",
                color=line.get_color(),
                markersize=4,
            )
    if aligned is not None:
        ax.axhline(
            aligned,
            color="black",
            linestyle="--",
            linewidth=1,
            label=f"aligned model, held-out {aligned:.3f}",
        )
    ax.set_xlabel("tokens trained by the node")
    ax.set_ylabel("loss (nats per byte); dots: held-out")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_curves(
    curves: Mapping[str, Sequence[tuple[float, float]]],
    path: Path,
    *,
    title: str,
    xlabel: str = "tokens trained, all workers together",
    log_x: bool = False,
) -> Path:
    """Held-out loss against ``xlabel`` (x, y pairs) for each labelled variant; returns
    ``path``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, points in curves.items():
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", markersize=3, label=label)
    ax.set_xlabel(xlabel)
    if log_x:
        ax.set_xscale("log")
    ax.set_ylabel("held-out loss (nats per byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
