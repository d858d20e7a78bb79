"""Convergence of DiLoCo and Streaming DiLoCo against data parallelism and against DiLoCo
computed in one process from the paper's Algorithm 1, at a horizon of 100 outer steps.

    python bench/convergence.py [--quick] [--only a,b,ref] [--out DIR] [--merge EARLIER.json]
    python bench/convergence.py --sweep [--sweep-lr 0.4,0.7,1.0] [--sweep-h 25,50,100]

Same model, data, initial parameters and total tokens for every variant:

  a    synchronous data parallelism over M workers: one process, an M times larger batch
  b    one worker alone, the per-worker batch, M times the steps (same tokens)
  b1   one worker alone, the per-worker batch and a node's steps (1/M of the tokens):
       the single-worker baseline of DiLoCo's Table 2
  ref  DiLoCo in one process from Algorithm 1 (``gradientmail.demo.reference``): M models,
       H inner steps each, torch.optim.SGD with Nesterov momentum on the mean delta
  c    DiLoCo, M worker processes through a directory mailbox, H inner steps per round;
       it must match ref (a start barrier makes every round include every node)
  d    Streaming DiLoCo: K fragments, tau overlapping steps, alpha = 0.5
  e    d with F4 (MXFP4) deltas
  f    c with the norm clip (DiLoCo.clip, --clip x the round's median), reported with how
       many deltas it scaled down

Every variant uses the same inner optimizer and schedule (AdamW, lr 1e-3, 50 warmup steps,
cosine decay, weight decay 0.1); nothing is tuned per variant. Prints a markdown table (held-out
loss, bytes per node, ratio to a), writes it with the raw figures to DIR/convergence.{md,json}
and the held-out curves against tokens and against bytes communicated to
DIR/convergence-{tokens,bytes}.png. ``--merge`` adds the variants of an earlier run with the
same settings (its convergence.json), so that variants can run in separate sittings.

``--sweep`` runs the reference (validated against the mailbox by ``c``) over a grid of outer
learning rates and H at the same tokens, all at once, and writes DIR/sweep.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from gradientmail.demo.config import GPTConfig
from gradientmail.demo.launcher import aligned_heldout
from gradientmail.demo.plot import plot_curves
from gradientmail.demo.processes import (
    DemoError,
    Job,
    allreduce_bytes,
    prepare_directory,
    run_nodes,
)
from gradientmail.demo.progress import human_bytes

VARIANTS = ("a", "b", "b1", "ref", "c", "d", "e", "f")
REFERENCE = "gradientmail.demo.reference"
WORKER = "gradientmail.demo.worker"


@attrs.frozen(kw_only=True)
class Variant:
    key: str
    title: str
    processes: int
    batch: int
    steps: int
    sync: tuple[str, ...] | None  # worker options of the algorithm; None trains alone
    module: str = WORKER


@attrs.frozen(kw_only=True)
class Result:
    key: str
    title: str
    tokens: int
    heldout: float
    sent: float
    received: float
    seconds: float
    curve: list[tuple[float, float]]
    # (bytes sent and received per node so far, held-out loss) at each evaluation
    by_bytes: list[tuple[float, float]] = attrs.field(factory=list)
    outer_steps: int = 0


def variants(args: argparse.Namespace) -> dict[str, Variant]:
    m, b, s, h = args.nodes, args.batch, args.steps, args.inner_steps
    outer = ("--outer-lr", str(args.outer_lr), "--outer-momentum", str(args.outer_momentum))
    diloco = ("--inner-steps", str(h), *outer, "--wait-nodes", str(m))
    streaming = (
        "--inner-steps",
        str(h),
        "--fragments",
        str(args.fragments),
        "--overlap-steps",
        str(args.overlap),
        "--wait-nodes",
        str(m),
        *(("--alpha", args.alpha) if args.alpha is not None else ()),
    )
    return {
        v.key: v
        for v in (
            Variant(
                key="a",
                title=f"data parallel, {m} workers",
                processes=1,
                batch=m * b,
                steps=s,
                sync=None,
            ),
            Variant(
                key="b", title="1 worker, same tokens", processes=1, batch=b, steps=m * s, sync=None
            ),
            Variant(
                key="b1",
                title=f"1 worker, same steps (1/{m} tokens)",
                processes=1,
                batch=b,
                steps=s,
                sync=None,
            ),
            Variant(
                key="ref",
                title=f"DiLoCo reference, Algorithm 1 in one process, M={m}, H={h}",
                processes=1,
                batch=b,
                steps=s,
                sync=None,
                module=REFERENCE,
            ),
            Variant(
                key="c",
                title=f"DiLoCo, {m} nodes, H={h}",
                processes=m,
                batch=b,
                steps=s,
                sync=diloco,
            ),
            Variant(
                key="d",
                title=f"Streaming DiLoCo, K={args.fragments}, tau={args.overlap}"
                + (f", alpha {args.alpha}" if args.alpha is not None else ""),
                processes=m,
                batch=b,
                steps=s,
                sync=streaming,
            ),
            Variant(
                key="e",
                title="Streaming DiLoCo + F4 deltas",
                processes=m,
                batch=b,
                steps=s,
                sync=(*streaming, "--quantization", "F4"),
            ),
            Variant(
                key="f",
                title=f"(c) with the norm clip at {args.clip:g}x the median",
                processes=m,
                batch=b,
                steps=s,
                sync=(*diloco, "--clip", str(args.clip)),
            ),
        )
    }


def model_argv(args: argparse.Namespace) -> list[str]:
    return [
        "--context",
        str(args.context),
        "--layers",
        str(args.layers),
        "--dim",
        str(args.dim),
        "--heads",
        str(args.heads),
        "--eval-windows",
        str(args.eval_windows),
        "--log-every",
        "25",
    ]


def jobs_of(variant: Variant, args: argparse.Namespace, root: Path) -> list[Job]:
    out = root / variant.key
    prepare_directory(out)
    common = [
        *model_argv(args),
        "--batch",
        str(variant.batch),
        "--steps",
        str(variant.steps),
        "--eval-every",
        str(args.eval_every * variant.steps // args.steps),
    ]
    if variant.sync is not None:
        mailbox = root / f"{variant.key}-mailbox"
        prepare_directory(mailbox)
        common += ["--mailbox", mailbox.as_uri(), *variant.sync]
    if variant.module == REFERENCE:
        common += ["--workers", str(args.nodes), "--inner-steps", str(args.inner_steps)]
        common += ["--outer-lr", str(args.outer_lr), "--outer-momentum", str(args.outer_momentum)]
    label = variant.key if variant.processes == 1 else f"{variant.key}/node-{{}}"
    return [
        Job(
            label=label.format(i),
            node=i,
            argv=tuple(common),
            out=out,
            steps=variant.steps,
            module=variant.module,
        )
        for i in range(variant.processes)
    ]


def result_of(
    variant: Variant,
    args: argparse.Namespace,
    root: Path,
    progress: dict[str, list[dict[str, Any]]],
    seconds: float,
) -> Result:
    out = root / variant.key
    summaries = [json.loads(p.read_text()) for p in sorted(out.glob("summary-*.json"))]
    workers = args.nodes if variant.module == REFERENCE else variant.processes
    tokens_per_step = variant.batch * args.context * workers
    by_step: dict[int, list[tuple[float, float]]] = {}
    for records in progress.values():
        for r in records:
            if "heldout" in r and not r.get("final"):
                traffic = float(r.get("bytes_out", 0) + r.get("bytes_in", 0))
                by_step.setdefault(r["step"], []).append((r["heldout"], traffic))
    curve = [
        (float(step * tokens_per_step), sum(h for h, _ in v) / len(v))
        for step, v in sorted(by_step.items())
    ]
    by_bytes = [
        (sum(t for _, t in v) / len(v), sum(h for h, _ in v) / len(v))
        for _, v in sorted(by_step.items())
    ]
    if variant.sync is None:
        heldout = summaries[0]["heldout"]
        params = summaries[0]["parameters"]
        dp = allreduce_bytes(params, args.nodes, variant.steps) if variant.key == "a" else 0
        sent = received = float(dp)
        if variant.key == "a":
            # An all-reduce per step: bytes grow with steps; each way, so twice that in total.
            by_bytes = [
                (2.0 * allreduce_bytes(params, args.nodes, round(t / tokens_per_step)), h)
                for t, h in curve
            ]
        else:
            by_bytes = []
    else:
        config = GPTConfig(context=args.context, layers=args.layers, dim=args.dim, heads=args.heads)
        _, heldout = aligned_heldout(
            (root / f"{variant.key}-mailbox").as_uri(),
            config,
            framework="torch",
            eval_windows=args.eval_windows,
        )
        sent = sum(s["bytes_out"] for s in summaries) / len(summaries)
        received = sum(s["bytes_in"] for s in summaries) / len(summaries)
    tokens = variant.steps * tokens_per_step
    title = variant.title
    if variant.sync is not None and "--clip" in variant.sync:
        clipped, deltas = clip_counts(out)
        title += f" ({clipped} of {deltas} deltas clipped)"
    if variant.sync is not None and by_bytes:
        by_bytes.append((sent + received, heldout))
    synced = variant.sync is not None or variant.module == REFERENCE
    return Result(
        key=variant.key,
        title=title,
        tokens=tokens,
        heldout=heldout,
        sent=sent,
        received=received,
        seconds=seconds,
        curve=[*curve, (tokens, heldout)],
        by_bytes=by_bytes,
        outer_steps=variant.steps // args.inner_steps if synced else 0,
    )


def clip_counts(out: Path) -> tuple[int, int]:
    """Deltas the closers scaled down (``Clipped`` events) and deltas committed, from the
    workers' logs of one variant."""
    clipped = deltas = 0
    for log in out.glob("*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if " Clipped node=" in line:
                clipped += 1
            elif " Committed node=" in line and (found := re.search(r" included=(\d+)", line)):
                deltas += int(found.group(1))
    return clipped, deltas


def table(results: Sequence[Result]) -> str:
    base = next((r for r in results if r.key == "a"), None)
    lines = [
        "| variant | tokens | outer steps | held-out loss | vs (a) | sent / node "
        "| received / node | less than (a) | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        versus = f"{100 * (r.heldout / base.heldout - 1):+.2f}%" if base else "-"
        total = r.sent + r.received
        less = (
            f"{(base.sent + base.received) / total:.0f}x"
            if base and total and r.key != "a"
            else ("-" if r.key != "a" else "1x")
        )
        lines.append(
            f"| ({r.key}) {r.title} | {r.tokens:,} | {r.outer_steps or '-'} | "
            f"{r.heldout:.4f} | {versus} | "
            f"{human_bytes(r.sent)} | {human_bytes(r.received)} | {less} | "
            f"{r.seconds:.0f} |"
        )
    return "\n".join(lines)


def targets(results: Sequence[Result]) -> list[str]:
    """The papers' targets (DiLoCo Table 2, Streaming DiLoCo Table 1), met or missed."""
    r = {x.key: x for x in results}
    checks: list[str] = []

    def check(name: str, ok: bool, detail: str) -> None:
        checks.append(f"- {name}: {'met' if ok else 'MISSED'} ({detail})")

    if "a" in r and "c" in r:
        gap = r["c"].heldout / r["a"].heldout - 1
        check("(c) within 2% of (a)", gap <= 0.02, f"{100 * gap:+.2f}%")
        comm = (r["a"].sent + r["a"].received) / max(1.0, r["c"].sent + r["c"].received)
        check("(c) at least 50x less communication than (a)", comm >= 50, f"{comm:.0f}x")
    if "ref" in r and "c" in r:
        gap = r["c"].heldout / r["ref"].heldout - 1
        check("(c) within 1% of the reference", abs(gap) <= 0.01, f"{100 * gap:+.3f}%")
    if "c" in r and "f" in r:
        cost = r["f"].heldout / r["c"].heldout - 1
        checks.append(f"- cost of the norm clip: (f) vs (c) {100 * cost:+.2f}% held-out loss")
    if "d" in r and "e" in r:
        gap = r["e"].heldout / r["d"].heldout - 1
        check("(e) within 1% of (d)", gap <= 0.01, f"{100 * gap:+.2f}%")
    for key in ("b", "b1"):
        others = [x for x in ("a", "c") if x in r]
        if key in r and others:
            worse = all(r[key].heldout > r[x].heldout for x in others)
            check(
                f"({key}) worse than {' and '.join(f'({x})' for x in others)}",
                worse,
                ", ".join(f"{x} {r[x].heldout:.4f}" for x in (key, *others)),
            )
    return checks


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="a short smoke configuration")
    p.add_argument(
        "--only",
        default=",".join(VARIANTS),
        help=f"comma-separated variants of {','.join(VARIANTS)} (default: all)",
    )
    p.add_argument("--out", default="/tmp/gradientmail-bench", help="output directory")
    p.add_argument("--nodes", type=int, default=4, help="M")
    p.add_argument("--steps", type=int, default=5000, help="inner steps of one DiLoCo node")
    p.add_argument("--batch", type=int, default=8, help="sequences per step and worker")
    p.add_argument("--inner-steps", type=int, default=50, help="H")
    p.add_argument("--outer-lr", type=float, default=0.7, help="the outer optimizer's")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="Nesterov momentum")
    p.add_argument("--fragments", type=int, default=2, help="K for (d) and (e)")
    p.add_argument("--overlap", type=int, default=2, help="tau for (d) and (e)")
    p.add_argument(
        "--alpha",
        default=None,
        help="(d) and (e)'s merge mix, or 'none' (keep the local progress since the "
        "snapshot); unset: DiLoCo.streaming's 0.5",
    )
    p.add_argument("--clip", type=float, default=2.0, help="(f)'s norm clip, x the round's median")
    p.add_argument("--eval-every", type=int, default=250, help="node steps between evaluations")
    p.add_argument("--eval-windows", type=int, default=128, help="held-out sequences")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--sweep", action="store_true", help="the outer lr x H grid on the reference")
    p.add_argument("--sweep-lr", default="0.4,0.7,1.0", help="outer learning rates to sweep")
    p.add_argument("--sweep-h", default="25,50,100", help="H values to sweep")
    p.add_argument(
        "--merge",
        action="append",
        default=[],
        metavar="JSON",
        help="an earlier run's convergence.json (same settings) whose variants to include",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.batch, args.inner_steps, args.eval_every = 60, 4, 20, 20
        args.context, args.layers, args.dim, args.eval_windows = 32, 1, 32, 16
    if not args.clip >= 1.0:
        p.error(f"--clip must be at least 1.0 (x the round's median delta norm), got {args.clip}")
    unknown = sorted(set(args.only.split(",")) - set(VARIANTS))
    if unknown:
        p.error(f"--only: unknown variants {unknown}; choose from {','.join(VARIANTS)}")
    return args


def run(args: argparse.Namespace) -> list[Result]:
    root = Path(args.out).resolve()
    prepare_directory(root)
    chosen = [v for k, v in variants(args).items() if k in args.only.split(",")]
    # Single-process baselines run side by side; each mailbox variant gets the machine alone.
    groups = [[v for v in chosen if v.sync is None], *[[v] for v in chosen if v.sync]]
    results: dict[str, Result] = {}
    for group in (g for g in groups if g):
        print(f"\n== {', '.join(f'({v.key}) {v.title}' for v in group)}", flush=True)
        start = time.monotonic()
        jobs = {v.key: jobs_of(v, args, root) for v in group}
        progress = run_nodes([j for js in jobs.values() for j in js], stream=sys.stdout, every=30)
        seconds = time.monotonic() - start
        for v in group:
            mine = {j.label: progress[j.label] for j in jobs[v.key]}
            results[v.key] = result_of(v, args, root, mine, seconds)
    return [results[k] for k in VARIANTS if k in results]


# Settings that do not change what a variant computes.
_PRESENTATION = {"quick", "only", "out", "merge", "sweep", "sweep_lr", "sweep_h"}
# Settings newer than some convergence.json files; see merged().
_ADDED_SINCE = {"clip", "outer_lr", "outer_momentum", "alpha"}


def merged(args: argparse.Namespace) -> tuple[list[Result], list[str]]:
    """The results of the earlier runs named by ``--merge``, and a note on each."""
    results, notes = [], []
    mine = {k: v for k, v in vars(args).items() if k not in _PRESENTATION}
    for path in args.merge:
        earlier = json.loads(Path(path).read_text())
        theirs = {k: v for k, v in earlier["config"].items() if k not in _PRESENTATION}
        # A setting added since that run (--clip) changed none of its variants.
        theirs |= {k: mine[k] for k in _ADDED_SINCE if k not in theirs}
        if theirs != mine:
            differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
            raise DemoError(f"--merge {path}: its settings differ in {', '.join(differ)}")
        found = [
            Result(**{**r, "curve": [tuple(p) for p in r["curve"]]}) for r in earlier["results"]
        ]
        results += found
        notes.append(f"merged from {path}: {', '.join(f'({r.key})' for r in found)}")
    return results, notes


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if args.sweep:
        return sweep(args)
    try:
        earlier, notes = merged(args)
        fresh = run(args)
    except DemoError as exc:
        print(f"convergence: error: {exc}", file=sys.stderr)
        return 1
    by_key = {r.key: r for r in earlier} | {r.key: r for r in fresh}
    results = [by_key[k] for k in VARIANTS if k in by_key]
    root = Path(args.out).resolve()
    config = (
        f"M={args.nodes}, {args.steps} steps per node, batch {args.batch}x{args.context}, "
        f"{args.layers} layers, d={args.dim}"
    )
    report = "\n".join(
        [
            f"Convergence at equal tokens ({config})",
            "",
            table(results),
            "",
            *targets(results),
            *(["", *notes] if notes else []),
        ]
    )
    print("\n" + report)
    (root / "convergence.md").write_text(report + "\n")
    (root / "convergence.json").write_text(
        json.dumps({"config": vars(args), "results": [attrs.asdict(r) for r in results]}, indent=1)
    )
    labels = {r.key: f"({r.key}) {r.title}" for r in results}
    plots = [
        plot_curves(
            {labels[r.key]: r.curve for r in results},
            root / "convergence-tokens.png",
            title=f"Held-out loss against tokens ({config})",
        ),
        plot_curves(
            {labels[r.key]: r.by_bytes for r in results if r.by_bytes},
            root / "convergence-bytes.png",
            title=f"Held-out loss against bytes communicated ({config})",
            xlabel="bytes sent and received per node (log scale)",
            log_x=True,
        ),
    ]
    print(f"\nplots: {', '.join(str(p) for p in plots)}")
    return 0


def sweep(args: argparse.Namespace) -> int:
    """The reference over outer learning rates x H at the same tokens, all at once."""
    rates = [float(x) for x in args.sweep_lr.split(",")]
    horizons = [int(x) for x in args.sweep_h.split(",")]
    root = Path(args.out).resolve()
    prepare_directory(root)
    jobs: dict[tuple[float, int], Job] = {}
    for h in horizons:
        for lr in rates:
            out = root / f"sweep-lr{lr:g}-h{h}"
            prepare_directory(out)
            argv = (
                *model_argv(args),
                *("--batch", str(args.batch), "--steps", str(args.steps)),
                *("--eval-every", str(args.eval_every), "--workers", str(args.nodes)),
                *("--inner-steps", str(h), "--outer-lr", str(lr)),
                *("--outer-momentum", str(args.outer_momentum)),
            )
            jobs[lr, h] = Job(
                label=f"lr={lr:g} H={h}",
                node=0,
                argv=argv,
                out=out,
                steps=args.steps,
                module=REFERENCE,
            )
    try:
        progress = run_nodes(list(jobs.values()), stream=sys.stdout, every=60)
    except DemoError as exc:
        print(f"convergence: error: {exc}", file=sys.stderr)
        return 1
    tokens_per_step = args.nodes * args.batch * args.context
    final: dict[tuple[float, int], float] = {}
    curves: dict[str, list[tuple[float, float]]] = {}
    for (lr, h), job in jobs.items():
        summary = json.loads((job.out / "summary-node-0.json").read_text())
        final[lr, h] = summary["heldout"]
        points = [
            (float(r["step"] * tokens_per_step), r["heldout"])
            for r in progress[job.label]
            if "heldout" in r and not r.get("final")
        ]
        curves[f"outer lr {lr:g}, H={h}"] = [
            *points,
            (float(summary["tokens"]), summary["heldout"]),
        ]
    best = min(final, key=final.__getitem__)
    config = (
        f"reference DiLoCo, M={args.nodes}, {args.steps} steps per worker, batch "
        f"{args.batch}x{args.context}, {args.layers} layers, d={args.dim}, outer momentum "
        f"{args.outer_momentum:g}"
    )
    lines = [
        f"Held-out loss after the same tokens ({config}); best marked *",
        "",
        "| H (outer steps) | " + " | ".join(f"outer lr {lr:g}" for lr in rates) + " |",
        "|---|" + "---:|" * len(rates),
    ]
    for h in horizons:
        cells = [f"{final[lr, h]:.4f}{' *' if (lr, h) == best else ''}" for lr in rates]
        lines.append(f"| {h} ({args.steps // h}) | " + " | ".join(cells) + " |")
    report = "\n".join(lines)
    print("\n" + report)
    (root / "sweep.md").write_text(report + "\n")
    (root / "sweep.json").write_text(
        json.dumps(
            {
                "config": vars(args),
                "final": [{"outer_lr": lr, "h": h, "heldout": v} for (lr, h), v in final.items()],
                "curves": curves,
            },
            indent=1,
        )
    )
    plot = plot_curves(curves, root / "sweep.png", title=f"Held-out loss ({config})")
    print(f"\nplot: {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
