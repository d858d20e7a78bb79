"""A hostile writer with write access to the run's bucket, acting through a mailbox wrapper.

Every time an honest node creates the first snapshot of a round, the writer first plants, under
that round's keys: garbage, a forged snapshot (valid format, signed with a wrong secret, with a
huge weight and a huge delta), a replay of an honest node's genuine snapshot of the fragment's
previous round, an object far larger than any snapshot, a forged claim of attempt 0, a genuine
claim of an earlier round replayed under attempt 1 and under a foreign key, and attempts to
overwrite honest snapshots (create-only, so they fail); it squats the round's first two commit
keys (a forged commit, then garbage: ``core.slots`` passes them) and every honest node's first
two snapshot keys (a forgery naming the node, then an object too large for a snapshot: the node
publishes at its third); and under ``leases/``, a forged lease, a garbage lease and an oversized
one. Before the run exists it squats the first two manifest keys (garbage, then an oversized
object: the run is created at the third). Deleting or overwriting honest objects are the
documented limits of docs/security.md and are not done here.
"""

from __future__ import annotations

import re

from gradientmail._node.exchange import RECORD_OBJECT_BOUND
from gradientmail.core import keys
from gradientmail.core.codecs import compress
from gradientmail.core.envelope import payload_digest, seal
from gradientmail.core.records import (
    Claim,
    Commit,
    Included,
    Lease,
    PayloadRef,
    Snapshot,
    to_bytes,
)
from gradientmail.core.robust import RECORD_BOUND
from gradientmail.core.signing import Keyring
from gradientmail.core.tensors import TensorBytes
from gradientmail.mailboxes._protocol import Mailbox, ObjectInfo, RequestStats

WRONG = Keyring.of(b"not the run secret, but as long.")
_SNAPSHOT = re.compile(r"rounds/(\d{20})/snapshots/(node-\d+)(?:\.\d{4})?$")
_CLAIM = re.compile(r"rounds/(\d{20})/claims/\d{4}$")


class HostileMailbox:
    """Forwards every call to ``inner``, planting hostile objects on the way (see the module)."""

    def __init__(
        self,
        inner: Mailbox,
        *,
        fragments: int,
        oversized: int,
        nodes: tuple[str, ...] = ("node-0", "node-1", "node-2"),
    ) -> None:
        self.inner = inner
        self.url = inner.url
        self.stats: RequestStats = inner.stats
        self.fragments = fragments
        self.oversized = oversized
        self.nodes = nodes
        self.genuine: dict[str, bytes] = {}  # honest snapshot blobs, by key
        self.planted: set[str] = set()
        self.fetched: list[str] = []  # every key an honest node GETs
        self._rounds: set[int] = set()

    async def get(self, key: str, *, limit: int | None = None) -> bytes | None:
        self.fetched.append(key)
        return await self.inner.get(key, limit=limit)

    async def put(self, key: str, data: bytes, *, durable: bool = True) -> None:
        await self.inner.put(key, data, durable=durable)

    async def create(self, key: str, data: bytes, *, durable: bool = True) -> bool:
        if key == keys.manifest(0) and key not in self.planted:
            await self._plant(key, b"\x00garbage" * 8)
            await self._plant(keys.manifest(1), b"\x03" * (RECORD_OBJECT_BOUND + 1))
        match = _SNAPSHOT.match(key)
        if match is not None:
            r = int(match.group(1))
            if r not in self._rounds:
                self._rounds.add(r)
                await self._attack(r)
        created = await self.inner.create(key, data, durable=durable)
        if created and (match is not None or _CLAIM.match(key)):
            self.genuine[key] = data
        return created

    async def list(self, prefix: str, *, after: str | None = None) -> list[ObjectInfo]:
        return await self.inner.list(prefix, after=after)

    async def delete(self, key: str) -> None:
        await self.inner.delete(key)

    async def close(self) -> None:
        await self.inner.close()

    async def _plant(self, key: str, data: bytes, *, put: bool = False) -> None:
        if put:
            await self.inner.put(key, data)
        else:
            await self.inner.create(key, data)
        self.planted.add(key)

    async def _attack(self, r: int) -> None:
        await self._plant(keys.snapshot(r, "mallory"), b"\x00garbage" * 64)
        await self._plant(keys.snapshot(r, "eve"), self._forged_snapshot(r))
        for node in self.nodes:  # every honest node's first two snapshot keys
            await self._plant(keys.snapshot(r, node), self._forged_snapshot(r, node))
            await self._plant(keys.snapshot(r, node, 1), b"\x01" * self.oversized)
        await self._plant(keys.snapshot(r, "oscar"), b"\x01" * self.oversized)
        previous = r - self.fragments
        replayable = [
            k for k in sorted(self.genuine) if _SNAPSHOT.match(k) and _round_of(k) == previous
        ]
        if replayable:
            # A genuine, validly signed record of the fragment's previous round, replayed.
            await self._plant(keys.snapshot(r, "trent"), self.genuine[replayable[0]])
            # Create-only: an honest node's key of an older round cannot be overwritten.
            assert not await self.inner.create(replayable[0], self._forged_snapshot(r))
        claims = [k for k in sorted(self.genuine) if _CLAIM.match(k)]
        if claims:
            # A genuine claim of an earlier round, replayed under a later attempt's key and
            # under a key that is no claim key at all.
            await self._plant(keys.claim(r, 1), self.genuine[claims[-1]])
            await self._plant(f"{keys.claims(r)}bogus", self.genuine[claims[-1]])
        claim = Claim(node="eve", nonce="e" * 16, round=r, attempt=0)
        await self._plant(keys.claim(r, 0), seal(to_bytes(claim, WRONG)))
        lease = Lease(node="eve", nonce="e" * 16, counter=r + 1)
        await self._plant(keys.lease("eve"), seal(to_bytes(lease, WRONG)), put=True)
        await self._plant(keys.lease("mallory"), b"\xff\xfe not a lease", put=True)
        await self._plant(keys.lease("oscar"), b"\x02" * (RECORD_BOUND + 1), put=True)
        await self._plant(f"{keys.round_prefix(r)}README", b"foreign object")
        # The round's commit keys, squatted before any honest closer gets there.
        await self._plant(
            keys.commit(r, 0), seal(to_bytes(forged_commit(r, self.fragments), WRONG))
        )
        await self._plant(keys.commit(r, 1), b"\x00garbage" * 8)

    def _forged_snapshot(self, r: int, node: str = "eve") -> bytes:
        big = TensorBytes(dtype="F32", shape=(8, 4), data=b"\x00\x00\x80\x7e" * 32)
        payload = compress({"0.weight": big}, "off")
        record = Snapshot(
            node=node,
            nonce="e" * 16,
            round=r,
            base_round=r - self.fragments if r >= self.fragments else -1,
            samples=10**9,
            steps=1,
            digest=payload_digest(payload),
        )
        return seal(to_bytes(record, WRONG), payload)


def forged_commit(r: int, fragments: int) -> Commit:
    """A commit of round ``r`` valid in every way but its signature."""
    digest, nonce = "ee" * 32, "e" * 16
    base = r - fragments if r >= fragments else -1
    return Commit(
        round=r,
        fragment=r % fragments,
        base_round=base,
        closer="eve",
        attempt=0,
        nonce=nonce,
        included=(
            Included(
                node="eve", nonce=nonce, samples=10**9, steps=1, base_round=base, digest=digest
            ),
        ),
        params=PayloadRef(key=keys.params(r, nonce), digest=digest, size=64),
        state=PayloadRef(key=keys.state(r, nonce), digest=digest, size=64),
    )


def _round_of(key: str) -> int:
    match = _SNAPSHOT.match(key) or _CLAIM.match(key)
    assert match is not None
    return int(match.group(1))
