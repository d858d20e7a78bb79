"""``audit``: check the design brief's invariants from the immutable records of any run.

It reads only what every run leaves behind (the manifest, commit records, and whatever
snapshots, claims and payloads garbage collection has not yet removed), so it works on a real
bucket after the fact, on a simulated mailbox, or on an explored world. With a ``backend`` it
also recomputes each commit whose inputs are still present and checks that the committed
parameters derive from exactly the snapshots the record lists.

Objects no node would use (garbage, oversized objects, records replayed under another key and,
in a signed run, records that do not verify) are reported in ``AuditReport.rejected``, never
counted as violations: the nodes ignore them too. A signed run is audited with its ``keyring``;
in it a forged or unreadable object at a commit key is such an object (it squats one of its
round's commit keys, which the nodes pass: ``core.slots``), while in an unsigned run, where
anyone can write a valid record, an unreadable commit record is a violation. A round with two
commits that verify is a violation, as is a commit after a missing commit key.
"""

from __future__ import annotations

import array
import asyncio
from collections import defaultdict

import attrs

from gradientmail._clock import MonotonicClock
from gradientmail._node import spill
from gradientmail._node.exchange import Exchange
from gradientmail._node.joining import read_manifest
from gradientmail._node.payloads import outer_gradient, read_base, read_fragment
from gradientmail.adapters.base import Backend
from gradientmail.core import chain, closing, gc, keys
from gradientmail.core.envelope import payload_digest, unseal
from gradientmail.core.errors import FormatError
from gradientmail.core.records import Commit, Manifest, Snapshot, read_record
from gradientmail.core.robust import oversized, snapshot_bound
from gradientmail.core.signing import Keyring
from gradientmail.core.tensors import TensorBytes
from gradientmail.mailboxes._protocol import Mailbox
from gradientmail.ops._admin import RunReader, read_leases

__all__ = ["AuditError", "AuditReport", "audit", "audit_async"]


class AuditError(AssertionError):
    """The run breaks at least one invariant; ``violations`` says which and where."""

    def __init__(self, violations: list[str]) -> None:
        self.violations = violations
        super().__init__("audit found violations:\n  " + "\n  ".join(violations))


@attrs.frozen(kw_only=True)
class AuditReport:
    """What ``audit`` checked in a run that holds every invariant."""

    commits: int
    """Commit records read (and verified, in a signed run)."""
    rounds: tuple[int, ...]
    """The committed rounds, ascending."""
    snapshots: int
    """Included snapshots still present and checked against their commit's listing."""
    recomputed: int
    """Commits whose params were recomputed from their snapshots (with a ``backend``)."""
    samples: int
    """Samples counted over all commits."""
    foreign: tuple[str, ...] = ()
    """Keys under ``rounds/`` that no node of ours writes (garbage is not a violation, but
    worth a look)."""
    rejected: tuple[tuple[str, str], ...] = ()
    """``(key, reason)`` of every object no node would use, sorted by key: unreadable or
    oversized snapshots, claims and leases, records that name another key's round or node,
    and in a signed run records that do not verify with the keyring (forgeries, or records
    signed under a secret it does not hold) including commit records."""


def audit(
    mailbox: Mailbox,
    *,
    backend: Backend | None = None,
    tolerance: float = 0.0,
    keyring: Keyring | None = None,
    keep: int | None = 1,
) -> AuditReport:
    """Check every invariant; raise ``AuditError`` listing all violations, else report.

    A signed run needs its ``keyring`` (``Keyring.of(secret)``; after a key rotation, one
    holding every secret its records were signed with): without one, or with one for an
    unsigned run, ``ProtocolError`` says so before anything is checked. ``tolerance`` is the
    largest absolute difference allowed between recomputed and committed params (0: bit-exact).
    ``keep`` is how many rounds of each fragment the run's collection keeps (its nodes'
    ``keep_rounds`` and ``gradientmail gc --keep``, the smaller; None: nothing was collected):
    the payloads the rule keeps (``core.gc.kept``) must still be there. The default, 1, holds
    for every run: a fragment's newest commit keeps its payloads.
    """
    return asyncio.run(
        audit_async(mailbox, backend=backend, tolerance=tolerance, keyring=keyring, keep=keep)
    )


async def audit_async(
    mailbox: Mailbox,
    *,
    backend: Backend | None = None,
    tolerance: float = 0.0,
    keyring: Keyring | None = None,
    keep: int | None = 1,
) -> AuditReport:
    """``audit`` as a coroutine, for callers already inside an event loop."""
    reader = RunReader(mailbox, MonotonicClock(), "audit", keyring)
    exchange = reader.exchange
    if not await mailbox.list(keys.MANIFEST):
        raise AuditError(["no manifest: the mailbox holds no run"])
    manifest = await read_manifest(exchange, sources=reader.sources)
    await _report_other_manifests(exchange)
    violations: list[str] = []
    by_round, foreign = await _list_rounds(mailbox)
    commits = await _read_commits(exchange, by_round, violations)
    violations += chain.links(manifest.algorithm, list(commits.values()), commits.__contains__)
    collected = _collected(manifest, commits, keep)
    violations += _kept(commits, by_round, collected)
    snapshots = recomputed = 0
    counted: dict[tuple[str, str], int] = {}
    used: set[str] = set()  # the snapshot key each commit's included snapshot was found at
    for r, commit in commits.items():
        for i in commit.included:
            if (i.node, i.nonce) in counted:
                violations.append(
                    f"round {r}: snapshot {i.node}/{i.nonce} also counted in round "
                    f"{counted[(i.node, i.nonce)]}"
                )
            counted[(i.node, i.nonce)] = r
        found, problems = await _check_snapshots(
            exchange, r, commit, by_round[r], used, collected=r in collected
        )
        snapshots += found
        violations += problems
        if backend is not None:
            try:
                checked, problems = await _recompute(
                    exchange, manifest, commits, r, backend, tolerance
                )
            except FormatError as exc:
                checked, problems = 0, [f"round {r}: cannot recompute its params: {exc}"]
            recomputed += checked
            violations += problems
    for r in sorted(by_round):
        violations += await _check_claims(exchange, r, commits.get(r), by_round[r])
        await _report_unused_snapshots(exchange, manifest, r, by_round[r], used)
    await read_leases(exchange)  # reports the leases no node would accept
    if violations:
        raise AuditError(violations)
    return AuditReport(
        commits=len(commits),
        rounds=tuple(sorted(commits)),
        snapshots=snapshots,
        recomputed=recomputed,
        samples=sum(c.samples for c in commits.values()),
        foreign=tuple(foreign),
        rejected=tuple(sorted(reader.rejections.found)),
    )


async def _list_rounds(mailbox: Mailbox) -> tuple[dict[int, dict[str, int]], list[str]]:
    """Every object under ``rounds/``: ours by round (key and size), and the foreign keys."""
    by_round: dict[int, dict[str, int]] = defaultdict(dict)
    foreign: list[str] = []
    for info in await mailbox.list(keys.ROUNDS):
        try:
            parsed = keys.parse(info.key)
        except FormatError:
            foreign.append(info.key)
            continue
        assert parsed.round is not None
        by_round[parsed.round][info.key] = info.size
    return by_round, foreign


async def _read_commits(
    exchange: Exchange, by_round: dict[int, dict[str, int]], violations: list[str]
) -> dict[int, Commit]:
    """Every readable commit record. One that cannot be read is a violation in an unsigned
    run; in a signed run it is rejected, as the nodes reject it (a forgery squatting the key,
    or a genuine record replayed there)."""
    commits: dict[int, Commit] = {}
    for r in sorted(by_round):
        slots = sorted(
            parsed.slot
            for parsed in map(keys.parse, by_round[r])
            if parsed.kind == "commit" and parsed.slot is not None
        )
        verified: dict[int, Commit] = {}
        for slot in slots:
            try:
                commit = await exchange.commit_at(r, slot)
            except FormatError as exc:
                if exchange.keyring is None:
                    violations.append(str(exc))
                else:
                    exchange.reject(keys.commit(r, slot), str(exc))
                continue
            if commit is not None:
                verified[slot] = commit
        if not verified:
            continue
        first = min(verified)
        if len(verified) > 1:  # core.slots: a round commits once, at its first verified key
            found = ", ".join(keys.commit(r, slot) for slot in sorted(verified))
            violations.append(f"round {r} committed {len(verified)} times: {found}")
        if slots[:first] != list(range(first)):
            violations.append(
                f"round {r}: its commit is at {keys.commit(r, first)} but an earlier commit key "
                "is missing (nodes walking the keys stop there)"
            )
        commits[r] = verified[first]
    return commits


def _collected(manifest: Manifest, commits: dict[int, Commit], keep: int | None) -> set[int]:
    """The committed rounds whose payloads and snapshots the collection rule (Decision 7) has
    collected: older than ``keep`` rounds of its fragment's newest commit (``core.gc.kept``);
    none when nothing was collected (``keep`` None)."""
    if keep is None:
        return set()
    K = manifest.algorithm.fragments
    newest: dict[int, int] = {}
    for r in commits:
        newest[r % K] = max(newest.get(r % K, -1), r)
    return {r for r in commits if not gc.kept(manifest.algorithm, newest[r % K], r, keep=keep)}


def _kept(
    commits: dict[int, Commit], by_round: dict[int, dict[str, int]], collected: set[int]
) -> list[str]:
    """The collection rule's side: every payload of a commit the rule still keeps (not in
    ``collected``) is there."""
    problems = []
    for r, commit in sorted(commits.items()):
        if r in collected:
            continue
        for ref in (commit.params, commit.state):
            if ref.key not in by_round.get(r, {}):
                problems.append(f"round {r}: {ref.key} was collected while the rule keeps it")
    return problems


async def _report_other_manifests(exchange: Exchange) -> None:
    """Report each object at a manifest key after the run's manifest: no node reads it (those
    before it were reported by the walk that passed them)."""
    run = exchange.manifest_key
    assert run is not None
    for info in await exchange.mailbox.list(keys.MANIFEST):
        try:
            kind = keys.parse(info.key).kind
        except FormatError:
            continue  # not a key of ours
        if kind == "manifest" and info.key > run:
            exchange.reject(info.key, f"after the run's manifest ({run}): never read")


async def _check_snapshots(
    exchange: Exchange,
    r: int,
    commit: Commit,
    present: dict[str, int],
    used: set[str],
    *,
    collected: bool = False,
) -> tuple[int, list[str]]:
    """Each included snapshot still present, found as every reader finds it (``core.slots``:
    at the first of its node's snapshot keys that verifies, the others reported) and checked
    against what the commit lists; the keys it was found at go into ``used``.

    In a round the collection rule has collected (``collected``), a snapshot of another
    process of the node than the one included is not the included one changed: collection
    deleted that, and a process that had not yet seen the commit published this one at the
    freed key afterwards (a late snapshot, never read by any closer: the round is committed).
    It is reported, not a violation; ``gradientmail gc`` deletes it."""
    found, problems = 0, []
    for i in commit.included:
        first = keys.snapshot(r, i.node)
        candidates = sorted(
            (parsed.slot or 0, key)
            for key in present
            if key.startswith(first) and (parsed := keys.parse(key)).node == i.node
        )
        refused = []
        for _, key in candidates:
            problem, record = await _snapshot_problem(exchange, key, i.node, r)
            if record is None:
                if problem is not None:
                    exchange.reject(key, problem)
                    refused.append(f"{key}: {problem}")
                continue
            if collected and record.nonce != i.nonce:
                exchange.reject(key, f"a late snapshot, written after round {r} was collected")
                break
            used.add(key)
            found += 1
            if (record.nonce, record.digest, record.samples, record.steps) != (
                i.nonce,
                i.digest,
                i.samples,
                i.steps,
            ):
                problems.append(f"round {r}: {key} differs from what the commit lists")
            break
        else:
            # A verified commit vouches for a snapshot that verifies: none does.
            problems += [f"round {r}: included snapshot unreadable: {why}" for why in refused]
    return found, problems


async def _check_claims(
    exchange: Exchange, r: int, commit: Commit | None, present: dict[str, int]
) -> list[str]:
    """Round ``r``'s valid claims (the exchange reports the others); a commit must be made by
    the node whose valid claim holds its attempt."""
    if not any(key.startswith(keys.claims(r)) for key in present):
        return []
    claims = await exchange.claims(r)
    if commit is None:
        return []
    return [
        f"round {r}: committed by {commit.closer} under {claim.node}'s claim"
        for claim in claims
        if claim.attempt == commit.attempt and claim.node != commit.closer
    ]


async def _report_unused_snapshots(
    exchange: Exchange, manifest: Manifest, r: int, present: dict[str, int], used: set[str]
) -> None:
    """Report each snapshot key of round ``r`` outside its commit that a closer would refuse:
    oversized (not downloaded), unreadable, not verifying, or naming another node or round."""
    bound = snapshot_bound(manifest.fragment_schema(r % manifest.algorithm.fragments))
    for key, size in sorted(present.items()):
        parsed = keys.parse(key)
        if parsed.kind != "snapshot" or key in used:
            continue
        reason = oversized(size, bound)
        if reason is None:
            reason, _ = await _snapshot_problem(exchange, key, parsed.node, r)
        if reason is not None:
            exchange.reject(key, reason)


async def _snapshot_problem(
    exchange: Exchange, key: str, node: str | None, r: int
) -> tuple[str | None, Snapshot | None]:
    """Why the object at snapshot key ``key`` would be refused, or its record."""
    blob = await exchange.get(key)
    if blob is None:
        return None, None
    try:
        sealed = unseal(blob)
        record = read_record(sealed.record, Snapshot, key=key, verifier=exchange.keyring)
    except FormatError as exc:
        return str(exc), None
    if (record.node, record.round) != (node, r):
        return f"record names {record.node} round {record.round}", None
    if payload_digest(sealed.payload) != record.digest:
        return "payload does not match the record's digest", None
    return None, record


async def _recompute(
    exchange: Exchange,
    manifest: Manifest,
    commits: dict[int, Commit],
    r: int,
    backend: Backend,
    tolerance: float,
) -> tuple[int, list[str]]:
    """Recompute round ``r``'s params from its listed snapshots and the previous state."""
    commit = commits[r]
    k = commit.fragment
    schema = manifest.fragment_schema(k)
    deltas = []
    for i in commit.included:
        found = await exchange.node_snapshot(r, i.node, limit=1 << 34)
        if found is None or found[0].nonce != i.nonce:
            return 0, []  # inputs collected: nothing to recompute
        deltas.append(backend.decode(found[1], schema))
    before = commits[commit.base_round] if commit.base_round >= 0 else None
    state = await read_base(exchange, backend, manifest, k, before)
    if state is None:
        return 0, []
    master, momentum = state
    norms = None
    if manifest.algorithm.clip is not None:  # the closer's norm clip, recomputed from the deltas
        norms = {i.node: backend.norm(d) for i, d in zip(commit.included, deltas, strict=True)}
    weights, scale = closing.outer_sum(manifest.algorithm, commit.included, norms)
    gradient = outer_gradient(backend, deltas, weights, scale)
    master, _ = spill.outer_step(
        backend,
        master,
        momentum,
        gradient,
        lr=manifest.algorithm.outer_lr,
        beta=manifest.algorithm.outer_momentum,
        nesterov=manifest.algorithm.nesterov,
    )
    expected = backend.dump(backend.cast(master, schema))
    actual = await read_fragment(exchange, commit.params, schema)
    if actual is None:
        return 0, []
    problems = []
    for name in schema.names:
        if tolerance == 0.0:
            if expected[name].data != actual[name].data:
                problems.append(f"round {r}: params {name!r} do not derive from its snapshots")
        elif _max_difference(backend, expected, actual, name) > tolerance:
            problems.append(f"round {r}: params {name!r} differ beyond {tolerance}")
    return 1, problems


def _max_difference(
    backend: Backend, expected: dict[str, TensorBytes], actual: dict[str, TensorBytes], name: str
) -> float:
    diff = backend.dump(
        backend.delta(backend.load({name: expected[name]}), backend.load({name: actual[name]}))
    )[name]
    return max((abs(v) for v in array.array("f", diff.data)), default=0.0)
