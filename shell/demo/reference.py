"""DiLoCo computed in one process, straight from Algorithm 1 of the DiLoCo paper (Douillard et
al., 2023): the reference that runs through a mailbox are checked against.

M workers, each a ``TorchTrainer`` of the demo (its own AdamW state, kept across rounds) fed the
batches the demo worker of the same index draws. Every H inner steps the outer gradient is the
mean over workers of ``global - local``, ``torch.optim.SGD`` (Nesterov momentum) steps the
global parameters with it, and every worker continues from the new global parameters. No
mailbox, no fragments, no overlap, no quantization: nothing of gradientmail's own.

``python -m gradientmail.demo.reference --workers 4 --out DIR ...`` writes a progress file and a
summary in the demo worker's formats (held-out loss is the mean of the workers' models, which
equal the global model right after an outer step), so ``bench/convergence.py`` runs it as one
more job; ``bench/convergence.py --sweep`` runs its outer learning rate and H grid through it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gradientmail.demo.config import GPTConfig
from gradientmail.demo.corpus import batches, heldout_windows, load_corpus
from gradientmail.demo.model import TorchTrainer, build, heldout_loss
from gradientmail.demo.worker import _Progress, add_training_arguments, node_name

__all__ = ["OuterLoop", "main", "run"]


class OuterLoop:
    """The global parameters and their outer optimizer (SGD with Nesterov momentum)."""

    def __init__(self, model: torch.nn.Module, *, lr: float, momentum: float) -> None:
        self.names = [name for name, _ in model.named_parameters()]
        self.params = [p.detach().clone() for p in model.parameters()]
        self.optimizer = torch.optim.SGD(self.params, lr=lr, momentum=momentum, nesterov=True)

    @torch.no_grad()
    def step(self, workers: Sequence[torch.nn.Module], *, scale: float = 1.0) -> None:
        """One outer step on the mean of ``global - local`` over ``workers`` (times ``scale``),
        then every worker holds the new global parameters."""
        locals_ = [list(w.parameters()) for w in workers]
        for i, p in enumerate(self.params):
            p.grad = torch.stack([p - mine[i] for mine in locals_]).mean(dim=0)
            if scale != 1.0:
                p.grad.mul_(scale)
        self.optimizer.step()
        for mine in locals_:
            for p, q in zip(self.params, mine, strict=True):
                q.copy_(p)

    def state(self) -> dict[str, torch.Tensor]:
        """The global parameters by name (views, not copies)."""
        return dict(zip(self.names, self.params, strict=True))


class _Rounds:
    """The progress lines' round counter: outer steps taken, less one (as ``rounds_seen``)."""

    rounds_seen = -1


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train ``args.workers`` workers as Algorithm 1 says; returns (and writes) the summary."""
    name, out = node_name(args.node), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    config = GPTConfig(context=args.context, layers=args.layers, dim=args.dim, heads=args.heads)
    corpus = load_corpus()
    held = heldout_windows(corpus.heldout, count=args.eval_windows, context=config.context)
    warmup = args.warmup if args.warmup is not None else min(50, max(1, args.steps // 10))
    workers = [
        TorchTrainer(config, seed=args.seed, lr=args.lr, warmup=warmup, total_steps=args.steps)
        for _ in range(args.workers)
    ]
    streams = [
        batches(corpus.train, batch=args.batch, context=config.context, seed=args.data_seed, node=i)
        for i in range(args.workers)
    ]
    outer = OuterLoop(workers[0].model, lr=args.outer_lr, momentum=args.outer_momentum)
    tokens = args.batch * config.context
    progress = _Progress(out / f"progress-{name}.jsonl", name=name, tokens_per_step=tokens)
    counter = _Rounds()

    def heldout() -> float:
        return sum(w.heldout(held) for w in workers) / len(workers)

    for step in range(1, args.steps + 1):
        for worker, stream in zip(workers, streams, strict=True):
            progress.loss(worker.train_step(next(stream)))
        if step % args.inner_steps == 0:
            outer.step([w.model for w in workers])
            counter.rounds_seen += 1
        if args.eval_every > 0 and step % args.eval_every == 0:
            progress.write(step, counter, None, heldout=heldout())
        elif step % args.log_every == 0 or step == args.steps:
            progress.write(step, counter, None)
    if args.steps % args.inner_steps:
        # The steps since the last outer step make one more, shorter round, as a node's
        # close() publishes them; its delta counts as H steps' (gradientmail's Decision 5,
        # docs/decisions.md: the paper has no partial rounds).
        partial = args.steps % args.inner_steps
        outer.step([w.model for w in workers], scale=args.inner_steps / partial)
        counter.rounds_seen += 1
    final = build(config, seed=args.seed)
    final.load_state_dict(outer.state(), strict=True)
    if args.final is not None:
        torch.save(outer.state(), args.final)
    summary = {
        "node": name,
        "framework": "torch",
        "workers": args.workers,
        "steps": args.steps,
        "tokens": args.steps * tokens * args.workers,
        "parameters": workers[0].parameter_count(),
        # The global model: the workers' models equal it only right after an outer step.
        "heldout": heldout_loss(final, held),
        "rounds_seen": counter.rounds_seen,
        "bytes_out": 0,
        "bytes_in": 0,
        "seconds": progress.seconds(),
    }
    progress.finish(args.steps, counter, None, summary, out / f"summary-{name}.json")
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gradientmail.demo.reference",
        description="DiLoCo in one process from the paper's Algorithm 1 (the reference).",
    )
    p.add_argument("--workers", type=int, default=4, help="M: workers, each one demo node")
    p.add_argument("--node", type=int, default=0, help="index naming the output files")
    p.add_argument("--out", required=True, help="directory for progress and summary files")
    p.add_argument("--final", default=None, help="save the final global parameters here")
    add_training_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers < 1 or args.inner_steps < 1:
        print("reference: --workers and --inner-steps must be at least 1", file=sys.stderr)
        return 2
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
