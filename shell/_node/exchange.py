"""Typed I/O over the key layout: records and payloads in and out of a mailbox.

The exchange makes no protocol decision. It turns records into envelopes and back, verifies
every payload's SHA-256 before a byte of it is used, retries transient mailbox errors with
capped, jittered backoff on the node's clock until the node's outage limit, and resolves a
create whose outcome it could not see by reading the object back (the record carries the
writer's nonce, Decision 9).

It remembers the tensors of payloads it wrote, when the writer asks (up to ``written_cache``
bytes, oldest out first), so that reading one back needs no request: a payload is named by its
key, SHA-256 and size, and the remembered tensors are the ones whose bytes had that digest
(docs/decisions.md, "A node reads its own payloads from memory"). A node's syncer and joiner do
not ask (the syncer keeps its outer state and hands its learner the parameters, as tensors).
It remembers the snapshots it published the same way, a quantized one with its tensors, an
unquantized one's bytes alone when they are small; a snapshot is always read from the store:
only when the stored bytes equal the published ones is what it remembers used in place of
checking and parsing them again.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import secrets
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any, Literal, TypeVar

import attrs

from gradientmail._clock import Clock
from gradientmail._events import Callback, Rejected, Retried
from gradientmail.core import identity, keys, slots
from gradientmail.core.codecs import Compression, compress_parts, decompress
from gradientmail.core.effects import Created
from gradientmail.core.envelope import (
    HEADER_BYTES,
    MAX_RECORD_BYTES,
    Payload,
    payload_digest,
    seal,
    seal_parts,
    unseal,
)
from gradientmail.core.errors import FormatError
from gradientmail.core.records import (
    Claim,
    Commit,
    Lease,
    Manifest,
    PayloadRef,
    Record,
    Snapshot,
    canonical,
    read_record,
    to_bytes,
)
from gradientmail.core.robust import RECORD_BOUND, oversized
from gradientmail.core.signing import Keyring
from gradientmail.core.tensors import TensorBytes, Tensorish
from gradientmail.mailboxes._protocol import (
    Data,
    Mailbox,
    ObjectInfo,
    StoreUnavailable,
    TooLarge,
    TransientMailboxError,
    data_size,
    joined,
    takes_parts,
)

__all__ = ["DEFAULT_OUTAGE", "WRITTEN_CACHE_BYTES", "Exchange", "new_nonce"]

DEFAULT_OUTAGE = 1800.0
"""Seconds a request may keep failing transiently before the node stops (``StoreUnavailable``):
long enough for a store's or a network's usual incidents, during which training goes on up to
the overlap bound, and short enough that a store that is gone ends the run in the same hour."""


RECORD_OBJECT_BOUND = HEADER_BYTES + MAX_RECORD_BYTES
"""The most bytes a read of a manifest or commit record transfers: the largest envelope that
holds a record and no payload. A larger object at such a key (a squatter's, a corrupt one)
costs one request and this many bytes at most, however large it is."""
HEAD_BOUND = 64
"""The most bytes a read of an advisory ``heads/`` object transfers (a round number)."""


def _jitter(node: str, key: str, attempt: int) -> float:
    """A factor in [0.5, 1) fixed by ``node``, ``key`` and ``attempt``."""
    digest = hashlib.blake2b(f"{node}/{key}/{attempt}".encode(), digest_size=4).digest()
    return 0.5 + int.from_bytes(digest, "big") / 2**33


WRITTEN_CACHE_BYTES = 64 * 2**20
"""Default bytes of tensor data an ``Exchange`` remembers of the payloads it wrote (and the
budget of the outer state a closer keeps between its closes). 256 MiB until session 14: at
GPT-2 124M and K=4 that kept two fragments' momentum, half the model's F32 bytes in memory,
for no measured gain in publish-to-commit on a directory mailbox (docs/decisions.md)."""

T = TypeVar("T")
R = TypeVar("R")


@attrs.frozen
class ManifestWalk:
    """What a walk of the manifest keys found (``Exchange.manifest_walk``)."""

    manifest: Manifest | None
    # (key, signed, reason) of each passed key that holds a well-formed manifest record
    unverified: tuple[tuple[str, bool, str], ...] = ()


@attrs.frozen(eq=False)
class _Remembered:
    """Tensors this exchange wrote, with what a read must match to be given them: a payload's
    reference (``ref``), or a snapshot's exact stored bytes (``blob``) and record."""

    tensors: dict[str, TensorBytes]
    size: int  # bytes held: tensor data, and the blob of a snapshot
    ref: PayloadRef | None = None
    blob: bytes | None = None
    record: Snapshot | None = None


def new_nonce() -> str:
    """16 random hex digits: a writer's mark on what it creates."""
    return secrets.token_hex(8)


class Exchange:
    """Records and payloads of one run in ``mailbox``, for node ``node``.

    A request that fails transiently (``TransientMailboxError``: refused connections,
    timeouts, 5xx, throttling) is tried again, ``backoff`` seconds after the first failure and
    doubling up to ``max_backoff``, each wait shortened by up to half (a jitter fixed by the
    node, key and try, so that nodes that failed together do not retry together, and a run
    replays the same), and a ``Retried`` event each time: without limit until the request has
    failed for ``outage`` seconds, which raises ``StoreUnavailable`` (or, with ``retries``
    set, after that many tries, raising the last error). With ``keyring`` (a signed run)
    every record written is signed and every record read must verify (``core.signing``);
    without one, records are written unsigned and signatures are not checked.
    ``written_cache`` bounds the bytes of tensor data remembered of the payloads written last
    (0 remembers none).
    """

    def __init__(
        self,
        mailbox: Mailbox,
        clock: Clock,
        *,
        node: str = "observer",
        on_event: Callback | None = None,
        retries: int | None = None,
        backoff: float = 0.05,
        max_backoff: float = 10.0,
        outage: float = DEFAULT_OUTAGE,
        keyring: Keyring | None = None,
        written_cache: int = WRITTEN_CACHE_BYTES,
    ) -> None:
        if written_cache < 0:
            raise ValueError(f"written_cache must be >= 0 bytes, got {written_cache}")
        self.mailbox = mailbox
        self._parts = takes_parts(mailbox)
        self.keyring = keyring
        self.clock = clock
        self.node = node
        self._on_event = on_event or (lambda event: None)
        if not (backoff > 0 and max_backoff >= backoff and outage >= 0):
            raise ValueError(
                f"retry settings must satisfy 0 < backoff <= max_backoff and outage >= 0, got "
                f"backoff={backoff}, max_backoff={max_backoff}, outage={outage}"
            )
        self._retries = retries
        self._backoff = backoff
        self._max_backoff = max_backoff
        self._outage = outage
        # Reasons already reported, so that an object re-read every poll (a forged commit
        # squatting its key) is reported once, not once a poll.
        self._reported: set[tuple[str, str]] = set()
        # Per slot sequence (named by its first key: a round's commits, a node's snapshots of a
        # round, the manifests), how many leading keys hold objects that do not verify
        # (core.slots): they never change, so they are read once.
        self._passed: dict[str, int] = {}
        self._unverified_manifests: list[tuple[str, bool, str]] = []
        self._manifest_slot: int | None = None
        # Payloads and snapshots written last, oldest first, shared by a node's two loops (two
        # threads).
        self._written: OrderedDict[str, _Remembered] = OrderedDict()
        self._written_bytes = 0
        self._written_limit = written_cache
        self._written_lock = threading.Lock()
        self._moved: dict[str, str] = {}  # a snapshot's first key -> the key it was created at

    # -- requests with retries ---------------------------------------------------------

    async def _retry(self, operation: str, key: str, call: Callable[[], Awaitable[T]]) -> T:
        delay = self._backoff
        started = self.clock.now()
        attempt = 0
        while True:
            attempt += 1
            try:
                return await call()
            except TransientMailboxError as exc:
                if self._retries is not None and attempt >= self._retries:
                    raise
                failing = self.clock.now() - started
                if failing >= self._outage:
                    raise StoreUnavailable(
                        f"every try failed for {failing:.0f} s ({attempt} tries), beyond the "
                        f"outage limit of {self._outage:g} s; the last: {exc}",
                        store=exc.store,
                        key=exc.key,
                        operation=exc.operation,
                        seconds=failing,
                        tries=attempt,
                    ) from exc
                wait = min(delay, self._max_backoff) * _jitter(self.node, key, attempt)
                wait = min(wait, self._outage - failing)
                self._on_event(
                    Retried(
                        node=self.node,
                        operation=operation,
                        key=key,
                        attempt=attempt,
                        delay=wait,
                        error=str(exc),
                    )
                )
                await self.clock.sleep(wait)
                delay *= 2

    async def get(self, key: str, *, limit: int | None = None) -> bytes | None:
        """The object at ``key`` (None if absent); ``limit`` as ``Mailbox.get``: a larger
        object raises ``TooLarge`` having cost one request and at most ``limit`` bytes."""
        return await self._retry("get", key, lambda: self.mailbox.get(key, limit=limit))

    async def put(self, key: str, data: Data, *, durable: bool = True) -> None:
        """Put ``data`` at ``key``; parts are joined for a mailbox that does not take them."""
        mailbox, data = self._for_mailbox(data)
        await self._retry("put", key, lambda: mailbox.put(key, data, durable=durable))

    def _for_mailbox(self, data: Data) -> tuple[Any, Data]:
        """The mailbox, typed to take ``Data`` where it takes parts, and ``data`` as it takes
        them: joined into one ``bytes`` for a mailbox that does not."""
        return self.mailbox, data if self._parts else joined(data)

    async def create(self, key: str, data: bytes, *, durable: bool = True) -> bool:
        """Create a payload at ``key``; True when the object there is ours, even if a retry saw
        the key taken by our own first, unacknowledged write (a payload's key holds its
        writer's nonce, so equal bytes are ours). ``durable`` as ``Mailbox.create``."""
        outcome = await self._create(key, data, durable=durable)
        if outcome != "ambiguous":
            return outcome == "created"
        return await self.get(key) == data

    async def create_record(self, key: str, data: Data, *, durable: bool = True) -> Created:
        """Create the record ``data`` at ``key`` and say what became of it: created, taken,
        or ambiguous (a try failed in transit, then the key was found taken), the record found
        there read back for its nonce, which ``core.identity.ours`` judges (Decision 9)."""
        outcome = await self._create(key, data, durable=durable)
        if outcome != "ambiguous":
            return Created(key=key, outcome=outcome)
        return Created(key=key, outcome=outcome, nonce=await self._nonce_at(key))

    async def _create(
        self, key: str, data: Data, *, durable: bool
    ) -> Literal["created", "taken", "ambiguous"]:
        retried = False
        mailbox, data = self._for_mailbox(data)

        async def attempt() -> bool:
            nonlocal retried
            try:
                created: bool = await mailbox.create(key, data, durable=durable)
                return created
            except TransientMailboxError:
                retried = True
                raise

        if await self._retry("create", key, attempt):
            return "created"
        return "ambiguous" if retried else "taken"

    async def _nonce_at(self, key: str) -> str | None:
        """The nonce of the record at ``key``, read without its signature checked (an identity
        check: only our own nonce matters, and nobody else can know it); None if unreadable."""
        try:
            blob = await self.get(key, limit=RECORD_OBJECT_BOUND)
        except TooLarge:
            return None  # not a record, so not ours
        if blob is None:
            return None
        try:
            value = json.loads(unseal(blob).record)
        except (FormatError, ValueError):  # unreadable bytes are not ours
            return None
        nonce = value.get("nonce") if isinstance(value, dict) else None
        return nonce if isinstance(nonce, str) else None

    async def delete(self, key: str) -> None:
        self.forget_written(key)
        await self._retry("delete", key, lambda: self.mailbox.delete(key))

    async def list_keys(self, prefix: str) -> list[str]:
        return [info.key for info in await self._list(prefix)]

    async def _list(self, prefix: str) -> list[ObjectInfo]:
        return await self._retry("list", prefix, lambda: self.mailbox.list(prefix))

    # -- records ----------------------------------------------------------------------

    def reject(self, key: str, reason: str) -> None:
        """Report that the object at ``key`` was not used, and why (once per key and reason)."""
        if (key, reason) in self._reported:
            return
        if len(self._reported) >= 4096:
            self._reported.clear()
        self._reported.add((key, reason))
        self._on_event(Rejected(node=self.node, key=key, reason=reason))

    def _seal(
        self, record: Record, payload: Payload = b"", compression: Compression = "off"
    ) -> bytes:
        return seal(to_bytes(record, self.keyring), payload, compression=compression)

    async def _record(
        self, key: str, kind: type[R], *, verify: bool = True, limit: int = RECORD_OBJECT_BOUND
    ) -> R | None:
        """The record at ``key``, None when absent; a corrupt object, one above ``limit``
        bytes (not downloaded), or in a signed run an unsigned or badly signed one, raises
        ``FormatError``."""
        try:
            blob = await self.get(key, limit=limit)
        except TooLarge as exc:
            raise FormatError(oversized(exc.size, limit) or "oversized", key=key) from None
        if blob is None:
            return None
        verifier = self.keyring if verify else None
        return read_record(unseal(blob).record, kind, key=key, verifier=verifier)

    async def manifest(self, *, verify: bool = True) -> Manifest | None:
        """The run's manifest: the record at the first manifest key that verifies
        (``core.slots``), None when the walk meets a missing key first (no run). Objects that
        do not verify are reported and passed; ``verify=False`` passes only objects that are no
        manifest record at all. ``FormatError`` when every key is passed."""
        return (await self.manifest_walk(verify=verify)).manifest

    async def manifest_walk(self, *, verify: bool = True) -> ManifestWalk:
        """The manifest walk of ``manifest``, with the keys it passed that hold a well-formed
        manifest record that does not verify: a forgery, or a genuine run's manifest signed
        under a secret this node does not hold (``core.join`` refuses to create past one)."""
        first = keys.manifest(0)
        slot: int | None = self._passed.get(first, 0) if verify else 0
        unverified = self._unverified_manifests if verify else []
        while slot is not None:
            key = keys.manifest(slot)
            found = await self._judged(
                key, partial(self._record, key, Manifest, verify=verify), remember=verify
            )
            if not isinstance(found, FormatError):
                if found is not None:
                    self._manifest_slot = slot
                return ManifestWalk(manifest=found, unverified=tuple(unverified))
            # Without a keyring only what is no manifest at all is passed.
            signed = verify and self.keyring is not None
            if signed and all(key != seen for seen, _, _ in unverified):
                record = await self._unverified(key)
                if record is not None:
                    unverified.append((key, record.signed, str(found)))
            slot = slots.next_slot(slot, "refused")
        raise _every_key_squatted(keys.manifest(keys.MAX_SLOT), "manifest key")

    async def _unverified(self, key: str) -> Manifest | None:
        """The well-formed manifest record at ``key``, its signature unchecked, or None."""
        try:
            return await self._record(key, Manifest, verify=False)
        except FormatError:
            return None

    async def create_manifest(self, manifest: Manifest) -> Created:
        """Create the run's manifest at the first manifest key not known to hold an object
        that does not verify (``core.slots``; create-only: a run is created once). A key taken
        by a record that is ours (an ambiguous create), that verifies (another node created the
        run), or that is a well-formed manifest that does not verify (``core.join`` decides) is
        the outcome; one taken by anything else is passed and the next key tried."""

        async def stands(key: str, slot: int) -> bool:
            found = await self._judged(key, partial(self._record, key, Manifest))
            if not isinstance(found, FormatError):
                return True
            record = await self._unverified(key)
            if record is not None:  # told apart by no node: core.join refuses to go past it
                self._unverified_manifests.append((key, record.signed, str(found)))
            return record is not None

        created, slot = await self._create_in_sequence(
            keys.manifest, self._seal(manifest), manifest.nonce, stands, "manifest key"
        )
        if created.outcome == "created" or identity.ours(created, manifest.nonce):
            self._manifest_slot = slot
        return created

    async def put_manifest(self, manifest: Manifest) -> None:
        """Overwrite the manifest with ``manifest`` signed by this keyring, at the key the
        run's manifest was found at: only to re-sign the same content after a key rotation
        (``run.resign_manifest``); never to change a run."""
        if self._manifest_slot is None and await self.manifest() is None:
            raise FormatError("no manifest to re-sign", key=keys.manifest(0))
        assert self._manifest_slot is not None
        await self.put(keys.manifest(self._manifest_slot), self._seal(manifest))

    async def commit(self, r: int, *, verify: bool = True) -> Commit | None:
        """Round ``r``'s commit: the record at the first of the round's commit keys that
        verifies (``core.slots``), None when the walk meets a missing key first (not committed
        yet). A key holding an object that does not verify (corrupt, unsigned or badly signed in
        a signed run, naming another round) is reported and passed, and not read again;
        ``FormatError`` only when every key is passed. ``verify=False`` passes only objects
        that are no commit record at all (garbage, another round's record)."""
        slot: int | None = self._passed.get(keys.commit(r), 0) if verify else 0
        while slot is not None:
            found = await self._judged_commit(r, slot, verify=verify)
            if isinstance(found, Commit) or found is None:
                return found
            slot = slots.next_slot(slot, "refused")
        raise _every_key_squatted(keys.commit(r, keys.MAX_SLOT), "commit key of the round")

    async def commit_at(self, r: int, slot: int, *, verify: bool = True) -> Commit | None:
        """The record at round ``r``'s commit key ``slot`` (None when absent); ``FormatError``
        when it is not a commit of round ``r`` that verifies."""
        key = keys.commit(r, slot)
        commit = await self._record(key, Commit, verify=verify)
        if commit is not None and commit.round != r:
            raise FormatError(f"commit record names round {commit.round}", key=key)
        return commit

    async def _judged_commit(
        self, r: int, slot: int, *, verify: bool
    ) -> Commit | FormatError | None:
        """What commit key ``slot`` of round ``r`` holds: its commit, None, or why it is passed
        (``_judged``)."""
        return await self._judged(
            keys.commit(r, slot), lambda: self.commit_at(r, slot, verify=verify), remember=verify
        )

    async def _judged(
        self, key: str, read: Callable[[], Awaitable[T]], *, remember: bool = True
    ) -> T | FormatError:
        """What slot key ``key`` holds (``core.slots``): what ``read`` returns, or why it is
        passed. An object is passed only when a second read fails too (a read damaged in
        transit must not make a node pass a genuine record); a passed key is reported and,
        with ``remember``, counted in ``_passed`` under its sequence's first key, so that it is
        not read again."""
        try:
            return await read()
        except FormatError:
            pass
        try:
            return await read()
        except FormatError as exc:
            self.reject(key, str(exc))
            if remember:
                first, slot = _sequence(key)
                self._passed[first] = max(self._passed.get(first, 0), slot + 1)
            return exc

    async def create_commit(self, commit: Commit) -> Created:
        """Create the round's commit record at the first of its commit keys not known to hold
        an object that does not verify (``core.slots``; create-only: a round commits once).
        When the key is taken by a record that is ours (an ambiguous create) or that verifies,
        that is the outcome; by anything else, the key is passed and the next one tried."""
        r = commit.round

        async def stands(key: str, slot: int) -> bool:
            return not isinstance(await self._judged_commit(r, slot, verify=True), FormatError)

        created, _ = await self._create_in_sequence(
            partial(keys.commit, r),
            self._seal(commit),
            commit.nonce,
            stands,
            "commit key of the round",
        )
        return created

    async def _create_in_sequence(
        self,
        key_of: Callable[[int], str],
        data: Data,
        nonce: str,
        stands: Callable[[str, int], Awaitable[bool]],
        what: str,
        *,
        durable: bool = True,
    ) -> tuple[Created, int]:
        """Create ``data`` at the first key of a slot sequence (``key_of(slot)``) not known to
        hold an object that does not verify (``core.slots``), and say what became of it and at
        which slot. A key taken by our own record (an ambiguous create), or by an object that
        ``stands`` (it verifies: another writer's outcome), ends the walk; any other object is
        passed and the next key tried."""
        slot: int | None = self._passed.get(key_of(0), 0)
        while slot is not None:
            key = key_of(slot)
            created = await self.create_record(key, data, durable=durable)
            if created.outcome == "created" or identity.ours(created, nonce):
                return created, slot
            if await stands(key, slot):
                return created, slot
            slot = slots.next_slot(slot, "refused")
        raise _every_key_squatted(key_of(keys.MAX_SLOT), what)

    async def claims(self, r: int) -> list[Claim]:
        """The valid claims of round ``r``; corrupt, oversized, forged or misplaced ones are
        reported and left out."""
        found = []
        for info in await self._list(keys.claims(r)):
            claim = await self._claim_at(info.key, size=info.size)
            if claim is not None:
                found.append(claim)
        return found

    async def claim_at(self, r: int, attempt: int) -> Claim | None:
        """The valid claim of ``attempt`` of round ``r``, None when absent or invalid."""
        return await self._claim_at(keys.claim(r, attempt))

    async def _claim_at(self, key: str, *, size: int | None = None) -> Claim | None:
        try:
            parsed = keys.parse(key)
        except FormatError:
            parsed = None
        if parsed is None or parsed.kind != "claim":
            self.reject(key, "not a claim key")
            return None
        too_big = None if size is None else oversized(size, RECORD_BOUND)
        if too_big is not None:
            self.reject(key, too_big)
            return None
        try:
            claim = await self._record(key, Claim, limit=RECORD_BOUND)
        except FormatError as exc:
            self.reject(key, str(exc))
            return None
        if claim is not None and (claim.attempt, claim.round) != (parsed.attempt, parsed.round):
            self.reject(key, f"claim record names round {claim.round} attempt {claim.attempt}")
            return None
        return claim

    async def claim(self, claim: Claim) -> Created:
        # Not durable (docs/decisions.md, "What must survive a crash"): a claim lost
        # with the machine only costs duplicate work.
        key = keys.claim(claim.round, claim.attempt)
        return await self.create_record(key, self._seal(claim), durable=False)

    async def reporters(self, r: int) -> list[str]:
        """Nodes with a snapshot key under round ``r`` (key names only: one LIST)."""
        return sorted(await self.snapshot_slots(r))

    async def snapshot_slots(self, r: int) -> dict[str, tuple[tuple[int, int], ...]]:
        """Each node with a snapshot key under round ``r``: its keys' ``(slot, size in
        bytes)`` in slot order, from one LIST (so that an oversized object is refused before it
        is downloaded, and a squatted key is passed for the next, ``core.slots``)."""
        found: dict[str, list[tuple[int, int]]] = {}
        for info in await self._list(keys.snapshots(r)):
            try:
                parsed = keys.parse(info.key)
            except FormatError:
                self.reject(info.key, "not a snapshot key")
                continue
            if parsed.kind == "snapshot" and parsed.node is not None:
                assert parsed.slot is not None
                found.setdefault(parsed.node, []).append((parsed.slot, info.size))
        return {node: tuple(sorted(entries)) for node, entries in found.items()}

    async def publish(
        self,
        snapshot: Snapshot,
        payload: Payload,
        compression: Compression,
        tensors: Mapping[str, TensorBytes] | None = None,
        *,
        bound: int,
    ) -> Created:
        """Create this node's snapshot of a round at the first of its snapshot keys not known
        to hold an object that does not verify (``core.slots``; ``core.identity.ours`` judges
        whether the key then holds ours). A key taken by a snapshot record that verifies
        (another incarnation's) is the outcome; one taken by anything else (read only when at
        most ``bound`` bytes) is passed and the next key tried. ``tensors``, the payload's tensors
        before compression, are remembered with the bytes: a ``snapshot`` read that finds the
        very bytes published returns them without verifying and parsing the bytes again.
        Without ``tensors`` nothing is remembered: the node's closer holds its learner's delta
        and does not read its own snapshot back."""
        r, node = snapshot.round, snapshot.node
        parts = seal_parts(to_bytes(snapshot, self.keyring), payload, compression=compression)
        size = data_size(parts)
        remember = tensors is not None
        # Joined only when remembered (or for a mailbox that takes no parts): a large
        # unquantized snapshot is written from the tensors' memory, never copied whole.
        blob = joined(parts) if remember and size <= self._written_limit else None

        async def stands(key: str, slot: int) -> bool:
            read = partial(self.snapshot, r, node, slot=slot, limit=bound, bound=bound, parse=False)
            return not isinstance(await self._judged(key, read), FormatError)

        # Not durable (docs/decisions.md, "What must survive a crash"): a snapshot lost with
        # the machine is a round missed by its node, which crashed with it.
        created, slot = await self._create_in_sequence(
            partial(keys.snapshot, r, node),
            blob or parts,
            snapshot.nonce,
            stands,
            f"snapshot key of {node} in round {r}",
            durable=False,
        )
        if blob is not None and (
            created.outcome == "created" or identity.ours(created, snapshot.nonce)
        ):
            key = keys.snapshot(r, node, slot)
            self._remember(key, tensors or {}, blob=blob, record=snapshot)
            if slot:  # forgotten by its first key's name (``forget_written``)
                with self._written_lock:
                    self._moved[keys.snapshot(r, node)] = key
        return created

    async def snapshot(
        self,
        r: int,
        node: str,
        *,
        slot: int = 0,
        limit: int,
        bound: int | None = None,
        parse: bool = True,
    ) -> tuple[Snapshot, dict[str, TensorBytes]] | None:
        """The snapshot at ``node``'s snapshot key ``slot`` of round ``r`` and its payload
        tensors (at most ``limit`` bytes decompressed); ``FormatError`` when corrupt,
        mismatched, or above ``bound`` bytes (then not downloaded). Without ``parse`` the
        payload is verified against the record's digest but not parsed, and no tensors are
        returned (a writer judging whether a taken key's object stands)."""
        key = keys.snapshot(r, node, slot)
        try:
            blob = await self.get(key, limit=bound)
        except TooLarge as exc:
            raise FormatError(oversized(exc.size, bound or 0) or "oversized", key=key) from None
        if blob is None:
            return None
        with self._written_lock:
            mine = self._written.get(key)
        if (
            mine is not None
            and mine.record is not None
            and (mine.tensors or not parse)
            and blob == mine.blob
        ):
            # The very bytes this node published, which pass every check below.
            return mine.record, dict(mine.tensors) if parse else {}
        sealed = unseal(blob)
        record = read_record(sealed.record, Snapshot, key=key, verifier=self.keyring)
        if (record.round, record.node) != (r, node):
            raise FormatError(f"record names {record.node} round {record.round}", key=key)
        if payload_digest(sealed.payload) != record.digest:
            raise FormatError("payload does not match the record's digest", key=key)
        if not parse:
            return record, {}
        try:
            tensors = decompress(sealed.payload, sealed.compression, limit=limit)
        except FormatError as exc:
            raise FormatError(f"payload: {exc}", key=key) from None
        return record, tensors

    async def node_snapshot(
        self, r: int, node: str, *, limit: int
    ) -> tuple[Snapshot, dict[str, TensorBytes]] | None:
        """``node``'s snapshot of round ``r`` as every reader finds it (``core.slots``): the
        one at the first of its snapshot keys that verifies, None when the walk meets a
        missing key first. Keys passed are reported."""
        slot: int | None = 0
        while slot is not None:
            found = await self._judged(
                keys.snapshot(r, node, slot),
                partial(self.snapshot, r, node, slot=slot, limit=limit),
                remember=False,
            )
            if not isinstance(found, FormatError):
                return found
            slot = slots.next_slot(slot, "refused")
        return None

    # -- payloads ---------------------------------------------------------------------

    async def write_payload(
        self,
        key: str,
        tensors: Mapping[str, Tensorish],
        compression: Compression,
        *,
        remember: bool = True,
    ) -> PayloadRef:
        """Write ``tensors`` as the payload at ``key`` (a key naming the writer's nonce) and
        return its reference.
        ``remember``: keep the tensors for a read of it (``read_payload``); a writer that keeps
        the tensors itself (the syncer's outer state, the parameters it hands its learner)
        passes False, so that they are not held twice. Lent tensors (``TensorView``) are
        never remembered: their owner may write them once this returns."""
        payload = compress_parts(tensors, compression)
        parts = seal_parts(
            canonical({"format": 1, "kind": "payload", "key": key}),
            payload,
            compression=compression,
        )
        # Put, not create: the key holds the writer's fresh nonce, so no other writer names
        # it, and a put above the mailbox's part size goes in parts (docs/decisions.md). The
        # parts are the tensors' own memory: nothing is copied whole to be written. A large
        # payload is hashed on a thread of its own while it is written (both release the
        # GIL), not after.
        digest = digest_beside(payload)
        await self.put(key, parts)
        ref = PayloadRef(key=key, digest=digest(), size=data_size(parts))
        copied = {n: t for n, t in tensors.items() if isinstance(t, TensorBytes)}
        if remember and len(copied) == len(tensors):
            self._remember(key, copied, ref=ref)
        return ref

    async def read_payload(self, ref: PayloadRef, *, limit: int) -> dict[str, TensorBytes] | None:
        """The tensors of ``ref``, verified against its digest; None when the object is gone
        (collected); ``FormatError`` when it is corrupt. A payload this exchange wrote and still
        remembers, under the same key, digest and size, is returned without a request."""
        remembered = self._recall_written(ref)
        if remembered is not None:
            return remembered
        try:
            blob = await self.get(ref.key, limit=ref.size)
        except TooLarge as exc:
            raise FormatError(
                f"payload is {exc.size} bytes, its record says {ref.size}; not downloaded",
                key=ref.key,
            ) from None
        if blob is None:
            return None
        if len(blob) != ref.size:
            raise FormatError(
                f"payload is {len(blob)} bytes, its record says {ref.size}", key=ref.key
            )
        sealed = unseal(blob)
        if payload_digest(sealed.payload) != ref.digest:
            raise FormatError("payload does not match the record's digest", key=ref.key)
        try:
            return decompress(sealed.payload, sealed.compression, limit=limit)
        except FormatError as exc:
            raise FormatError(f"payload: {exc}", key=ref.key) from None

    def _remember(
        self,
        key: str,
        tensors: Mapping[str, TensorBytes],
        *,
        ref: PayloadRef | None = None,
        blob: bytes | None = None,
        record: Snapshot | None = None,
    ) -> None:
        size = sum(len(t.data) for t in tensors.values()) + len(blob or b"")
        if size > self._written_limit:
            return
        entry = _Remembered(
            tensors=dict(sorted(tensors.items())), size=size, ref=ref, blob=blob, record=record
        )
        self.forget_written(key)
        with self._written_lock:
            self._written[key] = entry
            self._written_bytes += entry.size
            while self._written_bytes > self._written_limit:
                _, dropped = self._written.popitem(last=False)
                self._written_bytes -= dropped.size

    def _recall_written(self, ref: PayloadRef) -> dict[str, TensorBytes] | None:
        with self._written_lock:
            entry = self._written.get(ref.key)
        if entry is None or entry.ref != ref:
            return None
        return dict(entry.tensors)

    def forget_written(self, *keys: str) -> None:
        """Stop remembering the payloads or snapshots at ``keys`` (superseded or closed ones):
        a later read of one is verified and parsed from the store's bytes. A snapshot published
        behind squatted keys is named by its first key."""
        with self._written_lock:
            for key in keys:
                entry = self._written.pop(self._moved.pop(key, key), None)
                if entry is not None:
                    self._written_bytes -= entry.size

    @property
    def manifest_key(self) -> str | None:
        """The key the run's manifest was last found (or created) at, None before
        (``core.slots``: the first manifest key whose object verifies)."""
        return None if self._manifest_slot is None else keys.manifest(self._manifest_slot)

    @property
    def written_limit(self) -> int:
        """The budget, in bytes, for remembering what this node wrote (``written_cache``)."""
        return self._written_limit

    @property
    def remembered_bytes(self) -> int:
        """Bytes held of the payloads and snapshots written last (at most ``written_cache``):
        tensor data, and a snapshot's stored bytes."""
        with self._written_lock:
            return self._written_bytes

    # -- leases and hints -------------------------------------------------------------

    async def put_lease(self, lease: Lease) -> None:
        # Not durable (docs/decisions.md, "What must survive a crash"): a lease lost
        # with the machine was its crashed node's.
        await self.put(keys.lease(lease.node), self._seal(lease), durable=False)

    async def lease(self, node: str) -> Lease | None:
        return await self._record(keys.lease(node), Lease, limit=RECORD_BOUND)

    async def lease_infos(self) -> dict[str, ObjectInfo]:
        """Every lease's listing entry (version and size) from one LIST of ``leases/``;
        oversized ones are reported and left out before any download."""
        found = {}
        for info in await self._list(keys.LEASES):
            try:
                parsed = keys.parse(info.key)
            except FormatError:
                self.reject(info.key, "not a lease key")
                continue
            too_big = oversized(info.size, RECORD_BOUND)
            if too_big is not None:
                self.reject(info.key, too_big)
                continue
            if parsed.kind == "lease" and parsed.node is not None:
                found[parsed.node] = info
        return found

    async def head(self, fragment: int) -> int | None:
        """The advisory newest commit round of ``fragment`` (may be stale or absent)."""
        try:
            blob = await self.get(keys.head(fragment), limit=HEAD_BOUND)
        except TooLarge as exc:
            self.reject(keys.head(fragment), str(oversized(exc.size, HEAD_BOUND)))
            return None
        if blob is None:
            return None
        try:
            value = int(blob.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            self.reject(keys.head(fragment), "not a round number")
            return None
        return value if value >= 0 else None

    async def put_head(self, fragment: int, r: int) -> None:
        # Not durable (docs/decisions.md, "What must survive a crash"): a hint, and an
        # unreadable one is ignored.
        await self.put(keys.head(fragment), str(r).encode("ascii"), durable=False)


HASHED_BESIDE = 4 * 2**20
"""Payloads of at least this many bytes are hashed on the digest thread (``digest_beside``)."""

_digests: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None


def _digest_thread() -> concurrent.futures.ThreadPoolExecutor:
    """The digest thread of this process (made again in a forked child, which inherits the
    executor but not its thread)."""
    global _digests
    found = _digests
    if found is None or found[0] != os.getpid():
        found = _digests = (
            os.getpid(),
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gradientmail-digest"),
        )
    return found[1]


def digest_beside(payload: Payload) -> Callable[[], str]:
    """``payload_digest(payload)``, started now on a thread of its own when the payload is
    ``HASHED_BESIDE`` bytes or more (hashlib releases the GIL), so that the caller can write it
    meanwhile; the function returned waits for the digest. The caller must not change the
    payload's memory until it has the digest. A smaller payload is hashed when asked."""
    if data_size(payload) < HASHED_BESIDE:
        return partial(payload_digest, payload)
    return _digest_thread().submit(payload_digest, payload).result


def _every_key_squatted(last: str, what: str) -> FormatError:
    return FormatError(f"every {what} holds an object that does not verify", key=last)


def _sequence(key: str) -> tuple[str, int]:
    """The first key of the slot sequence ``key`` belongs to, and its slot (``core.slots``)."""
    parsed = keys.parse(key)
    assert parsed.slot is not None, key
    if parsed.kind == "manifest":
        return keys.manifest(0), parsed.slot
    assert parsed.round is not None
    if parsed.kind == "snapshot":
        assert parsed.node is not None
        return keys.snapshot(parsed.round, parsed.node), parsed.slot
    return keys.commit(parsed.round), parsed.slot
