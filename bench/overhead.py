"""What a Session costs a training loop: steps/s with and without it, measured side by side.

The same small GPT (the demo's), data and seed train for ``--steps`` steps plainly and inside a
one-node Session (H=50, 4 fragments, directory mailbox, the Session's default 1 s polls),
alternating ``--repeats`` times so machine noise hits both alike. Target (issue 6): the Session
costs under 2% of throughput.

A lone node is the worst case: it closes every round itself (reads its snapshot and the outer
state, takes the outer step, writes the new parameters and state, reads the commit back), where
a node of an N-node run closes about 1/N of them. The bench also reports what the Session's
threads spend, in CPU milliseconds per round, and runs each loop at each ``--threads`` count
(torch's intra-op threads): with every core busy in torch, that CPU is taken from training;
with a core to spare (as beside a GPU, where the training thread mostly waits), it is not.

    python bench/overhead.py [--steps 300] [--repeats 3] [--threads 2,1] [--inner-steps 50]
                             [--fragments 4] [--overlap 10] [--poll-interval 1.0]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import attrs
import torch

from gradientmail import DiLoCo, Session, mailbox_from_url
from gradientmail.demo.config import GPTConfig
from gradientmail.demo.corpus import batches, load_corpus
from gradientmail.demo.model import TorchTrainer


@attrs.frozen
class Run:
    steps_per_second: float
    rounds: int = 0
    comm_cpu: float = 0.0  # seconds of CPU on the Session's threads during the timed loop


def session_threads_cpu() -> float:
    """CPU seconds of the Session's loop threads and their executors' threads (Unix)."""
    total = 0.0
    for thread in threading.enumerate():
        if thread.ident is None or not thread.name.startswith(("gradientmail-", "asyncio_")):
            continue
        try:
            total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (OSError, AttributeError):  # the thread just ended, or no per-thread clocks
            continue
    return total


def measure(
    steps: int, session_of: Callable[[torch.nn.Module], AbstractContextManager[Any]]
) -> Run:
    """Steps per second of ``steps`` inner steps (after 10 warm-up steps)."""
    config = GPTConfig()
    trainer = TorchTrainer(config, seed=0, lr=1e-3, warmup=10, total_steps=steps + 10)
    data = batches(load_corpus().train, batch=8, context=config.context, seed=0, node=0)
    for _ in range(10):
        trainer.train_step(next(data))
    with session_of(trainer.model) as session:
        cpu = session_threads_cpu()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            windows = next(data)
            trainer.train_step(windows)
            if session is not None:
                session.step(samples=int(windows.size))
            times.append(time.perf_counter() - start)
        elapsed = sum(times)
        if session is None:
            return Run(steps / elapsed)
        cpu = session_threads_cpu() - cpu
        rounds = session.rounds_seen + 1
    return Run(steps / elapsed, rounds=rounds, comm_cpu=cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    cores = os.cpu_count() or 1
    default_threads = f"{cores},{cores - 1}" if cores > 1 else "1"
    parser.add_argument(
        "--threads", default=default_threads, help="torch intra-op thread counts, comma-separated"
    )
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--overlap", type=int, default=10, help="overlap_steps (tau)")
    parser.add_argument("--poll-interval", type=float, default=1.0, help="seconds")
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

    setting = f"H={args.inner_steps}, K={args.fragments}, tau={args.overlap}"
    print(f"| torch threads | loop | steps/s (median of {args.repeats}) | runs |")
    print("|---:|---|---:|---|")
    summary = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        plain: list[Run] = []
        session: list[Run] = []
        for _ in range(args.repeats):
            plain.append(measure(args.steps, lambda model: nullcontext()))
            session.append(measure(args.steps, with_session))
        p = statistics.median(r.steps_per_second for r in plain)
        s = statistics.median(r.steps_per_second for r in session)
        for name, runs, median in (("plain", plain, p), (f"Session ({setting})", session, s)):
            values = ", ".join(f"{r.steps_per_second:.2f}" for r in runs)
            print(f"| {threads} | {name} | {median:.2f} | {values} |")
        per_round = statistics.median(1000 * r.comm_cpu / max(1, r.rounds) for r in session)
        share = statistics.median(
            100 * r.comm_cpu * r.steps_per_second / args.steps for r in session
        )
        summary.append(
            f"{threads} torch threads: Session cost {100 * (1 - s / p):.2f}% of throughput "
            f"(target < 2%); its threads used {per_round:.1f} ms CPU per round, "
            f"{share:.2f}% of one core"
        )
    print()
    print("\n".join(summary))


if __name__ == "__main__":
    main()
