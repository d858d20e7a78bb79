"""``audit``: check the design brief's invariants from the immutable records of any run.

It reads only what every run leaves behind (the manifest, commit records, and whatever
snapshots, claims and payloads garbage collection has not yet removed), so it works on a real
bucket after the fact, on a simulated mailbox, or on an explored world. With a ``backend`` it
also recomputes each commit whose inputs are still present and checks that the committed
parameters derive from exactly the snapshots the record lists.
"""

from __future__ import annotations

import array
import asyncio
from collections import defaultdict

import attrs

from gradientmail.adapters.base import Backend
from gradientmail.clock import MonotonicClock
from gradientmail.core import keys
from gradientmail.core import syncer as rules
from gradientmail.core.envelope import unseal
from gradientmail.core.errors import FormatError
from gradientmail.core.records import Claim, Commit, Manifest, Snapshot, read_record
from gradientmail.core.tensors import Schema, TensorBytes
from gradientmail.exchange import Exchange
from gradientmail.mailbox import Mailbox
from gradientmail.run import read_fragment

__all__ = ["AuditError", "AuditReport", "audit", "audit_async"]


class AuditError(AssertionError):
    """The run breaks at least one invariant; ``violations`` says which and where."""

    def __init__(self, violations: list[str]) -> None:
        self.violations = violations
        super().__init__("audit found violations:\n  " + "\n  ".join(violations))


@attrs.frozen(kw_only=True)
class AuditReport:
    commits: int
    rounds: tuple[int, ...]
    snapshots: int
    recomputed: int
    samples: int
    foreign: tuple[str, ...] = ()
    """Keys under ``rounds/`` that no node of ours writes (garbage is not a violation, but
    worth a look)."""


def audit(
    mailbox: Mailbox, *, backend: Backend | None = None, tolerance: float = 0.0
) -> AuditReport:
    """Check every invariant; raise ``AuditError`` listing all violations, else report."""
    return asyncio.run(audit_async(mailbox, backend=backend, tolerance=tolerance))


async def audit_async(
    mailbox: Mailbox, *, backend: Backend | None = None, tolerance: float = 0.0
) -> AuditReport:
    exchange = Exchange(mailbox, MonotonicClock(), node="audit")
    manifest = await exchange.manifest()
    if manifest is None:
        raise AuditError(["no manifest: the mailbox holds no run"])
    violations: list[str] = []
    by_round: dict[int, list[str]] = defaultdict(list)
    foreign: list[str] = []
    for key in await exchange.list_keys(keys.ROUNDS):
        try:
            parsed = keys.parse(key)
        except FormatError:
            foreign.append(key)
            continue
        assert parsed.round is not None
        by_round[parsed.round].append(key)
    commits: dict[int, Commit] = {}
    for r in sorted(by_round):
        if keys.commit(r) in by_round[r]:
            try:
                commit = await exchange.commit(r)
            except FormatError as exc:
                violations.append(str(exc))
                continue
            if commit is not None:
                commits[r] = commit
    snapshots = recomputed = 0
    counted: dict[tuple[str, str], int] = {}
    for r, commit in commits.items():
        violations += _check_commit(manifest, commits, r, commit)
        for i in commit.included:
            if (i.node, i.nonce) in counted:
                violations.append(
                    f"round {r}: snapshot {i.node}/{i.nonce} also counted in round "
                    f"{counted[(i.node, i.nonce)]}"
                )
            counted[(i.node, i.nonce)] = r
        found, problems = await _check_snapshots(exchange, r, commit, by_round[r])
        snapshots += found
        violations += problems
        violations += await _check_claim(exchange, r, commit, by_round[r])
        if backend is not None:
            checked, problems = await _recompute(exchange, manifest, commits, r, backend, tolerance)
            recomputed += checked
            violations += problems
    if violations:
        raise AuditError(violations)
    return AuditReport(
        commits=len(commits),
        rounds=tuple(sorted(commits)),
        snapshots=snapshots,
        recomputed=recomputed,
        samples=sum(c.samples for c in commits.values()),
        foreign=tuple(foreign),
    )


def _check_commit(
    manifest: Manifest, commits: dict[int, Commit], r: int, commit: Commit
) -> list[str]:
    K = manifest.algorithm.fragments
    problems = []
    if commit.round != r:
        problems.append(f"round {r}: commit record names round {commit.round}")
    if commit.fragment != r % K:
        problems.append(f"round {r}: commit names fragment {commit.fragment}, not {r % K}")
    base = rules.previous_round(manifest.algorithm, r)
    if commit.base_round != base:
        problems.append(f"round {r}: commit based on {commit.base_round}, not {base}")
    if base >= 0 and base not in commits:
        problems.append(f"round {r}: fragment chain broken, round {base} has no commit")
    for i in commit.included:
        if i.base_round != base:
            problems.append(f"round {r}: included {i.node} is based on {i.base_round}")
    return problems


async def _check_snapshots(
    exchange: Exchange, r: int, commit: Commit, present: list[str]
) -> tuple[int, list[str]]:
    found, problems = 0, []
    for i in commit.included:
        key = keys.snapshot(r, i.node)
        if key not in present:
            continue  # collected
        blob = await exchange.get(key)
        if blob is None:
            continue
        try:
            record = read_record(unseal(blob).record, Snapshot, key=key)
        except FormatError as exc:
            problems.append(f"round {r}: included snapshot unreadable: {exc}")
            continue
        found += 1
        if (record.nonce, record.digest, record.samples, record.steps) != (
            i.nonce,
            i.digest,
            i.samples,
            i.steps,
        ):
            problems.append(f"round {r}: {key} differs from what the commit lists")
    return found, problems


async def _check_claim(exchange: Exchange, r: int, commit: Commit, present: list[str]) -> list[str]:
    key = keys.claim(r, commit.attempt)
    if key not in present:
        return []
    blob = await exchange.get(key)
    if blob is None:
        return []
    claim = read_record(unseal(blob).record, Claim, key=key)
    if claim.node != commit.closer:
        return [f"round {r}: committed by {commit.closer} under {claim.node}'s claim"]
    return []


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
    f32 = Schema.of(attrs.evolve(p, dtype="F32") for p in schema.parameters)
    deltas = []
    for i in commit.included:
        found = await exchange.snapshot(r, i.node, limit=1 << 34)
        if found is None or found[0].nonce != i.nonce:
            return 0, []  # inputs collected: nothing to recompute
        deltas.append(backend.decode(found[1], schema))
    base = commit.base_round
    if base < 0:
        init = await read_fragment(exchange, manifest.init[k], schema)
        if init is None:
            return 0, []
        master, momentum = backend.cast(backend.load(init), f32), None
    else:
        state_schema = Schema.of(
            attrs.evolve(p, name=f"{part}.{p.name}")
            for part in ("master", "momentum")
            for p in f32.parameters
        )
        state = await read_fragment(exchange, commits[base].state, state_schema)
        if state is None:
            return 0, []
        loaded = backend.load(state)
        master = {n: loaded[f"master.{n}"] for n in schema.names}
        momentum = {n: loaded[f"momentum.{n}"] for n in schema.names}
    weights = rules.outer_weights(manifest.algorithm, commit.included)
    gradient = backend.weighted_sum(list(zip(weights, deltas, strict=True)))
    master, _ = backend.outer_step(
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
