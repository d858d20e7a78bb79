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

from collections import defaultdict
from typing import Any

from gradientmail.clock import Clock, MonotonicClock
from gradientmail.core import keys
from gradientmail.core import syncer as rules
from gradientmail.core.errors import FormatError, ProtocolError
from gradientmail.core.records import Commit, Lease, Manifest
from gradientmail.core.robust import members
from gradientmail.core.signing import Keyring
from gradientmail.events import Event, Rejected
from gradientmail.exchange import Exchange
from gradientmail.mailbox import Mailbox, ObjectInfo
from gradientmail.run import SecretSources, read_manifest

__all__ = ["Rejections", "RunReader", "collect", "newest_verified", "read_leases", "status"]


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
        self.exchange = Exchange(
            mailbox, clock, node=name, on_event=self.rejections, keyring=keyring
        )
        self.sources = SecretSources(
            reader=name,
            how=f"pass keyring=Keyring.of(secret) (from gradientmail.core.signing) to {name}",
            origins="keyring=",
        )

    def report(self) -> list[dict[str, str]]:
        return [{"key": k, "reason": why} for k, why in sorted(self.rejections.found)]

    async def manifest(self, sources: SecretSources | None = None) -> Manifest:
        manifest = await read_manifest(self.exchange, sources=sources or self.sources)
        if manifest is None:
            raise ProtocolError(f"{self.exchange.mailbox.url} holds no run (no manifest)")
        return manifest


async def newest_verified(exchange: Exchange, manifest: Manifest, fragment: int) -> Commit | None:
    """The newest commit of ``fragment`` that a node would accept (None: only the initial
    parameters), from the ``heads/`` hint and forward GETs like ``run.newest_commit``.

    The chain is followed forward without signatures checked (after a key rotation the old
    commits verify under no secret held) and stops, reporting it, at a record that is
    unreadable or does not continue the fragment's chain; then, in a signed run, it goes back
    from the end to the newest commit that verifies, reporting each forgery it passes."""
    K = manifest.algorithm.fragments
    start = await _hinted(exchange, fragment, K)
    chain: list[Commit] = [start] if start is not None else []
    r = start.round + K if start is not None else fragment
    while True:
        try:
            commit = await exchange.commit(r, verify=False)
        except FormatError as exc:
            exchange.reject(keys.commit(r), str(exc))
            break
        if commit is None:
            break
        if commit.fragment != fragment or commit.base_round != rules.previous_round(
            manifest.algorithm, r
        ):
            exchange.reject(keys.commit(r), f"does not continue fragment {fragment}'s chain")
            break
        chain.append(commit)
        r += K
    if exchange.keyring is None:
        return chain[-1] if chain else None
    for commit in reversed(chain):
        if commit is start:
            return start
        try:
            return await exchange.commit(commit.round)
        except FormatError as exc:
            exchange.reject(keys.commit(commit.round), str(exc))
    return None


async def _hinted(exchange: Exchange, fragment: int, K: int) -> Commit | None:
    """The verified commit the ``heads/`` hint names, None when it names none of ours."""
    hint = await exchange.head(fragment)
    if hint is None or hint % K != fragment:
        return None
    try:
        return await exchange.commit(hint)
    except FormatError as exc:
        exchange.reject(keys.commit(hint), str(exc))
        return None


async def read_leases(exchange: Exchange) -> dict[str, tuple[Lease, ObjectInfo]]:
    """Every lease a node would accept, with its listing entry, from one LIST of ``leases/``
    (``Exchange.lease_infos``, which reports foreign keys and oversized objects) and a GET
    each; the unreadable ones, those not verifying in a signed run, and those naming another
    node than the key's are reported through ``exchange.reject``."""
    found = {}
    for node, info in (await exchange.lease_infos()).items():
        try:
            lease = await exchange.lease(node)
        except FormatError as exc:
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
) -> dict[str, Any]:
    """The run's state as plain data: manifest summary, each fragment's newest commit and the
    round open after it (with its reporters and claims), nodes and their leases, bytes stored,
    and the objects read that no node would use (``"rejected"``: key and reason).

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
    for k in range(algorithm.fragments):
        commit = await newest_verified(exchange, manifest, k)
        following = commit.round + algorithm.fragments if commit else k
        claims = await exchange.claims(following)
        reporters = await exchange.reporters(following)
        counted = list(members(reporters, first)) if manifest.signed else reporters
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
        "rejected": reader.report(),
    }


async def _leases(exchange: Exchange) -> dict[str, dict[str, Any]]:
    return {
        node: {"counter": lease.counter, "left": lease.left, "version": info.version}
        for node, (lease, info) in (await read_leases(exchange)).items()
    }


async def collect(
    mailbox: Mailbox,
    *,
    keep: int = 2,
    dry_run: bool = False,
    keyring: Keyring | None = None,
    sources: SecretSources | None = None,
) -> dict[str, Any]:
    """Delete what the run no longer needs; returns the keys removed, bytes freed, each
    fragment's newest round and the objects read that no node would use (``"rejected"``).

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
    newest = {}
    for k in range(K):
        head = await newest_verified(exchange, manifest, k)
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
            except FormatError as exc:
                exchange.reject(keys.commit(r), str(exc))
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
        "rejected": reader.report(),
    }
