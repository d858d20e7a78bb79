"""What a Session costs a training loop: steps/s with and without it, measured side by side.

The same small GPT (the demo's), data and seed train for ``--steps`` steps plainly and inside a
one-node Session (H=50, 4 fragments, directory mailbox), alternating ``--repeats`` times so
machine noise hits both alike. Target (issue 6): the Session costs under 2% of throughput.

The overlap bound is the algorithm's synchronization, not the Session's cost: with
``--overlap 1`` the loop blocks one step after each publish until the round has committed and
its commit has been read (a few polls), which a lone node on 2 cores feels as lost steps. The
default overlap, 10 of the 12 steps a slot has at H=50 and K=4, leaves the commit time to land.

    python bench/overhead.py [--steps 300] [--repeats 3] [--inner-steps 50] [--fragments 4]
                             [--overlap 10] [--poll-interval 0.2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from gradientmail import DiLoCo, Session, mailbox_from_url
from gradientmail.demo.config import GPTConfig
from gradientmail.demo.corpus import batches, load_corpus
from gradientmail.demo.model import TorchTrainer


def measure(
    steps: int, session_of: Callable[[torch.nn.Module], AbstractContextManager[Any]]
) -> float:
    """Steps per second of ``steps`` inner steps (after 10 warm-up steps)."""
    config = GPTConfig()
    trainer = TorchTrainer(config, seed=0, lr=1e-3, warmup=10, total_steps=steps + 10)
    data = batches(load_corpus().train, batch=8, context=config.context, seed=0, node=0)
    for _ in range(10):
        trainer.train_step(next(data))
    with session_of(trainer.model) as session:
        start = time.perf_counter()
        for _ in range(steps):
            windows = next(data)
            trainer.train_step(windows)
            if session is not None:
                session.step(samples=int(windows.size))
        elapsed = time.perf_counter() - start
    return steps / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--overlap", type=int, default=10, help="overlap_steps (tau)")
    parser.add_argument("--poll-interval", type=float, default=0.2, help="seconds")
    args = parser.parse_args()
    torch.manual_seed(0)
    algorithm = DiLoCo(
        inner_steps=args.inner_steps, fragments=args.fragments, overlap_steps=args.overlap
    )

    def with_session(model: torch.nn.Module) -> AbstractContextManager[Any]:
        mailbox = mailbox_from_url(tempfile.mkdtemp(prefix="gm-overhead-"))
        return Session(
            model,
            algorithm=algorithm,
            mailbox=mailbox,
            poll_interval=args.poll_interval,
            lease_every=5.0,
            lease_timeout=15.0,
            callbacks=(),
        )

    plain, session = [], []
    for _ in range(args.repeats):
        plain.append(measure(args.steps, lambda model: nullcontext()))
        session.append(measure(args.steps, with_session))
    p, s = statistics.median(plain), statistics.median(session)
    print(f"| loop | steps/s (median of {args.repeats}) | runs |")
    print("|---|---:|---|")
    print(f"| plain | {p:.2f} | {', '.join(f'{v:.2f}' for v in plain)} |")
    print(
        f"| with Session (H={args.inner_steps}, K={args.fragments}, tau={args.overlap}) | "
        f"{s:.2f} | {', '.join(f'{v:.2f}' for v in session)} |"
    )
    print(f"\nSession cost: {100 * (1 - s / p):.2f}% of throughput (target < 2%)")


if __name__ == "__main__":
    main()
