"""What a Session costs a training loop: steps/s with and without it, in one run, side by side.

One model (the demo's small GPT by default; ``--model 124M`` or ``355M``: a Hugging Face GPT-2
built from its config as ``bench/scale.py`` builds it, batches of 1 x 64 tokens, AdamW) trains on
the CPU in alternating blocks: a *Session block*, whose steps
go through a one-node Session (H=50, 4 fragments, tau=10, directory mailbox, the Session's default
1 s polls), then a *plain block* of as many steps that bypass it, then the other order, ``--pairs``
times. Each pair is measured within a few seconds, so the machine's drift (on a shared machine,
plain throughput alone wanders by 10-20% over minutes) hits both halves alike; the cost is the
ratio of the pairs' summed times, with a 90% bootstrap interval over pairs. Target (issue 6):
the Session costs under 2% of throughput.

Blocks are aligned to the learner's slots: a Session block starts at the step that captures a
fragment and holds two slots, so the work each capture starts (upload; as the closer, read the
snapshot and outer state, take the outer step, write parameters, state and commit; merge the
commit at a step boundary) happens inside the Session block, and none is left running into the
plain block but the idle polls. A lone node is the worst case: it closes every round itself,
where a node of an N-node run closes about 1/N of them.

The bench also reports the CPU the Session's threads use per round, and runs at each
``--threads`` count (torch's intra-op threads): with every core busy in torch, that CPU is taken
from training; with a core to spare (as beside a GPU), it mostly is not. ``--control`` runs the
same pairs with both halves plain, to show the method's resolution.

It also reports the training time lost per closed round (the treated halves' time less the plain
halves', over the rounds closed): that figure does not depend on H, so a run at a smaller H
(``--inner-steps 20 --overlap 4``: a round every 5 steps instead of every 12.5) measures the
same per-round cost against 2.5 times less noise, and dividing it by a round's time at H=50
gives the cost there. ``--save PREFIX`` writes each sitting's pairs as JSON; ``--pool FILE ...``
reports sittings together (pairs are self-contained, so sittings pool by summing).

    python bench/overhead.py [--pairs 30] [--threads 2,1] [--control] [--inner-steps 50]
                             [--fragments 4] [--overlap 10] [--poll-interval 1.0]
                             [--model demo] [--save PREFIX]
    # issue 19's lone node at 124M, with an interval (a pair is about 100 s here)
    python bench/overhead.py --model 124M --threads 2 --inner-steps 100 --overlap 2 --pairs 6
    python bench/overhead.py --pool FILE [FILE ...] [--at-inner-steps 50]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from gradientmail import DiLoCo, Session, mailbox_from_url
from gradientmail.core.learner import slot_end
from gradientmail.demo.config import GPTConfig
from gradientmail.demo.corpus import batches, load_corpus
from gradientmail.demo.model import TorchTrainer


@attrs.frozen(kw_only=True)
class Pairs:
    """Seconds of each pair's two halves, and what the Session did meanwhile."""

    session: tuple[float, ...]  # the Session blocks (the treated half)
    plain: tuple[float, ...]
    steps: int  # steps in each half, summed over pairs
    rounds: int = 0
    comm_cpu: float = 0.0  # CPU seconds of the Session's threads over the timed pairs
    # CPU seconds over the treated halves and over the plain halves: this process's (every
    # thread, torch's included), and the whole machine's (every process and the kernel's own
    # work, such as writing dirty pages back; /proc/stat); zeros where not measured
    process_cpu: tuple[float, float] = (0.0, 0.0)
    machine_cpu: tuple[float, float] = (0.0, 0.0)

    @property
    def cost(self) -> float:
        """Fraction of throughput the treated half loses: 1 - plain time / treated time."""
        return _cost(self.session, self.plain)

    @property
    def lost_per_round(self) -> float:
        """Seconds of training the treated halves lost per closed round (0 without rounds)."""
        return (sum(self.session) - sum(self.plain)) / self.rounds if self.rounds else 0.0

    def cost_at(self, steps_per_round: float) -> Callable[[Halves, Halves], float]:
        """The cost this sitting's loss per round would be against rounds of
        ``steps_per_round`` plain steps (a bootstrap statistic of the halves)."""
        rounds_per_pair = self.rounds / len(self.plain)
        steps_per_pair = self.steps / len(self.plain)

        def cost(session: Halves, plain: Halves) -> float:
            lost = (sum(session) - sum(plain)) / (rounds_per_pair * len(plain))
            round_time = steps_per_round * sum(plain) / (steps_per_pair * len(plain))
            return lost / (lost + round_time)

        return cost

    def interval(
        self,
        statistic: Callable[[Halves, Halves], float] | None = None,
        *,
        level: float = 0.9,
        resamples: int = 2000,
    ) -> tuple[float, float]:
        """A bootstrap interval of ``statistic`` (``cost`` by default) over pairs."""
        statistic = statistic or _cost
        rng = random.Random(0)
        n = len(self.plain)
        values = []
        for _ in range(resamples):
            picks = [rng.randrange(n) for _ in range(n)]
            values.append(
                statistic([self.session[i] for i in picks], [self.plain[i] for i in picks])
            )
        values.sort()
        tail = (1 - level) / 2
        return values[int(tail * resamples)], values[int((1 - tail) * resamples) - 1]

    @classmethod
    def pooled(cls, sittings: Sequence[Pairs]) -> Pairs:
        """Sittings taken together: every pair of each, their steps, rounds and CPU summed (the
        CPU halves only where every sitting measured them: a sum over some of the sittings
        would be divided by the rounds of all)."""
        measured = all(p.machine_cpu != (0.0, 0.0) for p in sittings)
        return cls(
            session=tuple(t for p in sittings for t in p.session),
            plain=tuple(t for p in sittings for t in p.plain),
            steps=sum(p.steps for p in sittings),
            rounds=sum(p.rounds for p in sittings),
            comm_cpu=sum(p.comm_cpu for p in sittings),
            process_cpu=_summed([p.process_cpu for p in sittings]) if measured else (0.0, 0.0),
            machine_cpu=_summed([p.machine_cpu for p in sittings]) if measured else (0.0, 0.0),
        )


def _summed(halves: Sequence[tuple[float, float]]) -> tuple[float, float]:
    treated, plain = zip(*halves, strict=True)
    return sum(treated), sum(plain)


Halves = Sequence[float]


def _cost(session: Halves, plain: Halves) -> float:
    return 1 - sum(plain) / sum(session)


def save(path: str, setting: dict[str, object], result: Pairs) -> None:
    """Write a sitting's setting and pairs as JSON, for ``--pool``."""
    with open(path, "w") as file:
        json.dump({"setting": setting, "pairs": attrs.asdict(result)}, file)


def load(path: str) -> tuple[dict[str, object], Pairs]:
    with open(path) as file:
        data = json.load(file)
    pairs = data["pairs"]
    return data["setting"], Pairs(
        session=tuple(pairs["session"]),
        plain=tuple(pairs["plain"]),
        steps=pairs["steps"],
        rounds=pairs["rounds"],
        comm_cpu=pairs["comm_cpu"],
        process_cpu=tuple(pairs.get("process_cpu", (0.0, 0.0))),
        machine_cpu=tuple(pairs.get("machine_cpu", (0.0, 0.0))),
    )


def session_threads_cpu() -> float:
    """CPU seconds of the Session's loop threads and any executor threads (Unix)."""
    total = 0.0
    for thread in threading.enumerate():
        if thread.ident is None or not thread.name.startswith(("gradientmail-", "asyncio_")):
            continue
        try:
            total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (OSError, AttributeError):  # the thread just ended, or no per-thread clocks
            continue
    return total


def process_cpu() -> float:
    """CPU seconds of this process so far, every thread."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def machine_cpu() -> float:
    """CPU seconds the whole machine has been busy (not idle, not waiting on I/O) since boot,
    summed over its cores (Linux; 0 elsewhere)."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(f) for f in stat.readline().split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # up to steal, no guest


def block_lengths(algorithm: DiLoCo, pairs: int) -> list[int]:
    """Steps of each pair's halves: two slots, from the step that captures slot ``2i+1``."""
    return [slot_end(algorithm, 2 * i + 3) - slot_end(algorithm, 2 * i + 1) for i in range(pairs)]


def trainer(model: str) -> tuple[torch.nn.Module, Callable[[], int]]:
    """The module of ``model`` and a function that takes one optimizer step of it and returns
    the samples (tokens) it trained on; a few steps are taken first, so the optimizer's state
    exists."""
    if model == "demo":
        config = GPTConfig()
        demo = TorchTrainer(config, seed=0, lr=1e-3, warmup=10, total_steps=10**9)
        data = batches(load_corpus().train, batch=8, context=config.context, seed=0, node=0)

        def demo_step() -> int:
            windows = next(data)
            demo.train_step(windows)
            return int(windows.size)

        module, step = demo.model, demo_step
    else:
        sys.path.insert(0, str(Path(__file__).parent))
        import scale  # bench/scale.py: the same GPT-2, corpus and batches

        gpt2: Any = scale.build(model, seed=0)
        optimizer = torch.optim.AdamW(gpt2.parameters(), lr=1e-4)
        tokens = scale.windows(scale.corpus(), seed=0)

        def gpt2_step() -> int:
            batch = next(tokens)
            gpt2(batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return int(batch.numel())

        module, step = gpt2, gpt2_step
    for _ in range(10 if model == "demo" else 2):
        step()
    return module, step


def measure(
    algorithm: DiLoCo, pairs: int, poll_interval: float, *, control: bool, model: str = "demo"
) -> Pairs:
    """Alternate treated and plain blocks (ABBA); the first pair warms up and is not counted.

    The treated half goes through a Session, or, with ``control``, is plain too."""
    module, train_step = trainer(model)
    with tempfile.TemporaryDirectory(prefix="gm-overhead-") as root:  # GBs at 124M: removed
        return _measure(algorithm, pairs, poll_interval, control, module, train_step, root)


def _measure(
    algorithm: DiLoCo,
    pairs: int,
    poll_interval: float,
    control: bool,
    module: Any,
    train_step: Callable[[], int],
    root: str,
) -> Pairs:
    session = Session(
        module,
        algorithm=algorithm,
        mailbox=mailbox_from_url(root),
        poll_interval=poll_interval,
        lease_every=5.0,
        lease_timeout=15.0,
        callbacks=(),
    )

    cpu_of = {True: [0.0, 0.0], False: [0.0, 0.0]}  # treated or not: process, machine

    def block(steps: int, treated: bool) -> float:
        start, own, busy = time.perf_counter(), process_cpu(), machine_cpu()
        for _ in range(steps):
            samples = train_step()
            if treated and not control:
                session.step(samples=samples)
        seconds = time.perf_counter() - start
        cpu_of[treated][0] += process_cpu() - own
        cpu_of[treated][1] += machine_cpu() - busy
        return seconds

    with session:
        # Bring the Session to the step before its first capture; then each treated block
        # starts with a capture.
        block(slot_end(algorithm, 1) - 1, treated=True)
        treated: list[float] = []
        plain: list[float] = []
        lengths = block_lengths(algorithm, pairs + 1)
        cpu = rounds = 0.0
        for i, steps in enumerate(lengths):
            if i == 1:
                cpu, rounds = session_threads_cpu(), session.rounds_seen
                cpu_of[True][:] = cpu_of[False][:] = [0.0, 0.0]  # the warm-up pair's
            if i % 2 == 0:
                a, b = block(steps, treated=True), block(steps, treated=False)
            else:
                b, a = block(steps, treated=False), block(steps, treated=True)
            if i > 0:
                treated.append(a)
                plain.append(b)
        cpu = session_threads_cpu() - cpu
        rounds = session.rounds_seen - rounds
    return Pairs(
        session=tuple(treated),
        plain=tuple(plain),
        steps=sum(lengths[1:]),
        rounds=int(rounds),
        comm_cpu=cpu,
        process_cpu=(cpu_of[True][0], cpu_of[False][0]),
        machine_cpu=(cpu_of[True][1], cpu_of[False][1]),
    )


HEADER = (
    "| torch threads | treated half | plain steps/s | treated steps/s | cost | 90% interval | "
    "pairs | training lost per round | Session threads' CPU per round |\n"
    "|---:|---|---:|---:|---:|---|---:|---:|---:|"
)


def report(threads: object, name: str, result: Pairs) -> str:
    low, high = result.interval()
    plain = result.steps / sum(result.plain)
    treated = result.steps / sum(result.session)
    lost = f"{1000 * result.lost_per_round:.1f} ms" if result.rounds else "-"
    cpu = f"{1000 * result.comm_cpu / result.rounds:.1f} ms" if result.rounds else "-"
    return (
        f"| {threads} | {name} | {plain:.2f} | {treated:.2f} | {100 * result.cost:+.2f}% | "
        f"[{100 * low:+.2f}%, {100 * high:+.2f}%] | {len(result.plain)} | {lost} | {cpu} |"
    )


def target(model: str) -> str:
    """The cost a Session may take of ``model``'s throughput: issue 6's for the demo's model,
    issue 19's (a ratio of at least 0.95) for a lone GPT-2."""
    return "< 2%" if model == "demo" else "< 5%"


def cpu_note(result: Pairs) -> str | None:
    """Where the treated halves' extra CPU went, per closed round: this process (the Session's
    threads, its calls on the training thread and torch's threads alike) and the rest of the
    machine (other processes and the kernel's own threads). None where not measured."""
    if not result.rounds or result.machine_cpu == (0.0, 0.0):
        return None
    own = (result.process_cpu[0] - result.process_cpu[1]) / result.rounds
    machine = (result.machine_cpu[0] - result.machine_cpu[1]) / result.rounds
    return (
        f"CPU per closed round, treated halves less plain ones: this process {1000 * own:+.0f} "
        f"ms, the rest of the machine {1000 * (machine - own):+.0f} ms (the Session's threads "
        f"used {1000 * result.comm_cpu / result.rounds:.0f} ms a round; training lost "
        f"{1000 * result.lost_per_round:.0f} ms)"
    )


def pool(paths: Sequence[str], at_inner_steps: int) -> None:
    """Report saved sittings of one setting together, and their loss per round against
    rounds of ``at_inner_steps``."""
    loaded = [load(path) for path in paths]
    setting = loaded[0][0]
    for path, (other, _) in zip(paths[1:], loaded[1:], strict=True):
        differ = sorted(k for k in setting.keys() | other.keys() if setting.get(k) != other.get(k))
        if differ:
            raise SystemExit(
                f"--pool: the sittings' settings differ: {path} has "
                + ", ".join(f"{k}={other.get(k)!r}" for k in differ)
                + f" where {paths[0]} has "
                + ", ".join(f"{k}={setting.get(k)!r}" for k in differ)
            )
    result = Pairs.pooled([pairs for _, pairs in loaded])
    name = "plain (control)" if setting["control"] else "Session"
    print(f"Pooled: {len(paths)} sittings of {setting}")
    print(HEADER)
    print(report(setting["threads"], name, result))
    note = cpu_note(result)
    if note:
        print(note)
    if not result.rounds:
        return
    fragments = setting["fragments"]
    assert isinstance(fragments, int)
    steps_per_round = at_inner_steps / fragments
    statistic = result.cost_at(steps_per_round)
    low, high = result.interval(statistic)
    value = statistic(result.session, result.plain)
    print(
        f"\nAt H={at_inner_steps} (a round every {steps_per_round:g} plain steps) that loss "
        f"per round costs {100 * value:+.2f}% [{100 * low:+.2f}%, {100 * high:+.2f}%] "
        f"(target {target(str(setting.get('model', 'demo')))})"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=30)
    cores = os.cpu_count() or 1
    default_threads = f"{cores},{cores - 1}" if cores > 1 else "1"
    parser.add_argument(
        "--threads", default=default_threads, help="torch intra-op thread counts, comma-separated"
    )
    parser.add_argument("--control", action="store_true", help="also run plain against plain")
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--overlap", type=int, default=10, help="overlap_steps (tau)")
    parser.add_argument("--poll-interval", type=float, default=1.0, help="seconds")
    parser.add_argument(
        "--model",
        choices=("demo", "124M", "355M"),
        default="demo",
        help="the demo's GPT (842k parameters) or a GPT-2 (needs the bench extra)",
    )
    parser.add_argument(
        "--save", metavar="PREFIX", help="write each run's pairs to PREFIX-<threads>-<half>.json"
    )
    parser.add_argument("--pool", nargs="+", metavar="FILE", help="report saved sittings")
    parser.add_argument(
        "--at-inner-steps", type=int, default=50, help="with --pool: the H to state the cost at"
    )
    args = parser.parse_args(argv)
    if args.pool:
        pool(args.pool, args.at_inner_steps)
        return
    torch.manual_seed(0)
    algorithm = DiLoCo(
        inner_steps=args.inner_steps, fragments=args.fragments, overlap_steps=args.overlap
    )
    setting = f"H={args.inner_steps}, K={args.fragments}, tau={args.overlap}"
    print(
        f"Session: {setting}, one node, {args.poll_interval} s polls, model {args.model}; "
        "target: cost < 2% (issue 6, the demo's model), < 5% (issue 19, a lone GPT-2)"
    )
    print(HEADER)
    costs, notes = [], []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        runs = [("Session", False)] + ([("plain (control)", True)] if args.control else [])
        for name, control in runs:
            result = measure(
                algorithm, args.pairs, args.poll_interval, control=control, model=args.model
            )
            print(report(threads, name, result), flush=True)
            note = None if control else cpu_note(result)
            if note:
                notes.append(f"{threads} torch threads: {note}")
            if args.save:
                half = "control" if control else "session"
                described = {
                    "inner_steps": args.inner_steps,
                    "fragments": args.fragments,
                    "overlap": args.overlap,
                    "poll_interval": args.poll_interval,
                    "threads": threads,
                    "control": control,
                    **({"model": args.model} if args.model != "demo" else {}),
                }
                save(f"{args.save}-{threads}-{half}.json", described, result)
            if not control:
                costs.append(f"{threads} torch threads: {100 * result.cost:+.2f}%")
    print()
    print("Session cost of throughput: " + "; ".join(costs) + f" (target {target(args.model)})")
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
