"""Joining a run as one rule: create it or read it, admit this node, check its identity, and
find the newest commit of every fragment.

1. Read the manifest: the first of the manifest keys whose object verifies under this node's
   secret (any well-formed manifest for a node without one); objects that do not are passed
   (``core.slots``). When there is none, create the run: the initial parameters of every
   fragment first, then the create-only manifest naming them, at the next free manifest key,
   so a crash leaves no run or a whole one (Decision 4). A node that loses the race deletes its
   initial payloads and joins the winner's run. A passed object that is a well-formed manifest
   record stops a node with a secret from creating a run: it may be a run signed under another
   secret (this node's secret is wrong), which no node can tell from a forgery.
2. Admission: a run's signing is fixed when it is created, so a node without a secret cannot
   join a signed run, nor a node with one an unsigned run (``check_signing``). The model must
   match the run's schema (``check_schema`` names every parameter that differs) and the
   algorithm its configuration (``ConfigMismatch``).
3. Identity (Decision 9): joining under a learner id whose lease a live process renews is
   refused (``identity.conflict``: the lease read twice, ``lease_every * 1.5`` apart).
4. The newest commit of each fragment, by the chain walk (``chain``), and its parameters; a
   commit collected between the two reads is looked for again, a few times.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from gradientmail.core import keys, learner, polling
from gradientmail.core.algorithm import DiLoCo
from gradientmail.core.chain import Walk, begin
from gradientmail.core.effects import (
    CommitRead,
    Created,
    CreateManifest,
    Delete,
    Done,
    Effect,
    Fail,
    HeadRead,
    InitWritten,
    LeaseRead,
    ManifestRead,
    ParamsRead,
    ReadLease,
    ReadManifest,
    ReadParams,
    Rejected,
    Result,
    Wait,
    WriteInit,
)
from gradientmail.core.errors import ProtocolError, SchemaMismatch
from gradientmail.core.fragments import Partition, partition
from gradientmail.core.identity import IDENTITY_WAIT, conflict, derived
from gradientmail.core.learner import LearnerState
from gradientmail.core.polling import PollState
from gradientmail.core.records import Commit, Lease, Manifest, PayloadRef
from gradientmail.core.rules import RULES, Rules
from gradientmail.core.syncer import SyncerState
from gradientmail.core.tensors import Schema

__all__ = [
    "NEWEST_TRIES",
    "SECRET_ENV",
    "SECRET_FILE_ENV",
    "JoinState",
    "SecretSources",
    "Settings",
    "check_schema",
    "check_signing",
    "started",
    "step",
]

NEWEST_TRIES = 8
"""Times a joining node looks for a fragment's newest commit whose parameters keep being
collected under it before it gives up."""

SECRET_ENV = "GRADIENTMAIL_SECRET"
SECRET_FILE_ENV = "GRADIENTMAIL_SECRET_FILE"


@attrs.frozen(kw_only=True)
class SecretSources:
    """How a reader of a run is given its secret, for the errors that say what to set.

    ``reader`` names it ("this node", "audit"); ``how`` says how to give it a secret; ``origins``
    lists where a secret it holds came from. The defaults are ``Session``'s and ``align``'s."""

    reader: str = "this node"
    how: str = (
        f"set {SECRET_ENV} (or {SECRET_FILE_ENV}), or pass secret= or secret_file= to Session "
        "or align"
    )
    origins: str = f"secret=, secret_file=, {SECRET_ENV} or {SECRET_FILE_ENV}"


def check_signing(
    manifest: Manifest, signed: bool, *, sources: SecretSources = SecretSources()
) -> None:
    """Refuse, with what to set, a reader whose secret does not fit the run: none for a signed
    run (``signed`` False), or one for an unsigned run (a run's signing is fixed when it is
    created)."""
    if manifest.signed and not signed:
        raise ProtocolError(f"the run is signed and {sources.reader} has no secret: {sources.how}")
    if not manifest.signed and signed:
        raise ProtocolError(_unsigned(sources))


def _unsigned(sources: SecretSources) -> str:
    return (
        f"the run is not signed but {sources.reader} has a secret (from {sources.origins}): "
        "remove it; whether a run is signed is fixed by the node that creates it"
    )


def check_schema(run: Schema, ours: Schema) -> None:
    """Raise ``SchemaMismatch`` naming every parameter that differs in name, dtype or shape."""
    theirs, mine = {p.name: p for p in run.parameters}, {p.name: p for p in ours.parameters}
    differing = sorted(n for n in set(theirs) | set(mine) if theirs.get(n) != mine.get(n))
    if differing:
        raise SchemaMismatch(differing, "the model does not match the run's schema")


@attrs.frozen(kw_only=True)
class Settings:
    """What a joining node brings: its id and process nonce, its model's schema, its
    algorithm, a fragment mapping and whether its adapter serves row blocks (``split``; both
    used only when it creates the run: ``fragments.partition``), whether it holds a secret,
    and its lease interval (seconds).

    A reader (``align``, ``status``, ``gc``, ``audit``) joins nothing: ``algorithm`` None
    means it never creates the run nor checks its identity, ``schema`` None that it brings no
    model, and ``newest`` False that it loads no parameters. ``sources`` words its errors
    about secrets, ``where`` names the mailbox."""

    node: str
    process: str
    schema: Schema | None
    algorithm: DiLoCo | None
    mapping: Mapping[str, int] | None = None
    split: bool = False
    signed: bool = False
    lease_every: float = 50.0
    newest: bool = True
    sources: SecretSources = SecretSources()
    where: str = "the mailbox"
    rules: Rules = RULES


@attrs.frozen(kw_only=True)
class JoinState:
    """Where the join stands. Once ``phase`` is "done": the run's ``manifest``, whether this
    node ``created`` it, and each fragment's ``newest`` commit (None: the initial parameters),
    whose parameters the executor has read."""

    phase: str = "manifest"
    manifest: Manifest | None = None
    created: bool = False
    init: tuple[PayloadRef | None, ...] = ()
    first: Lease | None = None
    until: float | None = None
    fragment: int = 0
    walk: Walk | None = None
    tries: int = 0
    newest: tuple[Commit | None, ...] = ()

    @property
    def done(self) -> bool:
        return self.phase == "done"


def step(
    view: Sequence[Result], state: JoinState, *, now: float, settings: Settings
) -> tuple[JoinState, list[Effect], str]:
    """The join after ``view``: its next effects and why."""
    if state.phase == "manifest" and not view:
        return state, [ReadManifest(verify=settings.signed)], "reading the manifest"
    effects: list[Effect] = []
    for item in view:
        try:
            state, more = _take(state, item, now, settings)
        except (ProtocolError, SchemaMismatch) as exc:  # refused (ConfigMismatch included)
            return state, [Fail(error=exc)], str(exc)
        effects += more
    if state.phase == "identity-wait":
        assert state.until is not None
        if now < state.until:
            return state, [*effects, Wait(until=state.until, reason="identity")], "identity"
        state = attrs.evolve(state, phase="identity-again")
        effects.append(ReadLease(node=settings.node))
    if state.done:
        return state, [*effects, Done(reason="joined")], "joined"
    return state, effects, state.phase


def _take(
    state: JoinState, item: Result, now: float, settings: Settings
) -> tuple[JoinState, list[Effect]]:
    if isinstance(item, ManifestRead):
        return _manifest(state, item, settings)
    if isinstance(item, InitWritten):
        return _init(state, item, settings)
    if isinstance(item, Created):
        return _created(state, item, settings)
    if isinstance(item, LeaseRead):
        return _identity(state, item, now, settings)
    if isinstance(item, HeadRead | CommitRead):
        return _walked(state, item, settings)
    if isinstance(item, ParamsRead):
        return _params(state, item, settings)
    return state, []


def _manifest(
    state: JoinState, item: ManifestRead, settings: Settings
) -> tuple[JoinState, list[Effect]]:
    if state.phase not in ("manifest", "lost"):
        return state, []
    if item.manifest is not None:
        check_signing(item.manifest, settings.signed, sources=settings.sources)
        return _admit(state, item.manifest, settings)
    if item.rejected is not None:
        raise ProtocolError(item.rejected)
    if item.unverified:
        _, signed, reason = item.unverified[0]
        if not signed:
            raise ProtocolError(_unsigned(settings.sources))
        raise ProtocolError(
            f"the run's manifest does not verify with {settings.sources.reader}'s secret (a "
            f"wrong secret, or a forged manifest: delete a forgery to create the run): {reason}"
        )
    if state.phase == "lost":
        raise ProtocolError("the manifest vanished after a lost create")
    if settings.algorithm is None:
        raise ProtocolError(f"{settings.where} holds no run (no manifest)")
    return _create(state, settings)


def _create(state: JoinState, settings: Settings) -> tuple[JoinState, list[Effect]]:
    assert settings.schema is not None and settings.algorithm is not None
    groups = _partition(settings)
    writes: list[Effect] = [WriteInit(fragment=k, names=names) for k, names in enumerate(groups)]
    state = attrs.evolve(state, phase="create", init=(None,) * len(groups))
    return state, writes


def _partition(settings: Settings) -> Partition:
    assert settings.schema is not None and settings.algorithm is not None
    return partition(
        settings.schema, settings.algorithm.fragments, settings.mapping, split=settings.split
    )


def _init(
    state: JoinState, item: InitWritten, settings: Settings
) -> tuple[JoinState, list[Effect]]:
    init = list(state.init)
    init[item.fragment] = item.ref
    state = attrs.evolve(state, init=tuple(init))
    if any(ref is None for ref in init):
        return state, []
    refs = tuple(ref for ref in init if ref is not None)
    assert settings.schema is not None and settings.algorithm is not None
    ours = Manifest(
        nonce=derived(settings.process, "manifest"),
        creator=settings.node,
        schema=settings.schema,
        algorithm=settings.algorithm,
        fragments=_partition(settings),
        init=refs,
        signed=settings.signed,
    )
    return attrs.evolve(state, phase="creating", manifest=ours), [CreateManifest(manifest=ours)]


def _created(state: JoinState, item: Created, settings: Settings) -> tuple[JoinState, list[Effect]]:
    ours = state.manifest
    if state.phase != "creating" or ours is None:
        return state, []
    if item.outcome == "created" or (item.outcome == "ambiguous" and item.nonce == ours.nonce):
        return _identify(attrs.evolve(state, created=True), ours, settings)
    # Another node created the run first: our initial payloads go, and we join theirs.
    doomed = tuple(ref.key for ref in state.init if ref is not None)
    state = attrs.evolve(state, phase="lost", manifest=None)
    return state, [Delete(keys=doomed), ReadManifest(verify=settings.signed)]


def _admit(
    state: JoinState, manifest: Manifest, settings: Settings
) -> tuple[JoinState, list[Effect]]:
    if settings.schema is not None:
        check_schema(manifest.schema, settings.schema)
    if settings.algorithm is not None:
        settings.algorithm.require_same(manifest.algorithm)
    return _identify(state, manifest, settings)


def _identify(
    state: JoinState, manifest: Manifest, settings: Settings
) -> tuple[JoinState, list[Effect]]:
    state = attrs.evolve(state, phase="identity", manifest=manifest)
    if settings.algorithm is None:  # a reader: no lease of its own to check
        return _newest(state, settings)
    return state, [ReadLease(node=settings.node)]


def _identity(
    state: JoinState, item: LeaseRead, now: float, settings: Settings
) -> tuple[JoinState, list[Effect]]:
    # A lease that does not verify (garbage, a forgery, or signed under a retired secret) is
    # reported and counts as absent: no live process of this run wrote it, and this node's
    # first renewal overwrites it.
    reports: list[Effect] = []
    if item.rejected is not None:
        reports.append(Rejected(key=keys.lease(settings.node), reason=item.rejected))
    lease = item.lease if item.rejected is None else None
    if state.phase == "identity":
        if lease is None or lease.left:
            state, effects = _newest(state, settings)
            return state, reports + effects
        until = now + settings.lease_every * IDENTITY_WAIT
        return attrs.evolve(state, phase="identity-wait", first=lease, until=until), reports
    problem = conflict(settings.node, state.first, lease)
    if problem is not None:
        raise ProtocolError(problem)
    state, effects = _newest(state, settings)
    return state, reports + effects


def _newest(state: JoinState, settings: Settings) -> tuple[JoinState, list[Effect]]:
    """Look for fragment ``state.fragment``'s newest commit (the chain walk)."""
    assert state.manifest is not None
    algorithm = state.manifest.algorithm
    if not settings.newest or state.fragment >= algorithm.fragments:
        return attrs.evolve(state, phase="done"), []
    walk, effects = begin(algorithm, state.fragment, signed=state.manifest.signed)
    return attrs.evolve(state, phase="newest", walk=walk), effects


def _walked(
    state: JoinState, item: HeadRead | CommitRead, settings: Settings
) -> tuple[JoinState, list[Effect]]:
    if state.walk is None:
        return state, []
    walk, effects = settings.rules.walk(state.walk, item)
    if not walk.done:
        return attrs.evolve(state, walk=walk), effects
    k = state.fragment
    state = attrs.evolve(state, walk=walk, phase="params")
    return state, [*effects, ReadParams(fragment=k, commit=walk.newest)]


def _params(
    state: JoinState, item: ParamsRead, settings: Settings
) -> tuple[JoinState, list[Effect]]:
    if state.phase != "params" or item.fragment != state.fragment:
        return state, []
    if item.rejected is not None:
        raise ProtocolError(f"fragment {item.fragment}: {item.rejected}")
    if not item.present:
        # Collected between the walk and the read: look again, a few times.
        if state.tries + 1 >= NEWEST_TRIES:
            raise ProtocolError(
                f"fragment {item.fragment}: its newest parameters keep disappearing"
            )
        state = attrs.evolve(state, tries=state.tries + 1)
        return _newest(state, settings)
    newest = (*state.newest, item.commit)
    state = attrs.evolve(state, newest=newest, fragment=state.fragment + 1, tries=0, walk=None)
    return _newest(state, settings)


def started(state: JoinState, *, process: str) -> tuple[LearnerState, PollState, SyncerState]:
    """The first states of a joined node's training side, learner loop and syncer loop: each
    fragment holds its newest commit, the learner polls the next one, the syncer knows the
    commits read (and the peers they included)."""
    assert state.done and state.manifest is not None
    merged = tuple(c.round if c is not None else -1 for c in state.newest)
    known = tuple(sorted((c.round, c) for c in state.newest if c is not None))
    return (
        learner.join(state.manifest.algorithm, merged, process=process),
        polling.start(state.manifest, merged),
        SyncerState(commits=known, peers=frozenset(i.node for _, c in known for i in c.included)),
    )
