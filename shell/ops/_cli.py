"""The ``gradientmail`` command line: ``demo``, ``status`` and ``gc``.

Every failure ends with one line on stderr (``gradientmail: error: ...``) and a non-zero exit
status, never a traceback; set ``GRADIENTMAIL_TRACEBACK=1`` to see the traceback as well.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import traceback
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from gradientmail._secrets import SECRET_ENV, SECRET_FILE_ENV

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    from gradientmail.demo.launcher import add_demo_arguments

    parser = argparse.ArgumentParser(
        prog="gradientmail",
        description="Low-communication data-parallel training (DiLoCo) through a shared bucket.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="train a small GPT on N local processes through a mailbox",
        description="Start N worker processes that train a small byte-level GPT on the Python "
        "standard library's sources through a mailbox, show their progress live, then print a "
        "summary and write a plot of loss against tokens.",
    )
    add_demo_arguments(demo)
    status = commands.add_parser(
        "status",
        help="a run's state read from its mailbox",
        description="Read a run's state from its mailbox (read-only): manifest summary, each "
        "fragment's newest round and the open round with its reporters and claims, nodes with "
        "their leases, bytes stored, and the objects no node would use (garbage; in a signed "
        "run, records that do not verify with its secret).",
    )
    status.add_argument("url", help="the run's mailbox URL (file://, s3://, gs://, az://)")
    _add_secret_argument(status)
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument(
        "--watch",
        type=float,
        default=2.0,
        help="seconds between two reads of the leases, to tell live nodes from quiet ones "
        "(0: read once)",
    )
    status.add_argument(
        "--follow",
        "-f",
        action="store_true",
        help="keep reading, every --watch seconds (at least 1), and redraw the status in place "
        "on a terminal (a new block each time when piped; one JSON line each with --json), "
        "with each fragment's rounds per minute, until interrupted",
    )
    status.add_argument(
        "--count", type=int, default=0, help="with --follow: stop after this many reads (0: never)"
    )
    gc = commands.add_parser(
        "gc",
        help="remove payloads a run no longer needs",
        description="Delete payloads and snapshots of rounds older than the --keep newest of "
        "each fragment, and orphaned payloads; commit records and claims stay. In a signed run "
        "the rounds are counted from the newest commits that verify with its secret.",
    )
    gc.add_argument("url", help="the run's mailbox URL")
    _add_secret_argument(gc)
    gc.add_argument("--keep", type=int, default=2, help="rounds of each fragment to keep")
    gc.add_argument(
        "--horizon",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="delete a round only this long after it became collectable, by the store's "
        "modification times (nodes use 30 s; 0, the default, does not wait: a node that finds "
        "a payload gone re-aligns on the newest commit)",
    )
    gc.add_argument("--dry-run", action="store_true", help="list what would go, delete nothing")
    gc.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def _seconds(text: str) -> float:
    """A duration in seconds: finite and not negative."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"seconds must be finite and >= 0, got {text!r}")
    return value


def _add_secret_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--secret-file",
        metavar="PATH",
        help="file holding the secret of a signed run (one, or two on separate lines during a "
        f"rotation); without it, ${SECRET_ENV} or the file named by ${SECRET_FILE_ENV}, as "
        "for a node",
    )


def _run(args: argparse.Namespace) -> int:
    if args.command == "demo":
        from gradientmail.demo.launcher import run_demo

        return run_demo(args)
    import asyncio
    import json

    from gradientmail._secrets import keyring_from
    from gradientmail.core.join import SecretSources
    from gradientmail.mailboxes._urls import mailbox_from_url
    from gradientmail.ops._admin import collect, status

    keyring = keyring_from(secret_file=args.secret_file)
    sources = SecretSources(
        reader=f"gradientmail {args.command}",
        how=f"set {SECRET_ENV} (or {SECRET_FILE_ENV}), or pass --secret-file PATH",
        origins=f"--secret-file, {SECRET_ENV} or {SECRET_FILE_ENV}",
    )
    mailbox = mailbox_from_url(args.url)
    if args.command == "status" and args.follow:
        return _follow(
            args, lambda watch: status(mailbox, watch=watch, keyring=keyring, sources=sources)
        )
    if args.command == "status":
        report = asyncio.run(
            status(mailbox, watch=max(0.0, args.watch), keyring=keyring, sources=sources)
        )
        print(json.dumps(report, indent=2) if args.json else _describe_status(report))
        return 0
    done = asyncio.run(
        collect(
            mailbox,
            keep=args.keep,
            horizon=args.horizon,
            dry_run=args.dry_run,
            keyring=keyring,
            sources=sources,
        )
    )
    if args.json:
        print(json.dumps(done, indent=2))
    else:
        verb = "would delete" if args.dry_run else "deleted"
        lines = [f"{verb} {len(done['deleted'])} objects, {done['bytes_freed']} bytes"]
        print("\n".join(lines + _describe_rejected(done["rejected"])))
    return 0


def _describe_rejected(rejected: list[dict[str, str]], shown: int = 20) -> list[str]:
    """Lines naming the objects no node would use, at most ``shown`` of them."""
    if not rejected:
        return []
    lines = [f"{len(rejected)} objects rejected (no node uses them):"]
    lines += [f"  {r['key']}: {r['reason']}" for r in rejected[:shown]]
    if len(rejected) > shown:
        lines.append(f"  ... and {len(rejected) - shown} more (--json lists them all)")
    return lines


def _follow(
    args: argparse.Namespace, read: Callable[[float], Coroutine[Any, Any, dict[str, Any]]]
) -> int:
    """``status --follow``: read the run every ``--watch`` seconds (each read spans that much,
    leases read at both ends) and show it, redrawn in place on a terminal."""
    import asyncio
    import json
    import time

    from gradientmail.demo.progress import Display
    from gradientmail.mailboxes._protocol import TransientMailboxError

    display = Display(sys.stdout, every=1)
    first: tuple[float, dict[int, int]] | None = None
    reads = 0
    while args.count <= 0 or reads < args.count:
        reads += 1
        try:
            report = asyncio.run(read(max(1.0, args.watch)))
        except TransientMailboxError as exc:
            # A store that fails for a while is what a run rides out; so does its watcher.
            message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            line = f"{time.strftime('%H:%M:%S')} read {reads} failed: {message}"
            if args.json:
                print(line, file=sys.stderr, flush=True)
            else:
                display.show([line], force=True)
            time.sleep(max(1.0, args.watch))
            continue
        now = time.monotonic()
        newest = {f["fragment"]: f["newest_round"] for f in report["fragments"]}
        first = first or (now, newest)
        minutes = (now - first[0]) / 60
        fragments = report["manifest"]["algorithm"]["fragments"]
        for f in report["fragments"]:
            # Rounds of this fragment committed since the first read, per minute: fragment k's
            # rounds are k, k + K, ...; before its first commit it stood at k - K.
            k = f["fragment"]
            since = first[1][k] if first[1][k] >= 0 else k - fragments
            done = (max(f["newest_round"], since) - since) // fragments
            f["rounds_per_minute"] = round(done / minutes, 2) if minutes > 0 else None
        if args.json:
            print(json.dumps(report), flush=True)
        else:
            stamp = time.strftime("%H:%M:%S")
            lines = _describe_status(report).splitlines()
            header = f"{stamp} (read {reads}, every {max(1.0, args.watch):g} s)"
            display.show([header, *lines], force=True)
    return 0


def _describe_status(report: dict[str, Any]) -> str:
    m = report["manifest"]
    a = m["algorithm"]
    lines = [
        f"run {report['url']} created by {m['creator']}: {m['parameters']} parameters, "
        f"{m['elements']} elements, {m['bytes']} bytes, signed={m['signed']}",
        f"algorithm: H={a['inner_steps']} K={a['fragments']} outer lr {a['outer_lr']} "
        f"momentum {a['outer_momentum']} quorum {a['quorum_size']} grace {a['grace']} s "
        f"overlap {a['overlap_steps']} alpha {a['alpha']} quantization {a['quantization']}",
    ]
    for f in report["fragments"]:
        claims = ", ".join(f"{c['attempt']}:{c['node']}" for c in f["claims"]) or "none"
        unverified = ", ".join(f["unverified_reporters"])
        rate = f.get("rounds_per_minute")
        lines.append(
            f"fragment {f['fragment']}: newest round {f['newest_round']}"
            + (f" ({rate:g} rounds/min)" if rate is not None else "")
            + f"; open round {f['open_round']} reported by {', '.join(f['reporters']) or 'nobody'}"
            + (f" (not counted, no verified lease: {unverified})" if unverified else "")
            + f"; claims {claims}"
        )
    for n in report["nodes"]:
        lines.append(
            f"node {n['node']}: {n['state']} (lease counter {n['counter']}, "
            f"written {n['age_s']:.1f} s ago)"
        )
    lines.append(f"{report['objects']} objects, {report['bytes_stored']} bytes stored")
    return "\n".join(lines + _describe_rejected(report["rejected"]))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except KeyboardInterrupt:
        print("gradientmail: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if os.environ.get("GRADIENTMAIL_TRACEBACK"):
            traceback.print_exc()
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"gradientmail: error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
