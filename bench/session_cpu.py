"""The CPU a Session spends per closed round, against the CPU of the training it serves.

A lone node (the worst case: it closes every round itself) trains the demo's GPT (CPU, one
torch thread) through a Session (H=50, K=4, tau=10, directory mailbox, 1 s polls). After a
warm-up it counts, per closed round:

- training: the training thread's CPU outside ``Session.step``;
- Session, training thread: the CPU of ``Session.step`` (counting, captures, merges);
- Session, its threads: the CPU of the Session's loop threads (uploads, polls, closing).

CPU time is far steadier than wall time on a shared machine, so this resolves changes of a few
percent that ``bench/overhead.py``'s paired wall-time blocks cannot. The ratio of the Session's
CPU to the training's is what the Session would cost with no core to spare if every
millisecond it takes were a millisecond training waits (``bench/overhead.py`` measures the
real thing). ``--sleep S`` replaces each training step by S seconds of sleep, so that nothing
contends with the Session's threads (for comparing two versions of the Session: run the script
against each installed copy).

    python bench/session_cpu.py [--steps 400] [--repeat 3] [--sleep 0]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch
from overhead import session_threads_cpu

from gradientmail import DiLoCo, Session, mailbox_from_url
from gradientmail.demo.config import GPTConfig
from gradientmail.demo.corpus import batches, load_corpus
from gradientmail.demo.model import TorchTrainer


def run(steps: int, sleep: float) -> tuple[float, float, float, int]:
    """Seconds of CPU over ``steps`` steps after a warm-up: training, ``Session.step``, the
    Session's threads; and the rounds closed meanwhile."""
    config = GPTConfig()
    trainer = TorchTrainer(config, seed=0, lr=1e-3, warmup=10, total_steps=10**9)
    data = batches(load_corpus().train, batch=8, context=config.context, seed=0, node=0)
    parameters = list(trainer.model.parameters())
    with tempfile.TemporaryDirectory(prefix="gm-session-cpu-") as root:  # removed after
        return _run(steps, sleep, trainer, data, parameters, root)


def _run(
    steps: int, sleep: float, trainer: Any, data: Any, parameters: list[Any], root: str
) -> tuple[float, float, float, int]:
    session = Session(
        trainer.model,
        algorithm=DiLoCo(inner_steps=50, fragments=4, overlap_steps=10),
        mailbox=mailbox_from_url(root),
        poll_interval=1.0,
        lease_every=5.0,
        lease_timeout=15.0,
        callbacks=(),
    )
    training = stepping = 0.0
    with session:
        for i in range(30 + steps):
            if i == 30:
                training = stepping = 0.0
                threads, rounds = session_threads_cpu(), session.rounds_seen
            start = time.thread_time()
            windows = next(data)
            if sleep:
                time.sleep(sleep)
                with torch.no_grad():
                    for p in parameters:
                        p.add_(1e-4)  # the model moves, so deltas are not zero
            else:
                trainer.train_step(windows)
            middle = time.thread_time()
            session.step(samples=int(windows.size))
            training += middle - start
            stepping += time.thread_time() - middle
        threads = session_threads_cpu() - threads
        rounds = session.rounds_seen - rounds
    return training, stepping, threads, rounds


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--sleep", type=float, default=0.0, help="seconds per step instead of training"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    what = f"{args.sleep} s sleeps" if args.sleep else "training the demo GPT"
    print(f"Lone Session, H=50, K=4, tau=10, {what}, one torch thread; ms of CPU per closed round")
    print("| run | training | Session.step | Session threads | Session / training |")
    print("|---:|---:|---:|---:|---:|")
    ratios = []
    for n in range(1, args.repeat + 1):
        training, stepping, threads, rounds = run(args.steps, args.sleep)
        per = 1000 / max(1, rounds)
        ratio = (stepping + threads) / training
        ratios.append(ratio)
        # Against sleeps the "training" is a few additions: no ratio to speak of.
        share = "-" if args.sleep else f"{100 * ratio:.2f}%"
        print(
            f"| {n} | {per * training:.1f} | {per * stepping:.2f} | {per * threads:.1f} | "
            f"{share} |",
            flush=True,
        )
    if not args.sleep:
        median = 100 * statistics.median(ratios)
        print(f"\nSession CPU per training CPU, median of {args.repeat}: {median:.2f}%")


if __name__ == "__main__":
    main()
