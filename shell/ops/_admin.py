"""Operating a run from outside it: ``status`` reads its state, ``collect`` removes what no node
needs any more. Both are what the ``gradientmail status`` and ``gradientmail gc`` commands run.

Neither joins the run: ``status`` only reads (an evaluator's read-only credentials suffice);
``collect`` deletes only payloads and snapshots of rounds older than the ``keep`` newest of
each fragment, orphaned payloads that no commit record names (a closer that crashed between
payload and record, or lost a race), and init payloads that are not the manifest's. Commit
records, claims and the manifest are never deleted.

A signed run is read with its ``keyring``, as its nodes read it: records that do not verify
(forgeries by a bucket writer without the secret) are reported under ``"rejected"`` with the
other objects no node would use, and never trusted. In particular the newest commit of a
fragment is the newest one that verifies, so forged commit records squatting the keys after it
can neither hide it from ``status`` nor move ``collect``'s horizon past payloads still needed.
"""

from __future__ import annotations

import math
import time
from typing import Any

from gradientmail._clock import Clock, MonotonicClock
from gradientmail._events import Event, Rejected
from gradientmail._node.exchange import Exchange
from gradientmail._node.joining import newest, read_manifest
from gradientmail._node.learner import UNTRUSTED
from gradientmail.core import closing, gc, keys
from gradientmail.core.join import SecretSources
from gradientmail.core.leases import Leases, observe
from gradientmail.core.records import Claim, Commit, Lease, Manifest
from gradientmail.core.robust import members
from gradientmail.core.signing import Keyring
from gradientmail.mailboxes._protocol import Mailbox, ObjectInfo

__all__ = ["Rejections", "RunReader", "collect", "read_leases", "status"]


class Rejections:
    """An exchange's ``on_event`` callback that gathers its ``Rejected`` events as ``(key,
    reason)``, the reason without the key it may repeat; other events are dropped."""

    def __init__(self) -> None:
        self.found: list[tuple[str, str]] = []

    def __call__(self, event: Event) -> None:
        if isinstance(event, Rejected):
            reason = event.reason.removeprefix(f"{event.key}: ")
            self.found.append((event.key, reason))


class RunReader:
    """A read-only exchange named ``name`` (``status``, ``collect``, ``audit``) that gathers
    what it rejects, and the words its errors use to say how to give it a secret."""

    def __init__(self, mailbox: Mailbox, clock: Clock, name: str, keyring: Keyring | None) -> None:
        self.rejections = Rejections()
        # An operator's command fails fast on a store that does not answer (about 3 s of
        # backoff), where a node waits out an outage.
        self.exchange = Exchange(
            mailbox, clock, node=name, on_event=self.rejections, keyring=keyring, retries=6
        )
        self.sources = SecretSources(
            reader=name,
            how=f"pass keyring=Keyring.of(secret) (from gradientmail.core.signing) to {name}",
            origins="keyring=",
        )

    def report(self) -> list[dict[str, str]]:
        return [{"key": k, "reason": why} for k, why in sorted(self.rejections.found)]

    async def manifest(self, sources: SecretSources | None = None) -> Manifest:
        return await read_manifest(self.exchange, sources=sources or self.sources)


async def read_leases(exchange: Exchange) -> dict[str, tuple[Lease, ObjectInfo]]:
    """Every lease a node would accept, with its listing entry, from one LIST of ``leases/``
    (``Exchange.lease_infos``, which reports foreign keys and oversized objects) and a GET
    each; the unreadable ones, those not verifying in a signed run, and those naming another
    node than the key's are reported through ``exchange.reject``."""
    found = {}
    for node, info in (await exchange.lease_infos()).items():
        try:
            lease = await exchange.lease(node)
        except UNTRUSTED as exc:
            exchange.reject(info.key, str(exc))
            continue
        if lease is not None and lease.node != node:
            exchange.reject(info.key, f"lease record names {lease.node}")
        elif lease is not None:
            found[node] = (lease, info)
    return found


async def status(
    mailbox: Mailbox,
    *,
    watch: float = 0.0,
    clock: Clock | None = None,
    keyring: Keyring | None = None,
    sources: SecretSources | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """The run's state as plain data: manifest summary, each fragment's newest commit and the
    round open after it (with its reporters and claims), nodes and their leases, bytes stored,
    and the objects read that no node would use (``"rejected"``: key and reason).

    Each node's ``age_s`` is the seconds since its lease was last written: ``now`` (Unix
    seconds, this machine's clock by default) less the store's modification time of the
    lease, so clock skew between this machine and the store shifts it; never below 0.

    With ``watch`` > 0 seconds the leases are read twice, that far apart: a node whose lease
    changed in between is ``live``; one that did not is ``quiet`` (it may be dead or slow).
    A signed run needs its ``keyring`` (``ProtocolError`` otherwise, saying what to set, in the
    words of ``sources``: the command line passes its own); in it an open round's reporters
    without a verified lease, which no node counts toward the quorum, are listed apart as
    ``"unverified_reporters"``.
    """
    clock = clock or MonotonicClock()
    reader = RunReader(mailbox, clock, "status", keyring)
    exchange = reader.exchange
    manifest = await reader.manifest(sources)
    first = await _leases(exchange)
    algorithm = manifest.algorithm
    fragments = []
    opened: list[tuple[Commit | None, int, list[str], list[Claim]]] = []
    for k in range(algorithm.fragments):
        commit = await newest(exchange, manifest, k)
        following = commit.round + algorithm.fragments if commit else k
        claims = await exchange.claims(following)
        reporters = await exchange.reporters(following)
        counted = list(members(reporters, first)) if manifest.signed else reporters
        opened.append((commit, following, counted, claims))
        fragments.append(
            {
                "fragment": k,
                "parameters": len(manifest.fragments[k]),
                "newest_round": commit.round if commit else -1,
                "samples": commit.samples if commit else 0,
                "open_round": following,
                "reporters": counted,
                "unverified_reporters": [n for n in reporters if n not in counted],
                "claims": [{"attempt": c.attempt, "node": c.node} for c in claims],
            }
        )
    if watch > 0:
        await clock.sleep(watch)
    second = await _leases(exchange) if watch > 0 else first
    leases = _view(first, second, watch)
    for entry, (commit, r, counted, claims) in zip(fragments, opened, strict=True):
        entry["reason"] = _reason(manifest, leases, commit, r, counted, claims, watch)
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
        shown = {name: value for name, value in lease.items() if name != "modified"}
        age = max(0.0, (time.time() if now is None else now) - lease["modified"])
        nodes.append({"node": node, "state": state, **shown, "age_s": round(age, 1)})
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
        "rejected": reader.report(),
    }


def _view(
    first: dict[str, dict[str, Any]], second: dict[str, dict[str, Any]], watch: float
) -> Leases:
    """The two lease reads as an observer's view (``core.leases.observe``): polled at 0 and
    at ``watch`` seconds."""

    def listing(found: dict[str, dict[str, Any]]) -> dict[str, tuple[str, bool, str]]:
        return {n: (str(lease["version"]), bool(lease["left"]), "") for n, lease in found.items()}

    return observe(observe(Leases(), listing(first), now=0.0), listing(second), now=watch)


def _reason(
    manifest: Manifest,
    leases: Leases,
    commit: Commit | None,
    r: int,
    reporters: list[str],
    claims: list[Claim],
    watch: float,
) -> str:
    """Why round ``r`` is open, in the words of the closing rules (``core.closing.decide``),
    as its first candidate closer would see it now: every lease read counts as live (status
    does not know the nodes' lease timeout), a lease seen unchanged over ``watch`` too."""
    view = closing.RoundView(
        round=r,
        reporters=tuple(reporters),
        previous_reporters=tuple(i.node for i in commit.included) if commit else None,
        claims=tuple(claims),
    )
    now = watch
    candidates = closing.designated(reporters, r, 0, leases, now=now, timeout=math.inf)
    me = candidates[0] if candidates else "status"
    _, decision = closing.decide(
        view,
        closing.RoundWatch(round=r),
        leases,
        me=me,
        algorithm=manifest.algorithm,
        now=now,
        lease_timeout=math.inf,
        takeover=math.inf,
    )
    return decision.reason


async def _leases(exchange: Exchange) -> dict[str, dict[str, Any]]:
    return {
        node: {
            "counter": lease.counter,
            "left": lease.left,
            "version": info.version,
            "modified": info.modified,
        }
        for node, (lease, info) in (await read_leases(exchange)).items()
    }


async def collect(
    mailbox: Mailbox,
    *,
    keep: int = gc.DEFAULT_KEEP,
    horizon: float = 0.0,
    now: float | None = None,
    dry_run: bool = False,
    keyring: Keyring | None = None,
    sources: SecretSources | None = None,
) -> dict[str, Any]:
    """Delete what the run no longer needs, by the nodes' own rule (``core.gc.sweep``);
    returns the keys removed, bytes freed, each fragment's newest round and the objects read
    that no node would use (``"rejected"``).

    A round's payloads go once the fragment's round ``keep`` rounds later has committed and
    ``horizon`` seconds have passed since (by the store's modification times against ``now``,
    Unix seconds by default; 0 does not wait: nodes that find a payload gone re-align). Payloads
    no commit names and initial parameters the manifest does not name go too.

    A signed run needs its ``keyring`` (``ProtocolError`` otherwise, as for ``status``): the
    horizon is counted from each fragment's newest commit that verifies, and a commit record
    that does not verify names no payload, so forged records cannot make it delete what the
    run still needs. Commit records are never deleted, forged or not."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1 round per fragment, got {keep}")
    reader = RunReader(mailbox, MonotonicClock(), "collect", keyring)
    exchange = reader.exchange
    manifest = await reader.manifest(sources)
    K = manifest.algorithm.fragments
    newest_rounds = []
    for k in range(K):
        head = await newest(exchange, manifest, k)
        newest_rounds.append(head.round if head else -1)
    listed = await mailbox.list("")
    sizes = {info.key: info.size for info in listed}
    commits: dict[int, Commit] = {}
    for info in listed:
        parsed = _parsed(info.key)
        if parsed is not None and parsed.kind == "commit" and parsed.round is not None:
            try:
                commit = await exchange.commit(parsed.round)
            except UNTRUSTED as exc:
                exchange.reject(info.key, str(exc))
                continue
            if commit is not None:
                commits[parsed.round] = commit
    doomed = gc.sweep(
        manifest.algorithm,
        {info.key: info.modified for info in listed},
        init=frozenset(ref.key for ref in manifest.init),
        newest=newest_rounds,
        commits=commits,
        keep=keep,
        horizon=horizon,
        now=time.time() if now is None else now,
    )
    if not dry_run:
        for key, _ in doomed:
            await exchange.delete(key)
    return {
        "deleted": sorted(key for key, _ in doomed),
        "bytes_freed": sum(sizes[key] for key, _ in doomed),
        "dry_run": dry_run,
        "newest_rounds": newest_rounds,
        "rejected": reader.report(),
    }


def _parsed(key: str) -> keys.ParsedKey | None:
    try:
        return keys.parse(key)
    except UNTRUSTED:
        return None
