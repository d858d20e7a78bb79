"""Every effect a core rule returns, every result the shell hands back, as frozen records.

A node's loops are executors: each gathers a view (the results of the effects it carried out
last, and the messages its other loops sent), calls its rule with ``now``, carries out the
effects the rule returns, and sleeps until the earliest ``Wait.until`` or a bell. The rules
never do I/O; the effects say exactly what to do, so the shell (``gradientmail._node``) and the
explorer's world (``specs/``) execute the same decisions.

Three groups, by the loop that executes them:

============================  ===============================================================
training thread               ``Publish`` (capture a fragment), ``Merge``, ``Rebased``
learner loop                  ``Upload``, ``PollCommit``, ``ReadParams``, ``Deliver``,
                              ``Watch``/``Seen`` (to the syncer), ``ReadHead``/``ReadCommit``
                              (the chain walk)
syncer loop                   ``RenewLease``, ``ListLeases``, ``ReadLease``, ``ListSnapshots``,
                              ``ListClaims``, ``CreateClaim``, ``ReadClaim``, ``ReadSnapshot``,
                              ``Accumulate``, ``ReadOuterState``, ``OuterStep``, ``CreateCommit``,
                              ``Committed`` (to the learner), ``PutHead``, ``ListRound``,
                              ``Delete``, ``Forget``, ``Drop``
join                          ``ReadManifest``, ``WriteInit``, ``CreateManifest``, ``ReadLease``,
                              the chain walk, ``ReadParams``
every loop                    ``Wait``, ``Done``, ``Fail``, and reports (``Excluded``,
                              ``Clipped``, ``Claimed``, ``Expired``, ``Rejected``, ``Missed``)
============================  ===============================================================

Results carry what the executor read or what became of a write; ``Created`` reports a create
on a record's key, which ``core.identity.ours`` judges (Decision 9).
"""

from __future__ import annotations

from typing import Literal

import attrs

from gradientmail.core.records import Claim, Commit, Lease, Manifest, PayloadRef, Snapshot

__all__ = [
    "HURRY_POLLS",
    "Accumulate",
    "Accumulated",
    "BaseRead",
    "Captured",
    "ClaimRead",
    "Claimed",
    "ClaimsRead",
    "Clipped",
    "Close",
    "CommitRead",
    "Committed",
    "Create",
    "CreateClaim",
    "CreateCommit",
    "CreateManifest",
    "Created",
    "Delete",
    "Deliver",
    "Done",
    "Drop",
    "Effect",
    "Excluded",
    "Expired",
    "Fail",
    "Forget",
    "Gather",
    "HeadRead",
    "Hurry",
    "InitWritten",
    "LeaseRead",
    "LeasesListed",
    "Leave",
    "ListClaims",
    "ListLeases",
    "ListRound",
    "ListSnapshots",
    "ManifestRead",
    "Merge",
    "Missed",
    "OuterStep",
    "ParamsRead",
    "PollCommit",
    "Publish",
    "PutHead",
    "ReadClaim",
    "ReadCommit",
    "ReadHead",
    "ReadLease",
    "ReadManifest",
    "ReadOuterState",
    "ReadParams",
    "ReadSnapshot",
    "Rebased",
    "Rejected",
    "RenewLease",
    "Result",
    "RoundListed",
    "Seen",
    "SnapshotRead",
    "SnapshotsListed",
    "Stop",
    "Upload",
    "Uploaded",
    "Wait",
    "Watch",
    "WriteInit",
    "Written",
]


# -- every loop ----------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Wait:
    """Nothing to do before ``until`` (seconds on the node's clock; None: until a message or a
    result arrives). A loop sleeps until the earliest ``until`` of a step, or a bell."""

    until: float | None
    reason: str


@attrs.frozen(kw_only=True)
class Done:
    """The loop has finished (its node is leaving and everything it owed is done)."""

    reason: str


@attrs.frozen(kw_only=True)
class Fail:
    """The loop cannot go on: ``error`` (a ``ProtocolError`` or one of its kind) ends it, and
    ``step`` raises it on the training thread."""

    error: Exception = attrs.field(eq=False)


@attrs.frozen(kw_only=True)
class Excluded:
    """Report: the snapshot of ``node`` at its snapshot key ``slot`` was left out of round
    ``round``'s commit."""

    round: int
    node: str
    reason: str
    slot: int = 0


@attrs.frozen(kw_only=True)
class Clipped:
    """Report: ``node``'s delta in round ``round`` (read at its snapshot key ``slot``) was
    scaled by ``factor`` (< 1)."""

    round: int
    node: str
    factor: float
    slot: int = 0


@attrs.frozen(kw_only=True)
class Claimed:
    """Report: this node closes attempt ``attempt`` of ``round`` (a takeover when > 0)."""

    round: int
    attempt: int


@attrs.frozen(kw_only=True)
class Expired:
    """Report: this node saw ``node``'s lease unchanged for the lease timeout."""

    node: str


@attrs.frozen(kw_only=True)
class Rejected:
    """Report: the object at ``key`` is not used, for ``reason``."""

    key: str
    reason: str


@attrs.frozen(kw_only=True)
class Missed:
    """Report: another incarnation's snapshot holds this node's key of ``round``."""

    round: int


# -- the training thread -------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Publish:
    """Capture fragment ``fragment``'s parameters now; the learner loop uploads ``base -
    captured`` as the snapshot of ``round`` (the fragment's ``nonce`` in the learner state
    marks it as this process's)."""

    fragment: int
    round: int
    base_round: int
    samples: int
    steps: int


@attrs.frozen(kw_only=True)
class Captured:
    """Message to the learner loop: the snapshot of ``round`` (``nonce``) is captured."""

    round: int
    nonce: str


@attrs.frozen(kw_only=True)
class Hurry:
    """Message to the learner loop: the training thread waits for the commit of ``round``
    (``step`` held at the overlap bound, or ``close``): poll it more often until it comes. Sent
    to both loops: the learner polls the commit, the syncer reads the round's view (when it
    reads it at every poll), ``HURRY_POLLS`` times per interval."""

    round: int


HURRY_POLLS = 4
"""Reads per poll interval of what a waiting training thread needs (``Hurry``): the commit's
GET, and the round's view where this node would close it. A commit that lands while the node
is held is merged a quarter of an interval later at most, not a whole one."""


@attrs.frozen(kw_only=True)
class Merge:
    """Fold the commit of ``round`` into the model.

    ``since``: "snapshot" keeps the progress made after this node's own snapshot (the commit
    counted it); "base" keeps all progress since the previous commit (nothing of it was
    counted). With ``alpha`` the commit is mixed in instead, ``alpha * live + (1 - alpha) *
    commit`` (``since`` then only says which it was). The next delta's base is the commit in
    every case."""

    fragment: int
    round: int
    since: Literal["snapshot", "base"]
    alpha: float | None


@attrs.frozen(kw_only=True)
class Rebased:
    """This node's snapshot of ``missed`` was not counted: its progress moves to the
    fragment's next round, and its error-feedback residual is dropped (Decision 5)."""

    fragment: int
    missed: int
    samples: int


# -- the learner loop ----------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Upload:
    """Encode, compress and create the captured snapshot of ``round`` (``nonce``)."""

    round: int
    nonce: str


@attrs.frozen(kw_only=True)
class PollCommit:
    """GET the commit record of ``round``."""

    round: int


@attrs.frozen(kw_only=True)
class ReadCommit:
    """GET the commit record of ``round``, its signature checked when ``verify``."""

    round: int
    verify: bool = True


@attrs.frozen(kw_only=True)
class ReadHead:
    """GET the advisory ``heads/`` hint of ``fragment``."""

    fragment: int


@attrs.frozen(kw_only=True)
class ReadParams:
    """Load and verify the parameters ``commit`` names (the initial ones when ``commit`` is
    None, for ``fragment``)."""

    fragment: int
    commit: Commit | None


@attrs.frozen(kw_only=True)
class Deliver:
    """Hand the commit of ``round`` and the parameters read for it to the training thread;
    ``counted`` holds every ``(node, nonce)`` it, or a commit skipped to reach it, counted."""

    commit: Commit
    counted: frozenset[tuple[str, str]]


@attrs.frozen(kw_only=True)
class Watch:
    """To the syncer: this node has a snapshot in ``round`` (``ours``: the key holds ours)."""

    round: int
    ours: bool


@attrs.frozen(kw_only=True)
class Seen:
    """To the syncer: ``commit`` exists; every earlier round of its fragment is committed."""

    commit: Commit


# -- the syncer loop -----------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class RenewLease:
    """Put ``lease`` (overwriting this node's previous one)."""

    lease: Lease


@attrs.frozen(kw_only=True)
class ListLeases:
    """LIST ``leases/``: versions and sizes."""


@attrs.frozen(kw_only=True)
class ReadLease:
    """GET the lease of ``node``."""

    node: str


@attrs.frozen(kw_only=True)
class ListSnapshots:
    """LIST round ``round``'s snapshots: nodes and sizes."""

    round: int


@attrs.frozen(kw_only=True)
class ListClaims:
    """LIST round ``round``'s claims and read each (the invalid ones are reported)."""

    round: int


@attrs.frozen(kw_only=True)
class CreateClaim:
    """Create ``claim``'s key."""

    claim: Claim


@attrs.frozen(kw_only=True)
class ReadClaim:
    """GET the claim of ``attempt`` of ``round`` (None when absent or invalid)."""

    round: int
    attempt: int


@attrs.frozen(kw_only=True)
class ReadSnapshot:
    """GET and verify the snapshot at ``node``'s snapshot key ``slot`` of ``round``; its
    payload waits in the round's workspace for the ``Accumulate`` that follows (the next read
    drops one not summed). ``ahead``: the (node, slot) keys the close reads next, which may be
    fetched together with this one and kept until they are read (``closing.READ_AHEAD``);
    kept ones this read does not name are dropped."""

    round: int
    node: str
    slot: int = 0
    ahead: tuple[tuple[str, int], ...] = ()


@attrs.frozen(kw_only=True)
class Accumulate:
    """Decode the payload of ``node``'s snapshot of ``round`` read last and add ``weight``
    times the delta to the round's F32 sum (``start``: the sum begins with it, dropping any
    earlier one), then drop the delta; with ``norm``, report its L2 norm. The close holds one
    delta at a time, however many snapshots the round has."""

    round: int
    node: str
    weight: float
    start: bool
    norm: bool


@attrs.frozen(kw_only=True)
class ReadOuterState:
    """Load the F32 master parameters and momentum the outer step of ``round`` starts from:
    those ``base`` (the fragment's previous commit) left, or the initial parameters of
    ``fragment`` when ``base`` is None."""

    round: int
    fragment: int
    base: Commit | None


@attrs.frozen(kw_only=True)
class OuterStep:
    """``gradient = scale * sum`` (the round's accumulated sum), one outer step from the loaded
    state, then write the round's ``params`` and ``state`` payloads."""

    round: int
    fragment: int
    scale: float


@attrs.frozen(kw_only=True)
class CreateCommit:
    """Create the round's commit record (create-only: a round commits once)."""

    commit: Commit


@attrs.frozen(kw_only=True)
class Committed:
    """To the learner and the reports: this node committed ``commit`` (``seconds`` since its
    claim, on its clock); the parameters the outer step wrote go along."""

    commit: Commit
    seconds: float


@attrs.frozen(kw_only=True)
class PutHead:
    """Overwrite the advisory ``heads/`` hint of ``fragment`` with ``round``."""

    fragment: int
    round: int


@attrs.frozen(kw_only=True)
class ListRound:
    """LIST every key of ``round`` (for garbage collection)."""

    round: int


@attrs.frozen(kw_only=True)
class Delete:
    """Delete ``keys`` (a missing key is not an error)."""

    keys: tuple[str, ...]


@attrs.frozen(kw_only=True)
class Forget:
    """Stop remembering the payloads at ``keys`` that this node wrote (superseded)."""

    keys: tuple[str, ...]


@attrs.frozen(kw_only=True)
class Drop:
    """Free round ``round``'s workspace (decoded deltas, the loaded outer state)."""

    round: int


# -- join ----------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ReadManifest:
    """GET the manifest, its signature checked when ``verify``."""

    verify: bool


@attrs.frozen(kw_only=True)
class WriteInit:
    """Write fragment ``fragment``'s initial parameters (``names``) from the model."""

    fragment: int
    names: tuple[str, ...]


@attrs.frozen(kw_only=True)
class CreateManifest:
    """Create the manifest (create-only: a run is created once)."""

    manifest: Manifest


Create = CreateClaim | CreateCommit | CreateManifest

Effect = (
    Wait
    | Done
    | Fail
    | Excluded
    | Clipped
    | Claimed
    | Expired
    | Rejected
    | Missed
    | Publish
    | Merge
    | Rebased
    | Upload
    | PollCommit
    | ReadCommit
    | ReadHead
    | ReadParams
    | Deliver
    | Watch
    | Seen
    | RenewLease
    | ListLeases
    | ReadLease
    | ListSnapshots
    | ListClaims
    | CreateClaim
    | ReadClaim
    | ReadSnapshot
    | Accumulate
    | ReadOuterState
    | OuterStep
    | CreateCommit
    | Committed
    | PutHead
    | ListRound
    | Delete
    | Forget
    | Drop
    | ReadManifest
    | WriteInit
    | CreateManifest
)


# -- results and messages ------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Created:
    """What became of a create on ``key``: ``created``, ``taken`` (by another object), or
    ``ambiguous`` (a transient failure, then the key found taken: maybe by our own first try),
    with the ``nonce`` of the record found there when it was read back (None: not read or
    unreadable)."""

    key: str
    outcome: Literal["created", "taken", "ambiguous"]
    nonce: str | None = None


@attrs.frozen(kw_only=True)
class Uploaded:
    """The create of this node's snapshot of ``round``: ``created`` as in ``Created``."""

    round: int
    created: Created


@attrs.frozen(kw_only=True)
class CommitRead:
    """The commit record of ``round``: the record, None when absent, or ``rejected`` (why it
    is not used: corrupt, unsigned, forged, replayed)."""

    round: int
    commit: Commit | None
    rejected: str | None = None


@attrs.frozen(kw_only=True)
class HeadRead:
    """The ``heads/`` hint of ``fragment`` (None: absent or unreadable)."""

    fragment: int
    round: int | None


@attrs.frozen(kw_only=True)
class ParamsRead:
    """The parameters of ``commit`` (of ``fragment``; None: the initial ones): ``present``,
    gone (collected), or ``rejected`` (corrupt)."""

    fragment: int
    commit: Commit | None
    present: bool
    rejected: str | None = None


@attrs.frozen(kw_only=True)
class LeasesListed:
    """One LIST of ``leases/``: ``(node, version, size, md5)`` for every lease key of ours
    (``md5``: of its bytes, where the store lists it; else None)."""

    entries: tuple[tuple[str, str, int, str | None], ...]


@attrs.frozen(kw_only=True)
class LeaseRead:
    """The lease of ``node``: the record, None when absent, or ``rejected``."""

    node: str
    lease: Lease | None
    rejected: str | None = None


@attrs.frozen(kw_only=True)
class SnapshotsListed:
    """One LIST of round ``round``'s snapshots: ``(node, slot, size)`` of each snapshot key
    (``core.slots``), sorted by node and slot."""

    round: int
    sizes: tuple[tuple[str, int, int], ...]


@attrs.frozen(kw_only=True)
class ClaimsRead:
    """The valid claims of round ``round``."""

    round: int
    claims: tuple[Claim, ...]


@attrs.frozen(kw_only=True)
class ClaimRead:
    """The claim at ``attempt`` of ``round``: valid, or None (absent or invalid)."""

    round: int
    attempt: int
    claim: Claim | None


@attrs.frozen(kw_only=True)
class SnapshotRead:
    """The snapshot at ``node``'s snapshot key ``slot`` of ``round``: its record (the payload
    waiting to be summed), None when gone, or ``rejected`` (why it is not used)."""

    round: int
    node: str
    record: Snapshot | None
    rejected: str | None = None
    slot: int = 0


@attrs.frozen(kw_only=True)
class Accumulated:
    """``node``'s delta of ``round`` is in the sum, with its L2 ``norm`` when asked; or
    ``rejected`` (its payload does not decode: the sum is as before)."""

    round: int
    node: str
    norm: float | None = None
    rejected: str | None = None


@attrs.frozen(kw_only=True)
class BaseRead:
    """The outer state of ``round``'s step: loaded, gone, or ``rejected``."""

    round: int
    present: bool
    rejected: str | None = None


@attrs.frozen(kw_only=True)
class Written:
    """The round's payloads, written under ``nonce`` (None refs: ``failed`` says why)."""

    round: int
    nonce: str
    params: PayloadRef | None
    state: PayloadRef | None
    failed: str | None = None


@attrs.frozen(kw_only=True)
class RoundListed:
    round: int
    keys: tuple[str, ...]


@attrs.frozen(kw_only=True)
class ManifestRead:
    """The run's manifest as a walk of the manifest keys found it (``core.slots``), or
    ``rejected`` (why no manifest can be read). ``unverified``: ``(key, signed, reason)`` of
    each passed key that holds a well-formed manifest record that does not verify (a forgery,
    or a run signed under another secret), ``signed`` as that record says."""

    manifest: Manifest | None
    rejected: str | None = None
    unverified: tuple[tuple[str, bool, str], ...] = ()


@attrs.frozen(kw_only=True)
class InitWritten:
    fragment: int
    ref: PayloadRef


@attrs.frozen(kw_only=True)
class Gather:
    """Message to the syncer: the node waits to see ``count`` of the run's nodes before it
    trains (list the leases every ``poll_interval`` while its view holds fewer, then at the
    quick cadence until it publishes)."""

    count: int = 0


@attrs.frozen(kw_only=True)
class Leave:
    """From the learner to the syncer: the node is closing and has published everything it
    trained (``learner.close``, Decision 11). Mark the lease ``left`` once each of this node's
    snapshots of the rounds in ``after`` is uploaded under its key (``Watch`` with ``ours``) or
    counted by a commit. A closer that sees a node left and lists the round's snapshots after
    that LIST finds the node's last snapshot there: a ``left`` lease written before the upload
    let a round close without it, and its progress went into a round of its own. A later
    ``Leave`` names the round a missed snapshot's progress was published to instead (Decision
    5): ``replaces`` the missed one."""

    after: tuple[int, ...] = ()
    replaces: tuple[int, ...] = ()


@attrs.frozen(kw_only=True)
class Stop:
    """Message: stop the loop once what it owes is done."""


@attrs.frozen(kw_only=True)
class Close:
    """Message to the learner loop: captures will come no more once the queue is empty."""


Result = (
    Created
    | Uploaded
    | CommitRead
    | HeadRead
    | ParamsRead
    | LeasesListed
    | LeaseRead
    | SnapshotsListed
    | ClaimsRead
    | ClaimRead
    | SnapshotRead
    | Accumulated
    | BaseRead
    | Written
    | RoundListed
    | ManifestRead
    | InitWritten
    | Gather
    | Leave
    | Stop
    | Close
    | Watch
    | Seen
    | Committed
    | Captured
    | Hurry
)
