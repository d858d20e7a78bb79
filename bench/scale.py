"""A Session around a real model size: Hugging Face GPT-2 (124M or 355M parameters, random
init, CPU), the same loop with and without a Session, side by side in one run. (``small``, a
15.8M-parameter GPT-2, shows a closer's memory against the number of nodes.)

Each loop runs in its own process (so peak RSS is the loop's own): ``plain`` (the training
loop alone) and ``session`` (the same loop, ``Session.step`` after every optimizer step, on a
directory mailbox). With ``--nodes 3`` three plain processes run at once, then three Session
processes of one run at once (each node's figures against a plain process that shared the
machine the same way). Every child trains batches of 1 x 64 byte-level tokens from the Python
standard library's source, AdamW, seeded.

It prints, per loop and as ratios against the plain loop:

- steps/s over the measured steps (after a warm-up) and the Session's ratio to the plain loop;
- the longest ``Session.step`` call (s) and how many calls took over 100 ms;
- peak RSS (GiB), and the Session's extra peak RSS in units of the model's F32 bytes;
- publish-to-commit latency per round (s, from this node's ``Published`` to the ``Committed``
  or ``Merged`` of the same round) against the time to write the same bytes once to the same
  directory (a temporary file, fsync, rename: what a durable create does);
- bytes per parameter on the wire: a snapshot's stored bytes per parameter of its fragment,
  and everything the node wrote per parameter of the model per round;
- ``close()`` (s).

    python bench/scale.py                          # 124M, lone node, H=100, K=4, overlap 2
    python bench/scale.py --paired --threads 1     # ... plain and Session loops at once
    python bench/scale.py --model 355M --steps 60  # memory at 355M
    python bench/scale.py --nodes 3 --steps 150    # a node of a 3-process run
    python bench/scale.py --nodes 3 --steps 150 --spare  # ... where node 1 closes no round
    python bench/scale.py --nodes 3 --steps 150 --barrier  # ... started together
    python bench/scale.py --quantization F8_E4M3   # a quantized delta
    # a closer's memory against its round's snapshots: 15.8M parameters, one fragment
    python bench/scale.py --model small --fragments 1 --inner-steps 10 --overlap 1 \
        --threads 1 --steps 40 --nodes 2    # and --nodes 8

Needs the ``bench`` extra (``pip install -e '.[torch,bench]'``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

SIZES = {
    "124M": {"vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12},
    "355M": {"vocab_size": 50257, "n_embd": 1024, "n_layer": 24, "n_head": 16},
    # 15.8M parameters, byte-level: a closer's memory against its round's snapshots
    "small": {"vocab_size": 256, "n_embd": 512, "n_layer": 5, "n_head": 8},
    "tiny": {"vocab_size": 256, "n_embd": 32, "n_layer": 2, "n_head": 2},  # for the test
}
CONTEXT = 64
GiB = 1024**3


def corpus(limit: int = 8 * 1024 * 1024) -> bytes:
    """Bytes of the standard library's source, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = bytearray()
    for path in sorted(root.glob("*.py")):
        out += path.read_bytes()
        if len(out) >= limit:
            break
    return bytes(out)


def windows(data: bytes, seed: int) -> Iterator[Any]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    while True:
        start = int(torch.randint(0, len(tokens) - CONTEXT, (1,), generator=generator))
        yield tokens[start : start + CONTEXT].unsqueeze(0)


def build(size: str, seed: int) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_positions=1024, **SIZES[size])
    return GPT2LMHeadModel(config)


def rss_now() -> int:
    """Resident bytes now (Linux)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One loop in this process: its figures as a dict."""
    import torch

    torch.set_num_threads(args.threads)
    model = build(args.model, seed=0)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = windows(corpus(), seed=args.rank)

    def train_step() -> None:
        batch = next(data)
        loss = model(batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    train_step()  # the optimizer's state exists from here on, as in any real loop
    base_rss = rss_now()
    result: dict[str, Any] = {"loop": args.loop, "rank": args.rank, "params": params}
    if args.loop == "plain":
        for _ in range(args.warmup):
            train_step()
        rendezvous(args)
        start = time.perf_counter()
        for _ in range(args.steps):
            train_step()
        result["seconds"] = time.perf_counter() - start
        result["padding"] = 0
        while args.sync and not (Path(args.sync) / "stop").exists():
            train_step()  # the Session loop still runs beside this one: load it the same way
            result["padding"] += 1
    else:
        result.update(_session_loop(args, model, train_step))
    result["steps"] = args.steps
    result["base_rss"] = base_rss
    result["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result


def _session_loop(args: argparse.Namespace, model: Any, train_step: Any) -> dict[str, Any]:
    from gradientmail import (
        Claimed,
        Committed,
        DiLoCo,
        Merged,
        Published,
        Session,
        mailbox_from_url,
    )

    published: dict[int, tuple[float, int, int]] = {}
    closed: dict[int, float] = {}
    summed: dict[int, int] = {}  # the rounds this node committed: snapshots in each
    lock = threading.Lock()

    # wall clock, event, round (a step's index, then the process's CPU seconds): across nodes
    timeline: list[tuple[Any, ...]] = []

    def on_event(event: object) -> None:
        now = time.perf_counter()
        if isinstance(event, Published | Claimed | Committed | Merged):
            timeline.append((time.time(), type(event).__name__, event.round))
        with lock:
            if isinstance(event, Published):
                published[event.round] = (now, event.bytes, event.fragment)
            elif isinstance(event, Committed | Merged):
                closed.setdefault(event.round, now)
            if isinstance(event, Committed):
                summed[event.round] = event.included

    algorithm = DiLoCo(
        inner_steps=args.inner_steps,
        fragments=args.fragments,
        overlap_steps=args.overlap,
        quantization=None if args.quantization == "F32" else args.quantization,
    )
    mailbox = mailbox_from_url(args.mailbox)
    session = Session(
        model,
        algorithm=algorithm,
        mailbox=mailbox,
        learner_id=node_name(args.rank, args.spare),
        lease_every=10.0,
        lease_timeout=60.0,
        callbacks=(on_event,),
    )
    timeline.append((time.time(), "joined", 0))
    if args.barrier:
        # Train only once every node of the run is active (the start barrier a fixed-size run
        # uses): then no node starts rounds ahead of the others and waits for them each round.
        session.wait_for_nodes(args.nodes, timeout=600)
        timeline.append((time.time(), "released", 0))
    longest, over, calls = 0.0, 0, []
    start = 0.0
    cpu_before = thread_cpu()
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            rendezvous(args)
            start = time.perf_counter()
        train_step()
        t = time.perf_counter()
        timeline.append((time.time(), "step", i - args.warmup, time.process_time()))
        session.step(samples=CONTEXT)
        spent = time.perf_counter() - t
        calls.append(spent)
        if i >= args.warmup:
            longest = max(longest, spent)
            over += spent > 0.1
    seconds = time.perf_counter() - start
    # The peak while training, apart from close() (which publishes every fragment at once).
    training_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cpu = {n: c - cpu_before.get(n, 0.0) for n, c in thread_cpu().items()}
    t = closing = time.perf_counter()
    session.close()
    close_seconds = time.perf_counter() - t
    stats = mailbox.stats.snapshot() if hasattr(mailbox, "stats") else {}
    # Rounds published while training, and those close() published (every fragment at once:
    # they are closed one after the other, so each waits on the ones before it).
    latencies = [
        closed[r] - at
        for r, (at, _, _) in sorted(published.items())
        if r in closed and at < closing
    ]
    close_latencies = [
        closed[r] - at
        for r, (at, _, _) in sorted(published.items())
        if r in closed and at >= closing
    ]
    sizes = [size for _, size, _ in published.values()]
    by_fragment = {fragment: size for _, size, fragment in published.values()}
    write = _write_time(args.mailbox, max(sizes) if sizes else 0)
    # The same write while this process trains, as the closes did: its threads compete with
    # training for the CPU as the close's did.
    loaded = _while_training(train_step, lambda: _write_time(args.mailbox, max(sizes, default=0)))
    return {
        "seconds": seconds,
        "step_max": longest,
        "steps_over_100ms": over,
        "close": close_seconds,
        "training_peak_rss": training_peak,
        "latencies": latencies,
        "close_latencies": close_latencies,
        "snapshot_bytes": sizes,
        # a snapshot of every fragment once: the bytes one full round of deltas takes
        "model_snapshot_bytes": sum(by_fragment.values())
        if len(by_fragment) == args.fragments
        else None,
        "write_seconds": write,
        "write_seconds_training": loaded,
        "bytes_out": stats.get("bytes_out", 0),
        "rounds_published": len(published),
        "rounds_closed": len(summed),
        "most_summed": max(summed.values(), default=0),
        "timeline": timeline,
        "thread_cpu": cpu,
    }


def rendezvous(args: argparse.Namespace) -> None:
    """With ``--paired``: say this loop is warm and wait until the other one is too, so both
    measure the same stretch of time."""
    if not args.sync:
        return
    sync = Path(args.sync)
    (sync / f"{args.loop}.ready").touch()
    while not ((sync / "plain.ready").exists() and (sync / "session.ready").exists()):
        time.sleep(0.01)


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user and system) each live thread of this process has used, by thread name
    (threads Python did not start, such as torch's pool, as ``native-<id>``); {} off Linux."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    found: dict[str, float] = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        # utime and stime: fields 14 and 15 of stat, the 12th and 13th after the name
        name = names.get(int(task), f"native-{task}")
        found[name] = found.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return found


def _while_training(train_step: Any, work: Any) -> float:
    """``work()``'s result, computed on a thread while this thread trains until it is done."""
    done: list[Any] = []

    def run() -> None:
        try:
            done.append(work())
        except BaseException as exc:  # raised below, on this thread
            done.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    while thread.is_alive():
        train_step()
    thread.join()
    if isinstance(done[0], BaseException):
        raise done[0]
    return float(done[0])


def _write_time(url: str, size: int) -> float:
    """Seconds to write ``size`` bytes once to the directory behind ``url``: a temporary file,
    fsync, rename (a durable create), best of three."""
    if size == 0:
        return float("nan")
    root = url.removeprefix("file://")
    data = os.urandom(size)
    best = float("inf")
    for i in range(3):
        path = os.path.join(root, f".scale-write-{os.getpid()}-{i}")
        start = time.perf_counter()
        with open(path + ".tmp", "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(path + ".tmp", path)
        best = min(best, time.perf_counter() - start)
        os.unlink(path)
    return best


def spawn(
    args: argparse.Namespace,
    loop: str,
    rank: int,
    mailbox: str,
    *,
    cpu: int | None = None,
    sync: str = "",
) -> subprocess.Popen[str]:
    command = [
        sys.executable,
        __file__,
        "--child",
        loop,
        "--rank",
        str(rank),
        "--mailbox",
        mailbox,
        "--model",
        args.model,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--threads",
        str(args.threads),
        "--inner-steps",
        str(args.inner_steps),
        "--fragments",
        str(args.fragments),
        "--overlap",
        str(args.overlap),
        "--quantization",
        args.quantization,
        *(["--spare"] if args.spare else []),
        *(["--barrier"] if args.barrier else []),
        *(["--cpu", str(cpu), "--sync", sync] if cpu is not None else []),
    ]
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True)


def _result(process: subprocess.Popen[str], loop: str) -> dict[str, Any]:
    out, _ = process.communicate()
    if process.returncode != 0:
        raise SystemExit(f"the {loop} loop failed (exit {process.returncode})")
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def run_paired(
    args: argparse.Namespace, mine: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``--paired``: the plain loop and a lone Session loop at the same time, the Session on
    CPU ``mine`` and the plain loop on another, measuring the same stretch of time
    (``rendezvous``); the plain loop trains on until the Session loop has closed. Whatever
    else slows the machine meanwhile slows both."""
    root = tempfile.mkdtemp(prefix="gm-scale-paired-")
    sync = tempfile.mkdtemp(prefix="gm-scale-sync-")
    other = next(c for c in sorted(os.sched_getaffinity(0)) if c != mine)
    processes: list[subprocess.Popen[str]] = []
    try:
        processes.append(spawn(args, "plain", 0, "", cpu=other, sync=sync))
        processes.append(spawn(args, "session", 0, "file://" + root, cpu=mine, sync=sync))
        session = _result(processes[1], "session")
        (Path(sync) / "stop").touch()
        plain = _result(processes[0], "plain")
        plain["cpu"], session["cpu"] = other, mine
        return [plain], [session]
    finally:
        _end(processes, root, sync)


def _end(processes: list[subprocess.Popen[str]], *folders: str) -> None:
    """End the loops a failed run left (ours to end), and remove what the run wrote."""
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def run_loops(args: argparse.Namespace, loop: str) -> list[dict[str, Any]]:
    root = tempfile.mkdtemp(prefix=f"gm-scale-{loop}-")
    processes: list[subprocess.Popen[str]] = []
    try:  # a run leaves gigabytes of payloads behind
        for rank in range(args.nodes):
            processes.append(spawn(args, loop, rank, "file://" + root))
        return [_result(process, loop) for process in processes]
    finally:
        _end(processes, root)


SPARED_ROUNDS = 16
"""``--spare`` names the nodes so that node 1 leads no closer order of rounds below this."""


def node_name(rank: int, spare: bool) -> str:
    """The learner id of the node of ``rank``: ``node<rank>``, or with ``spare`` the same
    with the first suffix under which node 1 is never the first candidate closer
    (``closing.designated``) of any of the first ``SPARED_ROUNDS`` rounds among three nodes:
    a node that closes no round unless it takes one over, for the memory of a non-closer."""
    if not spare:
        return f"node{rank}"
    from gradientmail.core.closing import rank as closer_rank

    for suffix in range(100_000):
        names = [f"node{i}-{suffix}" for i in range(3)]
        leaders = {
            min(names, key=lambda n, r=r: (closer_rank(r, n), n)) for r in range(SPARED_ROUNDS)
        }
        if names[1] not in leaders:
            return f"node{rank}-{suffix}"
    raise SystemExit("no suffix spares node 1")


def steps_per_second(loop: dict[str, Any]) -> float:
    return float(loop["steps"] / loop["seconds"])


def report(
    args: argparse.Namespace, plain: list[dict[str, Any]], session: list[dict[str, Any]]
) -> None:
    params = plain[0]["params"]
    f32 = 4 * params
    print(
        f"\nGPT-2 {args.model} ({params:,} parameters, {f32 / GiB:.2f} GiB in F32), "
        f"{args.nodes} node(s), {args.threads} torch threads, H={args.inner_steps}, "
        f"K={args.fragments}, overlap {args.overlap}, {args.quantization}, "
        f"{args.steps} measured steps after {args.warmup}"
        + (", Session loops behind a start barrier" if args.barrier else "")
        + (
            f", paired: plain on CPU {plain[0]['cpu']} and Session on CPU {session[0]['cpu']} "
            f"at the same time (the plain loop took {plain[0]['padding']} more steps while "
            "the Session loop finished)"
            if args.paired
            else ""
        )
    )
    print(
        "targets (#19): ratio >= 0.95 for a lone node, 0.97 for a node of 3; longest step() "
        "<= 100 ms; extra peak RSS <= 1.5x the F32 bytes on a node that closes, 1.1x on one "
        "that does not"
    )
    print(
        "| loop | rank | steps/s | ratio | longest step() | steps > 100 ms | peak RSS GiB "
        "| extra / F32 bytes | close s | rounds closed | most snapshots in one |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    plain_rate = statistics.mean(p["steps"] / p["seconds"] for p in plain)
    plain_peak = statistics.mean(p["peak_rss"] for p in plain)
    for p in plain:
        print(
            f"| plain | {p['rank']} | {p['steps'] / p['seconds']:.3f} | 1.000 | - | - | "
            f"{p['peak_rss'] / GiB:.2f} | - | - | - | - |"
        )
    for s in session:
        rate = s["steps"] / s["seconds"]
        print(
            f"| session | {s['rank']} | {rate:.3f} | {rate / plain_rate:.3f} | "
            f"{s['step_max'] * 1000:.0f} ms | {s['steps_over_100ms']} | "
            f"{s['peak_rss'] / GiB:.2f} | {(s['peak_rss'] - plain_peak) / f32:.2f}x | "
            f"{s['close']:.1f} | {s['rounds_closed']} | {s['most_summed']} |"
        )
    for s in session:
        lat = s["latencies"]
        sizes = s["snapshot_bytes"]
        print(
            f"node{s['rank']}: peak RSS before close() {s['training_peak_rss'] / GiB:.2f} GiB: "
            f"extra {(s['training_peak_rss'] - plain_peak) / f32:.2f}x the F32 parameters "
            "(close() publishes every fragment at once)"
        )
        if lat:
            times = statistics.median(lat) / s["write_seconds"]
            loaded = statistics.median(lat) / s["write_seconds_training"]
            print(
                f"node{s['rank']}: publish to commit, rounds published while training: "
                f"{min(lat):.2f}-{max(lat):.2f} s (median {statistics.median(lat):.2f} s over "
                f"{len(lat)} rounds); writing {max(sizes) / 2**20:.0f} MiB once takes "
                f"{s['write_seconds']:.2f} s, {s['write_seconds_training']:.2f} s while the "
                f"process trains: median {times:.1f}x, {loaded:.1f}x against the write while "
                "training (target <= 4x for a lone node)"
            )
        cpu = sorted(s["thread_cpu"].items(), key=lambda item: -item[1])
        print(
            f"node{s['rank']}: CPU seconds by thread while training: "
            + ", ".join(f"{name} {seconds:.1f}" for name, seconds in cpu if seconds >= 0.05)
        )
        if s["close_latencies"]:
            late = s["close_latencies"]
            print(
                f"node{s['rank']}: publish to commit, the {len(late)} rounds close() published "
                f"at once: {min(late):.2f}-{max(late):.2f} s"
            )
        if s["model_snapshot_bytes"]:
            # every fragment once is one model's worth of snapshots
            models = s["rounds_published"] / args.fragments
            print(
                f"node{s['rank']}: snapshots {s['model_snapshot_bytes'] / params:.3f} bytes per "
                f"parameter; everything it wrote {s['bytes_out'] / models / params:.3f} bytes "
                f"per parameter per H steps"
            )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(SIZES), default="124M")
    parser.add_argument("--steps", type=int, default=200, help="measured steps per loop")
    parser.add_argument("--warmup", type=int, default=5, help="steps before measuring")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per process")
    parser.add_argument("--nodes", type=int, default=1, help="processes of each loop at once")
    parser.add_argument("--inner-steps", type=int, default=100, help="H")
    parser.add_argument("--fragments", type=int, default=4, help="K")
    parser.add_argument("--overlap", type=int, default=2, help="overlap steps (tau)")
    parser.add_argument(
        "--quantization", choices=("F32", "F8_E4M3", "F4"), default="F32", help="the delta's format"
    )
    parser.add_argument(
        "--spare",
        action="store_true",
        help="with --nodes 3: name the nodes so that node 1 closes no round (a non-closer)",
    )
    parser.add_argument(
        "--barrier",
        action="store_true",
        help="Session loops call wait_for_nodes(--nodes) before training (a start barrier)",
    )
    parser.add_argument(
        "--paired",
        action="store_true",
        help="a lone node: run the plain and the Session loop at the same time on a CPU each, "
        "then again with the CPUs swapped; the ratio is the two runs' geometric mean (use "
        "with --threads 1)",
    )
    parser.add_argument("--child", choices=("plain", "session"), help=argparse.SUPPRESS)
    parser.add_argument("--cpu", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--sync", default="", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--mailbox", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.loop = args.child
        if args.cpu is not None:  # before torch starts its threads: they inherit it
            os.sched_setaffinity(0, {args.cpu})
        print(json.dumps(child(args)), flush=True)
        return 0
    if args.spare and args.nodes != 3:
        parser.error("--spare names three nodes: use it with --nodes 3")
    if args.paired and (args.nodes != 1 or len(os.sched_getaffinity(0)) < 2):
        parser.error("--paired runs a lone node beside the plain loop: --nodes 1, two CPUs")
    if args.paired:
        # Each CPU's own speed cancels in the geometric mean of the two runs' ratios: with the
        # CPUs at speeds a and b, the ratios are (s*a)/(p*b) and (s*b)/(p*a).
        ratios, pairs = [], []
        for mine in sorted(os.sched_getaffinity(0))[:2]:
            plain, session = run_paired(args, mine)
            report(args, plain, session)
            pairs.append({"plain": plain, "session": session})
            ratios.append(steps_per_second(session[0]) / steps_per_second(plain[0]))
        print(
            f"\npaired ratio (geometric mean of {ratios[0]:.3f} and {ratios[1]:.3f}, the CPUs "
            f"swapped): {statistics.geometric_mean(ratios):.3f} (target >= 0.95 for a lone node)"
        )
        print(json.dumps({"pairs": pairs, "ratio": statistics.geometric_mean(ratios)}))
        return 0
    plain = run_loops(args, "plain")
    session = run_loops(args, "session")
    report(args, plain, session)
    print(json.dumps({"plain": plain, "session": session}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
