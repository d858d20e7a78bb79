"""Garbage collection (Decision 7): one rule, used by the nodes, ``gradientmail gc`` and the audit.

A round's payloads and snapshots may be deleted once the fragment's round ``keep`` rounds
later has committed (``collectable``: ``keep`` rounds of each fragment stay readable, so a
reader ``keep - 1`` rounds behind still finds its parameters) and ``horizon`` seconds have
passed since then (``due``: a reader that has just read the superseded commit record still
finds the payloads it names). Commit records and claims are never deleted: they are a few
hundred bytes, a commit record is what a reader that finds a payload gone re-aligns from, and a
claim is what keeps a closer that stalled past the collection from winning its round again.

Nodes collect as they commit: after round ``r``, the fragment's round ``collectable(r)``, once
``horizon`` has passed on the closer's clock. ``gradientmail gc`` sweeps a whole store with the
same rule (``sweep``), timed by the store's modification times, and also removes payloads no
commit names (a closer that lost its race or crashed before its record) and initial parameters
the manifest does not name. The audit checks the other side (``kept``): every payload the rule
keeps must still be there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gradientmail.core import keys
from gradientmail.core.algorithm import DiLoCo
from gradientmail.core.errors import FormatError
from gradientmail.core.records import Commit

__all__ = [
    "DEFAULT_HORIZON",
    "DEFAULT_KEEP",
    "collectable",
    "due",
    "in_round",
    "kept",
    "sweep",
]

DEFAULT_KEEP = 2
"""Rounds of each fragment whose payloads stay after a newer commit."""

DEFAULT_HORIZON = 30.0
"""Seconds between a round becoming collectable and its deletion."""


def collectable(algorithm: DiLoCo, committed: int, *, keep: int = DEFAULT_KEEP) -> int | None:
    """After round ``committed`` commits, the fragment's round whose payloads, snapshots and
    garbage may be deleted (its commit record and claims stay forever), or None. ``keep``
    rounds of the fragment stay readable."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1 round, got {keep}")
    old = committed - keep * algorithm.fragments
    return old if old >= 0 else None


def due(since: float, now: float, horizon: float) -> bool:
    """Whether ``horizon`` seconds have passed since ``since`` (one clock's seconds)."""
    return now - since >= horizon


def _never_deleted(key: str) -> bool:
    try:
        kind = keys.parse(key).kind
    except FormatError:
        return False
    return kind in ("commit", "claim")


def in_round(listed: Sequence[str]) -> tuple[str, ...]:
    """The keys of a collectable round's listing that go: everything but the commit record and
    the claims, garbage included."""
    return tuple(key for key in listed if not _never_deleted(key))


def kept(algorithm: DiLoCo, newest: int, r: int, *, keep: int = DEFAULT_KEEP) -> bool:
    """Whether the rule keeps round ``r``'s payloads while ``newest`` is its fragment's newest
    commit (the audit's side of the rule: these must still be there)."""
    horizon = collectable(algorithm, newest, keep=keep)
    return horizon is None or r > horizon


def sweep(
    algorithm: DiLoCo,
    objects: Mapping[str, float | None],
    *,
    init: frozenset[str],
    newest: Sequence[int],
    commits: Mapping[int, Commit],
    keep: int = DEFAULT_KEEP,
    horizon: float = DEFAULT_HORIZON,
    now: float | None = None,
) -> list[tuple[str, str]]:
    """What ``gradientmail gc`` deletes from a whole store, as ``(key, reason)``.

    ``objects`` maps every key to its modification time (seconds on the same clock as ``now``;
    None where the store gives none, which the time horizon then does not hold back);
    ``init`` holds the manifest's initial payload keys, ``newest`` each fragment's newest
    verified commit round, ``commits`` the verified commit records by round. Foreign keys are
    left alone."""
    K = algorithm.fragments
    doomed: list[tuple[str, str]] = []
    committed_at = _committed_at(objects)
    for key in sorted(objects):
        try:
            parsed = keys.parse(key)
        except FormatError:
            continue  # not ours: leave it alone
        if parsed.kind == "init" and key not in init:
            doomed.append((key, "initial parameters the manifest does not name"))
            continue
        r = parsed.round
        if r is None or _never_deleted(key):
            continue
        old = collectable(algorithm, newest[r % K], keep=keep)
        if old is not None and r <= old:
            since = committed_at.get(r + keep * K)
            if now is None or since is None or due(since, now, horizon):
                doomed.append((key, f"round {r} is {keep} commits behind its fragment's newest"))
            continue
        commit = commits.get(r)
        named = commit is None or key in (commit.params.key, commit.state.key)
        if parsed.kind in ("params", "state") and not named:
            doomed.append((key, f"a payload round {r}'s commit does not name"))
    return doomed


def _committed_at(objects: Mapping[str, float | None]) -> dict[int, float | None]:
    """When each round's commit keys were last written (None where the store gives no time):
    the newest of them, which is no earlier than the commit's own (``core.slots``: objects at
    earlier keys of the round were there before it), so the horizon never runs early."""
    times: dict[int, list[float | None]] = {}
    for key, modified in objects.items():
        if "/commit" not in key:
            continue
        try:
            parsed = keys.parse(key)
        except FormatError:
            continue
        if parsed.kind == "commit" and parsed.round is not None:
            times.setdefault(parsed.round, []).append(modified)
    return {r: _newest(ts) for r, ts in times.items()}


def _newest(times: list[float | None]) -> float | None:
    known = [t for t in times if t is not None]
    return max(known) if len(known) == len(times) else None
