"""``python -m specs explore``: explore every interleaving of a small world, or random walks of a
big one, and print the figures and either "no violation" or the shortest trace."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from specs.config import BUGS, Config
from specs.explore import SETTLE, Result, explore, random_walk
from specs.state import Event
from specs.trace import format_trace

__all__ = ["event_code", "main"]


def _overlap(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m specs", description=__doc__)
    commands = top.add_subparsers(dest="command", required=True)
    p = commands.add_parser("explore", help="explore a configuration")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--fragments", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2, help="training publishes rounds below this")
    p.add_argument("--crashes", type=int, default=0, help="crash budget")
    p.add_argument("--faults", type=int, default=0, help="lost or ambiguous writes")
    p.add_argument("--pauses", type=int, default=0, help="process pauses")
    p.add_argument("--forgeries", type=int, default=0, help="objects a forger squats keys with")
    p.add_argument(
        "--squats",
        default="commit",
        help="the keys the forger squats: commit, snapshot, manifest (comma-separated)",
    )
    p.add_argument("--quorum", type=int, default=1)
    p.add_argument("--grace", type=int, default=0, help="seconds")
    p.add_argument("--overlap", type=_overlap, default=0, help="overlap_steps, or none")
    p.add_argument("--attempts", type=int, default=2, help="claim attempts per round")
    p.add_argument("--steps", type=int, default=None, help="inner steps per incarnation")
    p.add_argument("--drift", type=int, default=0, help="clock drift bound, seconds")
    p.add_argument("--no-leave", action="store_true", help="nodes never leave")
    p.add_argument(
        "--gather",
        action="store_true",
        help="nodes wait to see every node before they train (Session.wait_for_nodes)",
    )
    p.add_argument(
        "--idle-polls",
        type=int,
        default=2,
        help="poll intervals between GETs of a commit the node has no snapshot in",
    )
    p.add_argument(
        "--quick-leases",
        action="store_true",
        help="every node lists leases every lease_every / 2 (not lease_timeout when idle)",
    )
    p.add_argument(
        "--grain",
        choices=("write", "call"),
        default="write",
        help="a loop step: to a write, or a call",
    )
    p.add_argument("--bug", action="append", default=[], choices=sorted(BUGS), help="plant")
    p.add_argument("--no-liveness", action="store_true", help="skip the liveness check")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="processes that expand the frontier (default: one per CPU; 1 with --settle all)",
    )
    p.add_argument(
        "--settle",
        choices=SETTLE,
        default="bounds",
        help="where the healed schedule runs besides the graph's fair schedules: states with "
        "an event cut by a bound (default), every state (slower), or none",
    )
    p.add_argument(
        "--max-states", type=int, default=200_000, help="stop after this many (0: no bound)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--walk", action="store_true", help="random walks instead of exhausting")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--walks", type=int, default=200)
    p.add_argument("--depth", type=int, default=300, help="steps per random walk")
    return top


def config_of(args: argparse.Namespace) -> Config:
    return Config(
        nodes=args.nodes,
        fragments=args.fragments,
        rounds=args.rounds,
        crashes=args.crashes,
        faults=args.faults,
        pauses=args.pauses,
        forgeries=args.forgeries,
        squats=frozenset(args.squats.split(",")),
        quorum=args.quorum,
        grace=args.grace,
        overlap=args.overlap,
        attempts=args.attempts,
        steps=args.steps,
        drift=args.drift,
        leave=not args.no_leave,
        quick_leases=args.quick_leases,
        idle_polls=args.idle_polls,
        gather=args.gather,
        grain=args.grain,
        bugs=frozenset(args.bug),
    )


def event_code(event: Event) -> str:
    """The event as Python, defaults left out (to paste a trace into a regression test)."""
    args = [repr(event.kind)]
    if event.node >= 0:
        args.append(str(event.node))
    if event.loop:
        args.append(f"loop={event.loop!r}")
    if event.outcome != "ok":
        args.append(f"outcome={event.outcome!r}")
    if event.samples != 1:
        args.append(f"samples={event.samples}")
    return f"Event({', '.join(args)})"


def report(result: Result, *, walk: bool) -> str:
    lines = [
        f"config:           {result.config.describe()}",
        f"mode:             {'random walk' if walk else 'exhaustive, breadth-first'}",
        f"states explored:  {result.generated}",
        f"distinct states:  {result.distinct}",
        f"depth:            {result.depth}",
        f"time:             {result.seconds:.1f} s",
        f"states/second:    {result.rate:.0f}",
    ]
    if result.fair:
        lines.append(
            f"fair schedules:   judged from {result.fair} unsettled states (specs.fairness)"
        )
    elif not walk and not result.complete:
        lines.append(
            "fair schedules:   not judged (only a complete exploration is): liveness rests on "
            "the healed schedule, from the states at the bounds unless --settle all"
        )
    v = result.violation
    if v is None:
        if walk:
            done = "random walks: a sample, not a proof"
        elif result.complete:
            done = "complete"
        else:
            done = "INCOMPLETE: stopped at --max-states (raise it, or --walk)"
        lines.append(f"result:           no violation ({done})")
        return "\n".join(lines)
    lines.append(f"result:           VIOLATION ({v.kind}) {v.name}: {v.message}")
    lines.append(f"trace ({len(v.trace)} steps):")
    lines.append(format_trace(result.config, v.trace, v.tail))
    lines.append("replay: specs.explore.replay(config, EVENTS) with")
    lines.append("EVENTS = [" + ", ".join(event_code(e) for e in v.trace) + "]")
    return "\n".join(lines)


def _progress(generated: int, distinct: int, depth: int) -> None:
    print(f"  ... {distinct} distinct, {generated} explored, depth {depth}", file=sys.stderr)


def _workers(args: argparse.Namespace) -> int:
    if args.workers is not None:
        return max(1, args.workers)
    return 1 if args.settle == "all" else max(1, os.cpu_count() or 1)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        config = config_of(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    liveness = not args.no_liveness
    if args.walk:
        result = random_walk(
            config, seed=args.seed, walks=args.walks, depth=args.depth, liveness=liveness
        )
    else:
        result = explore(
            config,
            liveness=liveness,
            settle=args.settle,
            workers=_workers(args),
            max_states=args.max_states or None,
            progress=None if args.quiet else _progress,
        )
    print(report(result, walk=args.walk))
    return 0 if result.violation is None else 1


if __name__ == "__main__":
    sys.exit(main())
