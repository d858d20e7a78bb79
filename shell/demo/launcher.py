"""``gradientmail demo``: N worker processes training one model through a mailbox.

Prepares the run's directories, starts ``python -m gradientmail.demo.worker`` once per node,
shows their progress files live, and ends with a summary (held-out loss of every node and of a
fresh model aligned to the run, bytes sent against data parallelism) and a PNG plot.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from gradientmail.demo.config import GPTConfig
from gradientmail.demo.processes import (
    DemoError,
    Job,
    allreduce_bytes,
    local_path,
    prepare_directory,
    run_nodes,
)
from gradientmail.demo.progress import human_bytes
from gradientmail.demo.worker import node_name

__all__ = [
    "add_demo_arguments",
    "aligned_heldout",
    "config_of",
    "frameworks",
    "run_demo",
    "worker_argv",
]


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``gradientmail demo``."""
    p.add_argument("--nodes", type=int, default=4, help="worker processes (default 4)")
    p.add_argument(
        "--mailbox",
        default="file:///tmp/gradientmail-demo",
        help="run URL: file:///dir, a path, or s3://bucket/prefix",
    )
    p.add_argument(
        "--framework",
        choices=("torch", "mlx", "mixed"),
        default="torch",
        help="mixed: odd nodes use MLX",
    )
    p.add_argument("--steps", type=int, default=600, help="inner steps per node (default 600)")
    p.add_argument("--inner-steps", type=int, default=50, help="H, steps per round (default 50)")
    p.add_argument("--fragments", type=int, default=1, help="K > 1: Streaming DiLoCo")
    p.add_argument("--overlap-steps", type=int, default=None, help="tau, steps a sync overlaps")
    p.add_argument(
        "--alpha",
        default=None,
        help="Streaming DiLoCo's merge mix in [0, 1), or 'none' (keep the local progress since "
        "the snapshot); default: the algorithm's",
    )
    p.add_argument(
        "--quantization", choices=("F8_E4M3", "F4"), default=None, help="quantize deltas"
    )
    p.add_argument(
        "--clip", type=float, default=None, help="norm clip, x the round's median (default off)"
    )
    p.add_argument("--outer-lr", type=float, default=0.7, help="outer Nesterov learning rate")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="outer Nesterov momentum")
    p.add_argument(
        "--out",
        default=None,
        help="progress, logs and plot (default: the mailbox directory + '-out')",
    )
    p.add_argument("--batch", type=int, default=8, help="sequences per step and node")
    p.add_argument("--context", type=int, default=128, help="bytes per sequence")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--eval-every", type=int, default=100, help="steps between held-out losses")
    p.add_argument("--eval-windows", type=int, default=64, help="held-out sequences")


def _validate(args: argparse.Namespace) -> None:
    for option in (
        "nodes",
        "steps",
        "inner_steps",
        "fragments",
        "batch",
        "context",
        "layers",
        "dim",
        "heads",
        "eval_windows",
    ):
        if getattr(args, option) < 1:
            raise DemoError(f"--{option.replace('_', '-')} must be at least 1")
    from gradientmail.demo.worker import algorithm_of

    try:
        config_of(args)
        algorithm_of(args)
    except ValueError as exc:
        raise DemoError(str(exc)) from None


def worker_argv(args: argparse.Namespace, *, framework: str) -> list[str]:
    """The worker options of a demo node, but ``--node`` and ``--out``."""
    argv = ["--mailbox", args.mailbox, "--framework", framework]
    for option in (
        "steps",
        "inner_steps",
        "fragments",
        "batch",
        "context",
        "layers",
        "dim",
        "heads",
        "eval_every",
        "eval_windows",
        "overlap_steps",
        "alpha",
        "quantization",
        "clip",
        "outer_lr",
        "outer_momentum",
    ):
        value = getattr(args, option)
        if value is not None:
            argv += [f"--{option.replace('_', '-')}", str(value)]
    return argv


def frameworks(choice: str, nodes: int) -> list[str]:
    """The framework of each node: ``mixed`` alternates torch and MLX."""
    if choice == "mixed":
        return ["mlx" if i % 2 else "torch" for i in range(nodes)]
    return [choice] * nodes


def aligned_heldout(
    url: str, config: GPTConfig, *, framework: str, eval_windows: int
) -> tuple[int, float]:
    """A fresh model aligned to the run's newest commit: that round and its held-out loss."""
    from gradientmail import align, mailbox_from_url
    from gradientmail.demo.corpus import heldout_windows, load_corpus
    from gradientmail.demo.worker import make_trainer

    trainer = make_trainer(framework, config, seed=0, lr=1e-3, warmup=1, total_steps=1)
    round_ = align(trainer.model, mailbox=mailbox_from_url(url))
    windows = heldout_windows(load_corpus().heldout, count=eval_windows, context=config.context)
    return round_, trainer.heldout(windows)


def config_of(args: argparse.Namespace) -> GPTConfig:
    """The model shape the command line asks for."""
    return GPTConfig(context=args.context, layers=args.layers, dim=args.dim, heads=args.heads)


def _audit(url: str) -> str:
    """One line on ``gradientmail.testing._audit`` of the run; ``DemoError`` on a violation."""
    from gradientmail import mailbox_from_url
    from gradientmail._secrets import keyring_from
    from gradientmail.testing import AuditError, audit

    try:
        # The workers take the run secret from the environment, if any; so does the audit.
        report = audit(mailbox_from_url(url), keyring=keyring_from())
    except AuditError as exc:
        first = exc.violations[0] if exc.violations else "?"
        raise DemoError(f"audit found {len(exc.violations)} violations, first: {first}") from None
    return (
        f"audit: every invariant holds ({report.commits} commits, {report.snapshots} snapshots,"
        f" {report.samples:,} samples)"
    )


def _node_table(summaries: Sequence[dict[str, Any]], round_: int, aligned: float) -> str:
    lines = ["node      framework  held-out  round       sent   received   seconds"]
    for s in summaries:
        lines.append(
            f"{s['node']:<9} {s['framework']:<10} {s['heldout']:8.4f}  {s['rounds_seen']:>5} "
            f"{human_bytes(s['bytes_out']):>10} {human_bytes(s['bytes_in']):>10} "
            f"{s['seconds']:9.1f}"
        )
    lines.append(f"aligned   {'':<10} {aligned:8.4f}  {round_:>5}   (a fresh model after align)")
    return "\n".join(lines)


def _traffic(summaries: Sequence[dict[str, Any]], nodes: int, steps: int) -> str:
    params = summaries[0]["parameters"]
    lines = [f"{params:,} parameters, {nodes} nodes, {steps} steps each."]
    if nodes > 1:
        dp = allreduce_bytes(params, nodes, steps)
        sent = sum(s["bytes_out"] for s in summaries) / len(summaries)
        received = sum(s["bytes_in"] for s in summaries) / len(summaries)
        ratio = f"{2 * dp / (sent + received):.0f}x less" if sent + received else "nothing"
        lines += [
            f"Data parallelism (ring all-reduce of F32 gradients every step) would send "
            f"{human_bytes(dp)} per node and receive as much.",
            f"This run sent {human_bytes(sent)} and received {human_bytes(received)} per node "
            f"on average: {ratio}.",
        ]
    return "\n".join(lines)


def _summarize(args: argparse.Namespace, out: Path, names: Sequence[str], stream: TextIO) -> float:
    """Print the run's summary, write it to ``out/summary.json``; returns the aligned loss."""
    summaries = [json.loads((out / f"summary-{name}.json").read_text()) for name in names]
    kinds = frameworks(args.framework, args.nodes)
    round_, aligned = aligned_heldout(
        args.mailbox,
        config_of(args),
        framework="torch" if "torch" in kinds else "mlx",
        eval_windows=args.eval_windows,
    )
    stream.write(f"\n{_node_table(summaries, round_, aligned)}\n\n")
    stream.write(f"{_traffic(summaries, args.nodes, args.steps)}\n{_audit(args.mailbox)}\n")
    record = {
        "mailbox": args.mailbox,
        "round": round_,
        "aligned_heldout": aligned,
        "allreduce_bytes": allreduce_bytes(summaries[0]["parameters"], args.nodes, args.steps),
        "nodes": summaries,
    }
    (out / "summary.json").write_text(json.dumps(record, indent=1) + "\n")
    return aligned


def _output_directory(args: argparse.Namespace, mailbox: Path | None) -> Path:
    if args.out:
        out = Path(args.out).resolve()
    else:
        out = Path(f"{mailbox}-out") if mailbox else Path("gradientmail-demo-out").resolve()
    if mailbox is not None and (out == mailbox or mailbox in out.parents):
        raise DemoError(f"--out {out} must not be inside the mailbox directory {mailbox}")
    return out


def run_demo(args: argparse.Namespace, *, stream: TextIO = sys.stdout) -> int:
    """``gradientmail demo``: returns the exit status; raises ``DemoError`` on failure."""
    _validate(args)
    directory = local_path(args.mailbox)
    out = _output_directory(args, directory)
    if directory is not None:
        args.mailbox = directory.as_uri()
        prepare_directory(directory)
    prepare_directory(out)
    kinds = frameworks(args.framework, args.nodes)
    stream.write(
        f"gradientmail demo: {args.nodes} nodes ({', '.join(sorted(set(kinds)))}), "
        f"mailbox {args.mailbox}, output in {out}\n"
    )
    if "mlx" in kinds and sys.platform == "linux":
        stream.write(
            "note: MLX on Linux computes on its CPU reference BLAS, many times slower than "
            "torch; the torch nodes wait for the MLX ones at every round\n"
        )
    # A start barrier: every node waits for all of them, so every round, the first ones too,
    # averages every node (docs/decisions.md).
    barrier = ("--wait-nodes", str(args.nodes))
    argvs = [(*worker_argv(args, framework=k), *barrier) for k in kinds]
    jobs = [
        Job(label=node_name(i), node=i, argv=argv, out=out, steps=args.steps)
        for i, argv in enumerate(argvs)
    ]
    progress = run_nodes(jobs, stream=stream)
    aligned = _summarize(args, out, list(progress), stream)
    from gradientmail.demo.plot import plot_nodes

    title = f"gradientmail demo: {args.nodes} nodes, H={args.inner_steps}"
    plot = plot_nodes(progress, out / "loss.png", title=title, aligned=aligned)
    stream.write(f"plot: {plot}\n")
    return 0
