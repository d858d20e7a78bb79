"""A fragment's chain of commits, and the one walk that finds its newest commit.

Round ``r`` syncs fragment ``r mod K``, and its commit's base is the fragment's previous round
``r - K`` (round -1: the initial parameters, which the manifest names). So a fragment's
committed rounds form the chain ``k, k+K, k+2K, ...`` (invariant 4), and the newest commit is
found without listing every round (Decision 8): GET the advisory ``heads/<k>`` hint, then the
commit after it, and so on until one is missing.

``Walk`` is that search as a pure state machine: ``begin`` returns its first effect, ``advance``
takes each result and returns the next effects, until ``walk.done``. Learners re-aligning after
a collected payload, joining nodes, ``gradientmail status`` and ``gc``, and the explorer all run
this one walk. Commits passed on the way are read without their signatures checked (only their
chain is used, and after a key rotation old records verify under no secret held); in a signed
run the walk then goes back from the end to the newest commit that verifies, reporting each
forgery it passes, so a forged record squatting the next commit key cannot hide the newest one.
A record that is unreadable or does not continue the chain ends the forward walk, reported.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from gradientmail.core import keys
from gradientmail.core.algorithm import DiLoCo
from gradientmail.core.effects import CommitRead, Effect, HeadRead, ReadCommit, ReadHead, Rejected
from gradientmail.core.records import Commit

__all__ = ["Walk", "advance", "begin", "continues", "links", "previous_round"]


def previous_round(algorithm: DiLoCo, r: int) -> int:
    """The fragment's round before ``r``: ``r - K``, or -1 (the manifest) for a first round."""
    return r - algorithm.fragments if r >= algorithm.fragments else -1


def continues(algorithm: DiLoCo, r: int, commit: Commit) -> str | None:
    """Why ``commit``, read at round ``r``'s key, is not a link of its fragment's chain, or
    None: it must name round ``r``, fragment ``r mod K`` and base round ``r - K``."""
    if commit.round != r:
        return f"commit record names round {commit.round}"
    k = r % algorithm.fragments
    base = previous_round(algorithm, r)
    if commit.fragment != k or commit.base_round != base:
        return (
            f"commit names fragment {commit.fragment}, base {commit.base_round} "
            f"(round {r} is fragment {k}'s, based on {base})"
        )
    return None


@attrs.frozen(kw_only=True)
class Walk:
    """The search for ``fragment``'s newest commit (``newest``, once ``done``)."""

    algorithm: DiLoCo
    fragment: int
    signed: bool
    phase: str = "hint"  # hint, start, forward, back, done
    start: Commit | None = None
    chain: tuple[Commit, ...] = ()
    back: int = 0
    newest: Commit | None = None

    @property
    def done(self) -> bool:
        return self.phase == "done"


def begin(algorithm: DiLoCo, fragment: int, *, signed: bool) -> tuple[Walk, list[Effect]]:
    """A new walk and its first effect: read the hint."""
    walk = Walk(algorithm=algorithm, fragment=fragment, signed=signed)
    return walk, [ReadHead(fragment=fragment)]


def advance(walk: Walk, result: HeadRead | CommitRead) -> tuple[Walk, list[Effect]]:
    """The walk after ``result`` (of the effect it asked for last), and what to read next."""
    K, k = walk.algorithm.fragments, walk.fragment
    if walk.phase == "hint":
        assert isinstance(result, HeadRead)
        if result.round is not None and result.round >= 0 and result.round % K == k:
            return attrs.evolve(walk, phase="start"), [ReadCommit(round=result.round)]
        return _forward(walk, k)
    assert isinstance(result, CommitRead)
    if walk.phase == "start":
        start = result.commit
        problem = result.rejected or (
            continues(walk.algorithm, result.round, start) if start is not None else None
        )
        if problem is not None:
            walk, reports = attrs.evolve(walk, start=None), [_reject(result.round, problem)]
            walk, effects = _forward(walk, k)
            return walk, reports + effects
        walk = attrs.evolve(walk, start=start)
        return _forward(walk, start.round + K if start is not None else k)
    if walk.phase == "forward":
        return _forward_read(walk, result)
    return _back_read(walk, result)


def _forward(walk: Walk, r: int) -> tuple[Walk, list[Effect]]:
    return attrs.evolve(walk, phase="forward"), [ReadCommit(round=r, verify=False)]


def _forward_read(walk: Walk, result: CommitRead) -> tuple[Walk, list[Effect]]:
    r, commit = result.round, result.commit
    if result.rejected is not None:
        return _end(walk, [_reject(r, result.rejected)])
    if commit is None:
        return _end(walk, [])
    problem = continues(walk.algorithm, r, commit)
    if problem is not None:
        return _end(walk, [_reject(r, f"does not continue fragment {walk.fragment}'s chain")])
    walk = attrs.evolve(walk, chain=(*walk.chain, commit))
    return _forward(walk, r + walk.algorithm.fragments)


def _end(walk: Walk, reports: list[Effect]) -> tuple[Walk, list[Effect]]:
    """The forward walk is over: the newest found, or in a signed run the verification of the
    chain's end, going back."""
    if not walk.chain or not walk.signed:
        newest = walk.chain[-1] if walk.chain else walk.start
        return attrs.evolve(walk, phase="done", newest=newest), reports
    last = len(walk.chain) - 1
    walk = attrs.evolve(walk, phase="back", back=last)
    return walk, [*reports, ReadCommit(round=walk.chain[last].round)]


def _back_read(walk: Walk, result: CommitRead) -> tuple[Walk, list[Effect]]:
    if result.commit is not None and result.rejected is None:
        return attrs.evolve(walk, phase="done", newest=result.commit), []
    # None: no key of the round holds a commit that verifies; the exchange reported each object
    # it passed there (``core.slots``), so only a rejection of the read itself is reported here.
    reports: list[Effect] = [_reject(result.round, result.rejected)] if result.rejected else []
    back = walk.back - 1
    if back < 0:
        return attrs.evolve(walk, phase="done", newest=walk.start), reports
    walk = attrs.evolve(walk, back=back)
    return walk, [*reports, ReadCommit(round=walk.chain[back].round)]


def _reject(r: int, reason: str) -> Rejected:
    return Rejected(key=keys.commit(r), reason=reason)


def links(
    algorithm: DiLoCo, commits: Sequence[Commit], committed: Callable[[int], bool]
) -> list[str]:
    """Every way ``commits`` break the chain (invariant 4): a record that is no link of its
    key's round (``continues``), a snapshot included on another base, or a base round with no
    commit (``committed`` says whether a round has one)."""
    problems = []
    for c in commits:
        problem = continues(algorithm, c.round, c)
        if problem is not None:
            problems.append(f"round {c.round}: {problem}")
        base = previous_round(algorithm, c.round)
        if base >= 0 and not committed(base):
            problems.append(f"round {c.round}: fragment chain broken, round {base} has no commit")
        for i in c.included:
            if i.base_round != base:
                problems.append(f"round {c.round}: included {i.node} is based on {i.base_round}")
    return problems
