"""The learner loop as one rule: upload what the training thread captured, and fetch each
fragment's next commit for the training thread to merge.

Uploads. Each capture (``Captured``, from the training thread) is uploaded in order; whether the
key then holds this node's snapshot is ``identity.ours``. Either way the syncer watches the
round (``Watch``); a snapshot that lost its key to another incarnation has missed its round,
and the commit that does not count it makes the training thread rebase (``learner.on_commit``).

Commits (Decision 8). The next commit of each fragment is polled with one GET per poll
interval while this node has a snapshot in that round, and once every ``IDLE_POLLS`` poll
intervals otherwise (it can only be committed without this node: the node is late). While
the training thread waits for a commit (``Hurry``: held at the overlap bound, or closing) it is
polled at once and then ``HURRY_POLLS`` times per interval: the node's accelerators idle
meanwhile, which costs far more than a few GETs. A commit
this node's syncer wrote, or that a poll found, is taken at once, and a node that finds one in
the store reads on to the next without waiting (catching up). A commit is used only when it
is a link of its fragment's chain (``chain.continues``); its parameters are read and
verified, then delivered with every ``(node, nonce)`` it counted. A commit whose parameters
were collected before this node read them (it fell ``keep`` rounds behind) re-aligns the
node: the chain walk finds the fragment's newest commit, which is delivered with what both
commits counted (commit records are never collected), so a snapshot the skipped commit
counted is not rebased (``rules.counted``); every skipped round is committed, and ``Seen``
tells the syncer so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs

from gradientmail.core import keys
from gradientmail.core.chain import Walk, begin, continues
from gradientmail.core.effects import (
    HURRY_POLLS,
    Captured,
    CommitRead,
    Committed,
    Deliver,
    Done,
    Effect,
    Fail,
    HeadRead,
    Hurry,
    Missed,
    ParamsRead,
    PollCommit,
    ReadParams,
    Rejected,
    Result,
    Seen,
    Stop,
    Upload,
    Uploaded,
    Wait,
    Watch,
)
from gradientmail.core.errors import ProtocolError
from gradientmail.core.records import Commit, Manifest
from gradientmail.core.rules import RULES, Rules

__all__ = ["HURRY_POLLS", "IDLE_POLLS", "Fetch", "PollState", "Settings", "start", "step"]

IDLE_POLLS = 10
"""Poll intervals between GETs of a fragment's next commit while this node has no snapshot in
that round: the commit can then exist only if the round closed without this node, which the
node learns at the latest ``IDLE_POLLS`` polls later (and at its next snapshot's poll)."""


@attrs.frozen(kw_only=True)
class Settings:
    """A learner loop's node, run and poll interval (seconds)."""

    node: str
    manifest: Manifest
    poll_interval: float
    rules: Rules = RULES
    idle_polls: int = IDLE_POLLS  # poll intervals between GETs of a commit not expected yet
    hurry_polls: int = HURRY_POLLS  # GETs per poll interval of a commit the training awaits


@attrs.frozen(kw_only=True)
class Fetch:
    """A commit of a fragment being fetched: the record, what it (and any commit skipped to
    reach it) counted, whether a poll found it in the store, and a re-alignment under way
    (``walk``, then ``newest``: the commit it found)."""

    commit: Commit
    counted: frozenset[tuple[str, str]]
    from_store: bool
    walk: Walk | None = None
    newest: Commit | None = None


@attrs.frozen(kw_only=True)
class PollState:
    """Per fragment: the next commit round expected, when to GET it next (node's clock), and
    the fetch under way; the commits this node's syncer handed over; the captures being
    uploaded, as ``(round, nonce)``; the rounds uploaded and not yet delivered
    (``published``); the rounds the training thread waits for (``hurried``, until delivered);
    whether the loop is stopping."""

    next: tuple[int, ...]
    due: tuple[float, ...]
    fetches: tuple[Fetch | None, ...]
    known: tuple[tuple[int, Commit], ...] = ()
    uploading: tuple[tuple[int, str], ...] = ()
    published: tuple[int, ...] = ()
    hurried: tuple[int, ...] = ()
    stopping: bool = False


def start(manifest: Manifest, merged: Sequence[int]) -> PollState:
    """The loop of a node that holds commit ``merged[k]`` of each fragment (-1: initial)."""
    K = manifest.algorithm.fragments
    return PollState(
        next=tuple(k if r < 0 else r + K for k, r in enumerate(merged)),
        due=(-math.inf,) * K,
        fetches=(None,) * K,
    )


def step(
    view: Sequence[Result], state: PollState, *, now: float, settings: Settings
) -> tuple[PollState, list[Effect], str]:
    """The loop after ``view``: uploads to make, commits to poll, read and deliver, and why."""
    effects: list[Effect] = []
    for item in view:
        state, more = _take(state, item, now, settings)
        effects += more
    K = settings.manifest.algorithm.fragments
    for k in range(K):
        state, more = _poll(state, k, now, settings)
        effects += more
    if any(isinstance(e, Fail) for e in effects):
        return state, effects, "failed"
    if state.stopping and not state.uploading:
        return state, [*effects, Done(reason="stopped")], "stopped"
    waiting = [state.due[k] for k in range(K) if _idle(state, k)]
    until = min(waiting, default=math.inf)
    reason = f"next commits {list(state.next)}"
    return state, [*effects, Wait(until=until, reason=reason)], reason


def _idle(state: PollState, k: int) -> bool:
    return state.fetches[k] is None and state.next[k] not in dict(state.known)


def _take(
    state: PollState, item: Result, now: float, settings: Settings
) -> tuple[PollState, list[Effect]]:
    if isinstance(item, Captured):
        uploading = (*state.uploading, (item.round, item.nonce))
        return attrs.evolve(state, uploading=uploading), [
            Upload(round=item.round, nonce=item.nonce)
        ]
    if isinstance(item, Uploaded):
        return _uploaded(state, item, now, settings)
    if isinstance(item, Committed):
        known = dict(state.known)
        known[item.commit.round] = item.commit
        return attrs.evolve(state, known=tuple(sorted(known.items()))), []
    if isinstance(item, Stop):
        return attrs.evolve(state, stopping=True), []
    if isinstance(item, Hurry):
        return _hurry(state, item.round, now), []
    if isinstance(item, CommitRead | HeadRead | ParamsRead):
        k = (item.fragment if not isinstance(item, CommitRead) else item.round) % len(state.next)
        return _fetched(state, k, item, now, settings)
    return state, []


def _hurry(state: PollState, r: int, now: float) -> PollState:
    """The training thread waits for round ``r``'s commit: poll it at once (a poll may be most
    of an interval away), then ``hurry_polls`` times per interval until it is delivered."""
    k = r % len(state.next)
    if r < state.next[k] or r in state.hurried:
        return state  # delivered already, or hurried already
    state = attrs.evolve(state, hurried=tuple(sorted({*state.hurried, r})))
    return _set(state, k, due=min(state.due[k], now))


def _uploaded(
    state: PollState, item: Uploaded, now: float, settings: Settings
) -> tuple[PollState, list[Effect]]:
    nonce = dict(state.uploading).get(item.round)
    if nonce is None:
        return state, []
    uploading = tuple((r, n) for r, n in state.uploading if r != item.round)
    published = tuple(sorted({*state.published, item.round}))
    state = attrs.evolve(state, uploading=uploading, published=published)
    # Its commit is now expected: polled every interval from the next one on.
    k = item.round % len(state.next)
    if state.due[k] > now + settings.poll_interval:
        state = _set(state, k, due=now + settings.poll_interval)
    ours = settings.rules.ours(item.created, nonce)
    # Either way the syncer watches the round: a snapshot that lost its key to another
    # incarnation has missed the round, which its commit will show.
    effects: list[Effect] = [Watch(round=item.round, ours=ours)]
    if not ours:
        effects.append(Missed(round=item.round))
    return state, effects


def _poll(
    state: PollState, k: int, now: float, settings: Settings
) -> tuple[PollState, list[Effect]]:
    """Fragment ``k``'s next commit: taken at once when known, else GET once per interval
    while this node has a snapshot in that round or a later one of the fragment, once per
    ``IDLE_POLLS`` intervals otherwise (a bell that wakes the loop sooner adds no GET; the
    slack keeps a timer that fires a hair early on time)."""
    if state.fetches[k] is not None:
        return state, []
    r = state.next[k]
    known = dict(state.known).get(r)
    if known is not None:
        fetch = Fetch(commit=known, counted=_counted(known), from_store=False)
        return _set(state, k, fetches=fetch), [ReadParams(fragment=k, commit=known)]
    if now < state.due[k] - settings.poll_interval / 100:
        return state, []
    K = len(state.next)
    expected = any(p >= r and p % K == k for p in state.published)
    interval = settings.poll_interval * (1 if expected else settings.idle_polls)
    if any(h >= r and h % K == k for h in state.hurried):
        interval = settings.poll_interval / settings.hurry_polls
    return _set(state, k, due=now + interval), [PollCommit(round=r)]


def _counted(commit: Commit) -> frozenset[tuple[str, str]]:
    return frozenset((i.node, i.nonce) for i in commit.included)


def _set(state: PollState, k: int, **changes: Any) -> PollState:
    updated: dict[str, Any] = {}
    for name, value in changes.items():
        values = list(getattr(state, name))
        values[k] = value
        updated[name] = tuple(values)
    return attrs.evolve(state, **updated)


def _fetched(
    state: PollState,
    k: int,
    item: CommitRead | HeadRead | ParamsRead,
    now: float,
    settings: Settings,
) -> tuple[PollState, list[Effect]]:
    fetch = state.fetches[k]
    if fetch is not None and fetch.walk is not None and not isinstance(item, ParamsRead):
        return _walked(state, k, fetch, item, settings)
    if isinstance(item, CommitRead):
        return _polled(state, k, item, settings)
    if isinstance(item, ParamsRead) and fetch is not None:
        return _params(state, k, fetch, item, now, settings)
    return state, []


def _polled(
    state: PollState, k: int, item: CommitRead, settings: Settings
) -> tuple[PollState, list[Effect]]:
    """A poll's GET of the next commit: absent, rejected (reported, polled again later; never
    merged, never fatal), or a link of the chain whose parameters are read next."""
    r, commit = item.round, item.commit
    if item.rejected is not None:
        return state, [Rejected(key=keys.commit(r), reason=item.rejected)]
    if commit is None:
        return state, []
    problem = continues(settings.manifest.algorithm, r, commit)
    if problem is not None:
        return state, [Rejected(key=keys.commit(r), reason=problem)]
    fetch = Fetch(commit=commit, counted=_counted(commit), from_store=True)
    return _set(state, k, fetches=fetch), [ReadParams(fragment=k, commit=commit)]


def _params(
    state: PollState, k: int, fetch: Fetch, item: ParamsRead, now: float, settings: Settings
) -> tuple[PollState, list[Effect]]:
    target = fetch.newest or fetch.commit
    if item.commit != target:
        return state, []
    if item.rejected is not None:
        # A corrupt payload: reported, and the commit is polled again from the store later.
        known = tuple((r, c) for r, c in state.known if r != fetch.commit.round)
        state = attrs.evolve(state, known=known)
        state = _set(state, k, fetches=None, due=now + settings.poll_interval)
        assert target is not None
        return state, [Rejected(key=target.params.key, reason=item.rejected)]
    if item.present:
        return _deliver(state, k, fetch, target, settings)
    if fetch.newest is not None:
        return _set(state, k, fetches=None), []  # collected again: from the hint at the next poll
    # Collected before this node read it: it is far behind. Re-align to the newest commit.
    walk, effects = begin(settings.manifest.algorithm, k, signed=settings.manifest.signed)
    return _set(state, k, fetches=attrs.evolve(fetch, walk=walk)), effects


def _walked(
    state: PollState,
    k: int,
    fetch: Fetch,
    item: CommitRead | HeadRead,
    settings: Settings,
) -> tuple[PollState, list[Effect]]:
    assert fetch.walk is not None
    walk, effects = settings.rules.walk(fetch.walk, item)
    if not walk.done:
        return _set(state, k, fetches=attrs.evolve(fetch, walk=walk)), effects
    newest, r = walk.newest, fetch.commit.round
    if newest is None or newest.round <= r:
        error = ProtocolError(f"params of round {r} are gone and no newer commit exists")
        return state, [*effects, Fail(error=error)]
    counted = settings.rules.counted(fetch.counted, fetch.commit, newest)
    fetch = attrs.evolve(fetch, walk=None, newest=newest, counted=counted)
    return _set(state, k, fetches=fetch), [*effects, ReadParams(fragment=k, commit=newest)]


def _deliver(
    state: PollState, k: int, fetch: Fetch, commit: Commit, settings: Settings
) -> tuple[PollState, list[Effect]]:
    K = settings.manifest.algorithm.fragments
    known = tuple((r, c) for r, c in state.known if r > commit.round or r % K != k)
    published = tuple(p for p in state.published if p > commit.round or p % K != k)
    hurried = tuple(h for h in state.hurried if h > commit.round or h % K != k)
    state = attrs.evolve(state, known=known, published=published, hurried=hurried)
    state = _set(state, k, fetches=None, next=commit.round + K)
    if fetch.from_store:
        state = _set(state, k, due=-math.inf)  # found in the store: a node catching up reads on
    return state, [Deliver(commit=commit, counted=fetch.counted), Seen(commit=commit)]
