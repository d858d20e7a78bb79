"""Typed I/O over the key layout: records and payloads in and out of a mailbox.

The exchange makes no protocol decision. It turns records into envelopes and back, verifies
every payload's SHA-256 before a byte of it is used, retries transient mailbox errors with
exponential backoff on the node's clock, and resolves a create whose outcome it could not see
by reading the object back (the record carries the writer's nonce, Decision 9).
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

from gradientmail.clock import Clock
from gradientmail.core import keys
from gradientmail.core.codecs import Compression, compress, decompress
from gradientmail.core.envelope import payload_digest, seal, unseal
from gradientmail.core.errors import FormatError
from gradientmail.core.records import (
    Claim,
    Commit,
    Lease,
    Manifest,
    PayloadRef,
    Snapshot,
    canonical,
    read_record,
    to_bytes,
)
from gradientmail.core.tensors import TensorBytes
from gradientmail.events import Callback, Rejected, Retried
from gradientmail.mailbox import Mailbox, TransientMailboxError

__all__ = ["Exchange", "new_nonce"]

T = TypeVar("T")
R = TypeVar("R")


def new_nonce() -> str:
    """16 random hex digits: a writer's mark on what it creates."""
    return secrets.token_hex(8)


class Exchange:
    """Records and payloads of one run in ``mailbox``, for node ``node``.

    ``retries`` transient failures of one request are retried, ``backoff`` seconds after the
    first and doubling; the last one is raised.
    """

    def __init__(
        self,
        mailbox: Mailbox,
        clock: Clock,
        *,
        node: str = "observer",
        on_event: Callback | None = None,
        retries: int = 6,
        backoff: float = 0.05,
    ) -> None:
        self.mailbox = mailbox
        self.clock = clock
        self.node = node
        self._on_event = on_event or (lambda event: None)
        self._retries = retries
        self._backoff = backoff

    # -- requests with retries ---------------------------------------------------------

    async def _retry(self, operation: str, key: str, call: Callable[[], Awaitable[T]]) -> T:
        delay = self._backoff
        for attempt in range(1, self._retries + 1):
            try:
                return await call()
            except TransientMailboxError as exc:
                if attempt == self._retries:
                    raise
                self._on_event(
                    Retried(
                        node=self.node,
                        operation=operation,
                        key=key,
                        attempt=attempt,
                        delay=delay,
                        error=str(exc),
                    )
                )
                await self.clock.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    async def get(self, key: str) -> bytes | None:
        return await self._retry("get", key, lambda: self.mailbox.get(key))

    async def put(self, key: str, data: bytes) -> None:
        await self._retry("put", key, lambda: self.mailbox.put(key, data))

    async def create(self, key: str, data: bytes) -> bool:
        """Create ``key``; True when the object there is ours, even if a retry saw the key
        taken by our own first, unacknowledged write."""
        retried = False

        async def attempt() -> bool:
            nonlocal retried
            try:
                return await self.mailbox.create(key, data)
            except TransientMailboxError:
                retried = True
                raise

        if await self._retry("create", key, attempt):
            return True
        if not retried:
            return False
        return await self.get(key) == data

    async def delete(self, key: str) -> None:
        await self._retry("delete", key, lambda: self.mailbox.delete(key))

    async def list_keys(self, prefix: str) -> list[str]:
        infos = await self._retry("list", prefix, lambda: self.mailbox.list(prefix))
        return [info.key for info in infos]

    # -- records ----------------------------------------------------------------------

    def _reject(self, key: str, reason: str) -> None:
        self._on_event(Rejected(node=self.node, key=key, reason=reason))

    async def _record(self, key: str, kind: type[R]) -> R | None:
        """The record at ``key``, None when absent; a corrupt object raises ``FormatError``."""
        blob = await self.get(key)
        if blob is None:
            return None
        return read_record(unseal(blob).record, kind, key=key)

    async def manifest(self) -> Manifest | None:
        return await self._record(keys.MANIFEST, Manifest)

    async def create_manifest(self, manifest: Manifest) -> Manifest:
        """Create the run; returns the manifest that won (ours or a racing node's)."""
        if await self.create(keys.MANIFEST, seal(to_bytes(manifest))):
            return manifest
        theirs = await self.manifest()
        if theirs is None:
            raise FormatError("manifest vanished after a lost create", key=keys.MANIFEST)
        return theirs

    async def commit(self, r: int) -> Commit | None:
        return await self._record(keys.commit(r), Commit)

    async def create_commit(self, commit: Commit) -> bool:
        """True when ``commit`` is the round's record (ours), False when another won."""
        return await self.create(keys.commit(commit.round), seal(to_bytes(commit)))

    async def claims(self, r: int) -> list[Claim]:
        found = []
        for key in await self.list_keys(keys.claims(r)):
            try:
                claim = await self._record(key, Claim)
            except FormatError as exc:
                self._reject(key, str(exc))
                continue
            if claim is not None and keys.parse(key).attempt == claim.attempt:
                found.append(claim)
            elif claim is not None:
                self._reject(key, f"claim record names attempt {claim.attempt}")
        return found

    async def claim(self, claim: Claim) -> bool:
        return await self.create(keys.claim(claim.round, claim.attempt), seal(to_bytes(claim)))

    async def reporters(self, r: int) -> list[str]:
        """Nodes with a snapshot under round ``r`` (key names only: one LIST)."""
        nodes = []
        for key in await self.list_keys(keys.snapshots(r)):
            try:
                parsed = keys.parse(key)
            except FormatError:
                self._reject(key, "not a snapshot key")
                continue
            if parsed.kind == "snapshot" and parsed.node is not None:
                nodes.append(parsed.node)
        return sorted(nodes)

    async def publish(self, snapshot: Snapshot, payload: bytes, compression: Compression) -> bool:
        """Create this node's snapshot of a round; False when the key holds another
        incarnation's snapshot (the round is missed)."""
        blob = seal(to_bytes(snapshot), payload, compression=compression)
        return await self.create(keys.snapshot(snapshot.round, snapshot.node), blob)

    async def snapshot(
        self, r: int, node: str, *, limit: int
    ) -> tuple[Snapshot, dict[str, TensorBytes]] | None:
        """A snapshot and its payload tensors; ``FormatError`` when corrupt or mismatched."""
        key = keys.snapshot(r, node)
        blob = await self.get(key)
        if blob is None:
            return None
        sealed = unseal(blob)
        record = read_record(sealed.record, Snapshot, key=key)
        if payload_digest(sealed.payload) != record.digest:
            raise FormatError("payload does not match the record's digest", key=key)
        try:
            tensors = decompress(sealed.payload, sealed.compression, limit=limit)
        except ValueError as exc:
            raise FormatError(f"payload: {exc}", key=key) from None
        return record, tensors

    # -- payloads ---------------------------------------------------------------------

    async def write_payload(
        self, key: str, tensors: Mapping[str, TensorBytes], compression: Compression
    ) -> PayloadRef:
        payload = compress(tensors, compression)
        blob = seal(
            canonical({"format": 1, "kind": "payload", "key": key}),
            payload,
            compression=compression,
        )
        if not await self.create(key, blob):
            raise FormatError("payload key already taken (nonce collision)", key=key)
        return PayloadRef(key=key, digest=payload_digest(payload), size=len(blob))

    async def read_payload(self, ref: PayloadRef, *, limit: int) -> dict[str, TensorBytes] | None:
        """The tensors of ``ref``, verified against its digest; None when the object is gone
        (collected); ``FormatError`` when it is corrupt."""
        blob = await self.get(ref.key)
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
        except ValueError as exc:
            raise FormatError(f"payload: {exc}", key=ref.key) from None

    # -- leases and hints -------------------------------------------------------------

    async def put_lease(self, lease: Lease) -> None:
        await self.put(keys.lease(lease.node), seal(to_bytes(lease)))

    async def lease(self, node: str) -> Lease | None:
        return await self._record(keys.lease(node), Lease)

    async def lease_versions(self) -> dict[str, str]:
        """Every lease's version (etag) from one LIST of ``leases/``."""
        infos = await self._retry("list", keys.LEASES, lambda: self.mailbox.list(keys.LEASES))
        found = {}
        for info in infos:
            try:
                parsed = keys.parse(info.key)
            except FormatError:
                self._reject(info.key, "not a lease key")
                continue
            if parsed.kind == "lease" and parsed.node is not None:
                found[parsed.node] = info.version
        return found

    async def head(self, fragment: int) -> int | None:
        """The advisory newest commit round of ``fragment`` (may be stale or absent)."""
        blob = await self.get(keys.head(fragment))
        if blob is None:
            return None
        try:
            value = int(blob.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            self._reject(keys.head(fragment), "not a round number")
            return None
        return value if value >= 0 else None

    async def put_head(self, fragment: int, r: int) -> None:
        await self.put(keys.head(fragment), str(r).encode("ascii"))
