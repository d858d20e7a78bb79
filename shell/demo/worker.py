"""One node of the demo: ``python -m gradientmail.demo.worker --node 0 --mailbox URL --out DIR``.

Trains the demo GPT with its own AdamW inner optimizer inside a ``Session`` (or alone, without
any mailbox, when ``--mailbox`` is not given: the benchmark's baselines), and writes what it does
to files the launcher reads, never to its own terminal:

- ``progress-node-<i>.jsonl``: one JSON object every ``--log-every`` steps: ``step``, ``tokens``
  (this node's, so far), ``loss`` (mean training loss since the previous line, nats per byte),
  ``rounds_seen``, ``bytes_out``/``bytes_in`` (the mailbox's counters), ``time`` (seconds since
  the start) and, every ``--eval-every`` steps, ``heldout`` (held-out loss of the local model);
- ``summary-node-<i>.json``: written once the session has closed, with the final held-out loss
  of the model, which then holds the run's final parameters.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from gradientmail.demo.config import GPTConfig
from gradientmail.demo.corpus import batches, heldout_windows, load_corpus

__all__ = ["Trainer", "build_parser", "main", "make_trainer", "node_name", "run"]


class Trainer(Protocol):
    framework: str
    model: Any

    def train_step(self, windows: npt.NDArray[np.uint8]) -> float: ...

    def heldout(self, windows: npt.NDArray[np.uint8]) -> float: ...

    def parameter_count(self) -> int: ...


def node_name(index: int) -> str:
    """The learner id of node ``index``; also names its files."""
    return f"node-{index}"


def make_trainer(
    framework: str, config: GPTConfig, *, seed: int, lr: float, warmup: int, total_steps: int
) -> Trainer:
    """A trainer of the demo GPT in ``framework`` ("torch" or "mlx")."""
    if framework == "torch":
        import torch

        from gradientmail.demo.model import TorchTrainer

        # Several nodes share a few cores; one thread each avoids oversubscription.
        torch.set_num_threads(1)
        return TorchTrainer(config, seed=seed, lr=lr, warmup=warmup, total_steps=total_steps)
    if framework == "mlx":
        from gradientmail.demo.model_mlx import MLXTrainer

        return MLXTrainer(config, seed=seed, lr=lr, warmup=warmup, total_steps=total_steps)
    raise ValueError(f"--framework must be torch or mlx, got {framework!r}")


def algorithm_of(args: argparse.Namespace) -> Any:
    """The run's algorithm: Streaming DiLoCo when ``--fragments`` > 1, DiLoCo otherwise.

    Options left unset keep the algorithm's own defaults (``DiLoCo.streaming``'s alpha and
    overlap, plain DiLoCo's synchronous overlap); ``--quantization`` unset means F32 deltas,
    ``--clip`` unset no norm clip.
    """
    from gradientmail import DiLoCo

    changes: dict[str, Any] = {
        "inner_steps": args.inner_steps,
        "outer_lr": args.outer_lr,
        "outer_momentum": args.outer_momentum,
        "quantization": args.quantization,
        "clip": args.clip,
    }
    if args.overlap_steps is not None:
        changes["overlap_steps"] = args.overlap_steps
    if args.alpha is not None:
        changes["alpha"] = _alpha(args.alpha)
    if args.fragments > 1:
        return DiLoCo.streaming(fragments=args.fragments, **changes)
    return DiLoCo(**changes)


def _alpha(text: str) -> float | None:
    if text == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"--alpha must be a number in [0, 1) or 'none', got {text!r}") from None


class _Alone:
    """What a node without a mailbox reports: no rounds, no bytes."""

    rounds_seen = -1

    def step(self, *, samples: int) -> None:
        del samples


class _Watch:
    """The events the progress lines show: each fragment's newest merged round, and the
    seconds ``step()`` stalled on the overlap bound."""

    def __init__(self) -> None:
        self.merged: dict[int, int] = {}
        self.stalled = 0.0

    def __call__(self, event: Any) -> None:
        from gradientmail import Merged, Stalled

        if isinstance(event, Merged):
            self.merged[event.fragment] = max(event.round, self.merged.get(event.fragment, -1))
        elif isinstance(event, Stalled):
            self.stalled += event.seconds

    def fields(self) -> dict[str, Any]:
        # Every fragment up to the highest merged, -1 for one not merged yet.
        known = range(max(self.merged) + 1) if self.merged else range(0)
        return {
            "fragments": [self.merged.get(k, -1) for k in known],
            "stalled": round(self.stalled, 3),
        }


@contextlib.contextmanager
def _session(args: argparse.Namespace, model: Any, watch: _Watch) -> Iterator[tuple[Any, Any]]:
    if args.mailbox is None:
        yield _Alone(), None
        return
    from gradientmail import Session, log_events, mailbox_from_url

    mailbox = mailbox_from_url(args.mailbox)
    with Session(
        model,
        algorithm=algorithm_of(args),
        mailbox=mailbox,
        learner_id=node_name(args.node),
        poll_interval=args.poll_interval,
        lease_every=args.lease_every,
        lease_timeout=args.lease_timeout,
        callbacks=(log_events, watch),
    ) as session:
        if args.wait_nodes > 1:
            session.wait_for_nodes(args.wait_nodes)
        yield session, mailbox


def _traffic(mailbox: Any) -> dict[str, int]:
    if mailbox is None:
        return {"bytes_out": 0, "bytes_in": 0}
    counters = mailbox.stats.snapshot()
    return {"bytes_out": int(counters["bytes_out"]), "bytes_in": int(counters["bytes_in"])}


class _Progress:
    """Appends the node's JSON lines, flushed one by one so the launcher sees each."""

    def __init__(self, path: Path, *, name: str, tokens_per_step: int) -> None:
        self._file = path.open("w", encoding="utf-8")
        self._name = name
        self._tokens_per_step = tokens_per_step
        self._start = time.monotonic()
        self._losses: list[float] = []
        self.watch: _Watch | None = None

    def seconds(self) -> float:
        return time.monotonic() - self._start

    def loss(self, value: float) -> None:
        self._losses.append(value)

    def write(self, step: int, session: Any, mailbox: Any, **extra: Any) -> None:
        """One line: where the node is, and its mean training loss since the previous line
        (absent when it took no step since)."""
        record = {
            "node": self._name,
            "step": step,
            "tokens": step * self._tokens_per_step,
            **({"loss": float(np.mean(self._losses))} if self._losses else {}),
            "rounds_seen": session.rounds_seen,
            **_traffic(mailbox),
            **(self.watch.fields() if self.watch is not None else {}),
            "time": self.seconds(),
            **extra,
        }
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self._losses.clear()

    def finish(
        self, step: int, session: Any, mailbox: Any, summary: dict[str, Any], path: Path
    ) -> None:
        """The last line (the summary, marked final), then the summary file at ``path``."""
        self.write(step, session, mailbox, **summary, final=True)
        self._file.close()
        path.write_text(json.dumps(summary, indent=1) + "\n")


def _trainer(args: argparse.Namespace, config: GPTConfig) -> Trainer:
    warmup = args.warmup if args.warmup is not None else min(50, max(1, args.steps // 10))
    return make_trainer(
        args.framework, config, seed=args.seed, lr=args.lr, warmup=warmup, total_steps=args.steps
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train one node as ``args`` say; returns (and writes) its summary."""
    name, out = node_name(args.node), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = GPTConfig(context=args.context, layers=args.layers, dim=args.dim, heads=args.heads)
    corpus = load_corpus()
    held = heldout_windows(corpus.heldout, count=args.eval_windows, context=config.context)
    trainer = _trainer(args, config)
    stream = batches(
        corpus.train, batch=args.batch, context=config.context, seed=args.data_seed, node=args.node
    )
    tokens = args.batch * config.context
    progress = _Progress(out / f"progress-{name}.jsonl", name=name, tokens_per_step=tokens)
    watch = _Watch()
    progress.watch = watch
    with _session(args, trainer.model, watch) as (session, mailbox):
        for step in range(1, args.steps + 1):
            progress.loss(trainer.train_step(next(stream)))
            session.step(samples=tokens)
            if args.eval_every > 0 and step % args.eval_every == 0:
                progress.write(step, session, mailbox, heldout=trainer.heldout(held))
            elif step % args.log_every == 0 or step == args.steps:
                progress.write(step, session, mailbox)
    summary = {
        "node": name,
        "framework": trainer.framework,
        "steps": args.steps,
        "tokens": args.steps * tokens,
        "parameters": trainer.parameter_count(),
        "heldout": trainer.heldout(held),
        "rounds_seen": session.rounds_seen,
        **_traffic(mailbox),
        "seconds": progress.seconds(),
    }
    # The last line repeats the summary, measured after the session closed.
    progress.finish(args.steps, session, mailbox, summary, out / f"summary-{name}.json")
    return summary


def add_training_arguments(p: argparse.ArgumentParser) -> None:
    """What the demo worker and the one-process reference share: the model, the data, the
    inner and outer optimizers' settings, and the progress lines."""
    p.add_argument("--steps", type=int, default=600, help="inner steps to train")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (and worker)")
    p.add_argument("--context", type=int, default=128, help="tokens (bytes) per sequence")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3, help="peak inner learning rate")
    p.add_argument(
        "--warmup", type=int, default=None, help="inner warmup steps (default: 50, or steps/10)"
    )
    p.add_argument("--seed", type=int, default=0, help="initial parameters (same on every node)")
    p.add_argument("--data-seed", type=int, default=0, help="batch stream, with the node index")
    p.add_argument("--inner-steps", type=int, default=50, help="H: inner steps per round")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--log-every", type=int, default=10, help="steps between progress lines")
    p.add_argument("--eval-every", type=int, default=0, help="steps between held-out losses")
    p.add_argument("--eval-windows", type=int, default=64, help="held-out sequences")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gradientmail.demo.worker", description="One node of the gradientmail demo."
    )
    p.add_argument("--node", type=int, default=0, help="node index: learner id and data stream")
    p.add_argument("--mailbox", default=None, help="run URL; train alone without one")
    p.add_argument("--out", required=True, help="directory for progress and summary files")
    p.add_argument("--framework", choices=("torch", "mlx"), default="torch")
    add_training_arguments(p)
    p.add_argument("--fragments", type=int, default=1, help="K > 1: Streaming DiLoCo")
    p.add_argument("--overlap-steps", type=int, default=None, help="tau: steps a sync overlaps")
    p.add_argument(
        "--alpha",
        default=None,
        help="Streaming DiLoCo's merge mix (a number in [0, 1), or 'none' to keep the local "
        "progress since the snapshot); unset keeps the algorithm's default",
    )
    p.add_argument("--quantization", choices=("F8_E4M3", "F4"), default=None)
    p.add_argument(
        "--clip", type=float, default=None, help="norm clip, x the round's median (default off)"
    )
    p.add_argument(
        "--wait-nodes",
        type=int,
        default=0,
        help="wait until this many nodes are active before the first step (a start barrier)",
    )
    p.add_argument("--poll-interval", type=float, default=0.2, help="seconds")
    p.add_argument("--lease-every", type=float, default=2.0, help="seconds")
    p.add_argument("--lease-timeout", type=float, default=10.0, help="seconds")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        run(args)
    except Exception as exc:  # the launcher shows the last line of the node's log
        print(f"{node_name(args.node)}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
