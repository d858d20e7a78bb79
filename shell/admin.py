"""Operating a run from outside it: ``status`` reads its state, ``collect`` removes what no node
needs any more. Both are what the ``gradientmail status`` and ``gradientmail gc`` commands run.

Neither joins the run: ``status`` only reads (an evaluator's read-only credentials suffice);
``collect`` deletes only payloads, snapshots and claims of rounds older than the ``keep`` newest
of each fragment, orphaned payloads that no commit record names (a closer that crashed between
payload and record, or lost a race), and init payloads that are not the manifest's. Commit
records and the manifest are never deleted.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from gradientmail.clock import Clock, MonotonicClock
from gradientmail.core import keys
from gradientmail.core import syncer as rules
from gradientmail.core.errors import FormatError, ProtocolError
from gradientmail.core.records import Commit, Manifest
from gradientmail.exchange import Exchange
from gradientmail.mailbox import Mailbox
from gradientmail.run import newest_commit

__all__ = ["collect", "status"]


async def _manifest(exchange: Exchange) -> Manifest:
    manifest = await exchange.manifest()
    if manifest is None:
        raise ProtocolError(f"{exchange.mailbox.url} holds no run (no manifest)")
    return manifest


async def status(
    mailbox: Mailbox, *, watch: float = 0.0, clock: Clock | None = None
) -> dict[str, Any]:
    """The run's state as plain data: manifest summary, each fragment's newest commit and the
    round open after it (with its reporters and claims), nodes and their leases, bytes stored.

    With ``watch`` > 0 seconds the leases are read twice, that far apart: a node whose lease
    changed in between is ``live``; one that did not is ``quiet`` (it may be dead or slow).
    """
    clock = clock or MonotonicClock()
    exchange = Exchange(mailbox, clock, node="status")
    manifest = await _manifest(exchange)
    algorithm = manifest.algorithm
    fragments = []
    for k in range(algorithm.fragments):
        commit = await newest_commit(exchange, manifest, k)
        following = commit.round + algorithm.fragments if commit else k
        claims = await exchange.claims(following)
        fragments.append(
            {
                "fragment": k,
                "parameters": len(manifest.fragments[k]),
                "newest_round": commit.round if commit else -1,
                "samples": commit.samples if commit else 0,
                "open_round": following,
                "reporters": await exchange.reporters(following),
                "claims": [{"attempt": c.attempt, "node": c.node} for c in claims],
            }
        )
    first = await _leases(exchange)
    if watch > 0:
        await clock.sleep(watch)
    second = await _leases(exchange) if watch > 0 else first
    nodes = []
    for node in sorted(set(first) | set(second)):
        before, after = first.get(node), second.get(node)
        lease = after or before
        assert lease is not None
        if lease["left"]:
            state = "released"
        elif watch <= 0:
            state = "unknown"
        else:
            state = "live" if before is None or after is None or before != after else "quiet"
        nodes.append({"node": node, "state": state, **lease})
    stored = await mailbox.list("")
    return {
        "url": mailbox.url,
        "manifest": {
            "creator": manifest.creator,
            "schema_digest": manifest.schema_digest,
            "parameters": len(manifest.schema.parameters),
            "elements": sum(p.numel for p in manifest.schema.parameters),
            "bytes": manifest.schema.nbytes(),
            "signed": manifest.signed,
            "algorithm": algorithm.to_json(),
        },
        "fragments": fragments,
        "nodes": nodes,
        "objects": len(stored),
        "bytes_stored": sum(info.size for info in stored),
    }


async def _leases(exchange: Exchange) -> dict[str, dict[str, Any]]:
    found = {}
    for node, info in (await exchange.lease_infos()).items():
        try:
            lease = await exchange.lease(node)
        except FormatError:
            continue
        if lease is not None:
            found[node] = {"counter": lease.counter, "left": lease.left, "version": info.version}
    return found


async def collect(mailbox: Mailbox, *, keep: int = 2, dry_run: bool = False) -> dict[str, Any]:
    """Delete what the run no longer needs; returns the keys removed and bytes freed."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1 round per fragment, got {keep}")
    exchange = Exchange(mailbox, MonotonicClock(), node="gc")
    manifest = await _manifest(exchange)
    K = manifest.algorithm.fragments
    newest = {}
    for k in range(K):
        head = await newest_commit(exchange, manifest, k)
        newest[k] = head.round if head else -1
    sizes = {info.key: info.size for info in await mailbox.list("")}
    by_round: dict[int, list[str]] = defaultdict(list)
    doomed: list[str] = []
    init_keys = {ref.key for ref in manifest.init}
    for key in sizes:
        try:
            parsed = keys.parse(key)
        except FormatError:
            continue  # not ours: leave it alone
        if parsed.kind == "init" and key not in init_keys:
            doomed.append(key)
        elif parsed.round is not None:
            by_round[parsed.round].append(key)
    for r, found in sorted(by_round.items()):
        horizon = rules.collectable(manifest.algorithm, newest[r % K], keep=keep)
        commit: Commit | None = None
        if keys.commit(r) in found:
            try:
                commit = await exchange.commit(r)
            except FormatError:
                commit = None
        if horizon is not None and r <= horizon:
            doomed += [key for key in found if keys.parse(key).kind not in ("commit", "claim")]
        elif commit is not None:
            named = {commit.params.key, commit.state.key}
            doomed += [
                key
                for key in found
                if keys.parse(key).kind in ("params", "state") and key not in named
            ]
    if not dry_run:
        for key in doomed:
            await exchange.delete(key)
    return {
        "deleted": sorted(doomed),
        "bytes_freed": sum(sizes[key] for key in doomed),
        "dry_run": dry_run,
        "newest_rounds": [newest[k] for k in range(K)],
    }
