"""A hostile writer as a process of its own: write access to the run's bucket, no secret.

Run as a script by ``test_hostile.py`` beside honest node processes (``tests/shell/worker.py``)
until the file ``--stop`` appears; then it writes what it did to ``--out`` as JSON.

Before the run exists it squats the first two manifest keys (garbage, then an object larger
than any record: the run is created at the third, ``core.slots``), and touches ``--ready``.
Once the run exists it plants a forged manifest at the next free manifest key (readers never
get that far). It reads the bucket as any reader can (the manifest without its signature, the
listing, the honest objects) and, every ``--interval`` seconds, writes under the run's keys:

* into every round from the first to two fragments' worth past the newest it has seen (so most
  rounds hold its objects before any honest node reports there): a forged snapshot ``eve`` (the
  fragment's exact tensors, every value 1e30, a billion samples, signed with a wrong secret),
  garbage ``mallory``, an object ``oscar`` one byte over the closer's download bound, a forged
  claim of attempt 0, a foreign ``README``, and the round's first two commit keys (a forged
  commit, then garbage: honest closers pass them, ``core.slots``), and every honest node's
  (``--nodes``) first two snapshot keys (a forged snapshot naming the node, then an object
  too large for a snapshot: the node publishes at its third, and its round includes it);
* replays: an honest snapshot of one of the fragment's last three rounds under ``trent``, an honest
  claim under the next attempt's key, an honest commit under a round the run never reaches;
* forged leases: ``eve`` (wrong secret), ``mallory`` (garbage), ``oscar`` (oversized) and
  ``trent`` (an honest node's genuine lease replayed), rewritten each pass;
* attempts to replace honest objects (every honest snapshot, claim and commit it sees) with a
  forgery through ``create``: the store must refuse every one.

Keys that are create-only are written with the mailbox's ``create``, so the writer races the
honest nodes as any writer would; it never deletes or overwrites an honest object (nor an
honest lease): docs/security.md lists those as known limits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import attrs
from hostile import forged_commit

from gradientmail import mailbox_from_url
from gradientmail._node.exchange import RECORD_OBJECT_BOUND
from gradientmail.core import keys
from gradientmail.core.codecs import compress
from gradientmail.core.envelope import payload_digest, seal, unseal
from gradientmail.core.errors import FormatError
from gradientmail.core.records import Claim, Lease, Manifest, Snapshot, read_record, to_bytes
from gradientmail.core.robust import RECORD_BOUND, snapshot_bound
from gradientmail.core.signing import Keyring
from gradientmail.core.tensors import TensorBytes
from gradientmail.mailboxes._protocol import Mailbox

WRONG = Keyring.of(b"not the run secret, but as long.")
FAR = 1_000_000  # replayed commits go this many rounds past their own: the run never gets there
REPLAY_AHEAD = 3  # a replayed snapshot goes into this many of its fragment's next rounds


class Writer:
    def __init__(self, mailbox: Mailbox, manifest: Manifest, nodes: list[str]) -> None:
        self.mailbox, self.manifest, self.nodes = mailbox, manifest, nodes
        self.K = manifest.algorithm.fragments
        self.planted: set[str] = set()
        self.refused: set[str] = set()  # honest keys a forged create could not replace
        self.replaced: list[str] = []  # honest keys a create replaced: must stay empty
        self.attacked: set[int] = set()
        self.replayed: set[str] = set()
        self.passes = 0

    async def plant(self, key: str, data: bytes) -> None:
        if await self.mailbox.create(key, data):
            self.planted.add(key)

    async def run_pass(self) -> None:
        honest = await self._honest()
        newest = max((r for r in (keys.parse(k).round for k in honest) if r is not None), default=0)
        for r in range(newest + 2 * self.K + 1):
            if r not in self.attacked:
                self.attacked.add(r)
                await self._attack(r)
        await self._replay(honest)
        await self._leases(honest)
        self.passes += 1

    async def _honest(self) -> set[str]:
        """Keys of honest records: everything of ours under rounds/ that we did not plant."""
        found = set()
        for info in await self.mailbox.list(keys.ROUNDS):
            if info.key in self.planted:
                continue
            try:
                kind = keys.parse(info.key).kind
            except FormatError:
                continue
            if kind in ("snapshot", "claim", "commit"):
                found.add(info.key)
        return found

    async def _attack(self, r: int) -> None:
        await self.plant(keys.snapshot(r, "eve"), self._forged_snapshot(r))
        await self.plant(keys.snapshot(r, "mallory"), b"\x00garbage" * 64)
        schema = self.manifest.fragment_schema(r % self.K)
        oversized = b"\x01" * (snapshot_bound(schema) + 1)
        await self.plant(keys.snapshot(r, "oscar"), oversized)
        for node in self.nodes:
            await self.plant(keys.snapshot(r, node), self._forged_snapshot(r, node))
            await self.plant(keys.snapshot(r, node, 1), oversized)
        claim = Claim(node="eve", nonce="e" * 16, round=r, attempt=0)
        await self.plant(keys.claim(r, 0), seal(to_bytes(claim, WRONG)))
        await self.plant(f"{keys.round_prefix(r)}README", b"foreign object")
        await self.plant(keys.commit(r, 0), seal(to_bytes(forged_commit(r, self.K), WRONG)))
        await self.plant(keys.commit(r, 1), b"\x00garbage" * 8)

    async def _replay(self, honest: set[str]) -> None:
        for key in sorted(honest - self.replayed):
            parsed = keys.parse(key)
            assert parsed.round is not None
            data = await self.mailbox.get(key)
            if data is None:
                continue
            self.replayed.add(key)
            if parsed.kind == "snapshot":
                # Into the fragment's next three rounds: a writer slowed by load still gets
                # one in before its round closes.
                for ahead in range(1, REPLAY_AHEAD + 1):
                    await self.plant(keys.snapshot(parsed.round + ahead * self.K, "trent"), data)
            elif parsed.kind == "claim":
                assert parsed.attempt is not None
                await self.plant(keys.claim(parsed.round, parsed.attempt + 1), data)
            else:
                await self.plant(keys.commit(parsed.round + FAR * self.K), data)
            # Create-only: a forgery cannot take the place of what an honest node wrote.
            if await self.mailbox.create(key, self._forged_snapshot(parsed.round)):
                self.replaced.append(key)
            else:
                self.refused.add(key)

    async def _leases(self, honest: set[str]) -> None:
        counter = self.passes + 1
        forged = Lease(node="eve", nonce="e" * 16, counter=counter)
        await self._put(keys.lease("eve"), seal(to_bytes(forged, WRONG)))
        await self._put(keys.lease("mallory"), b"\xff\xfe not a lease" + bytes([counter % 256]))
        await self._put(keys.lease("oscar"), b"\x02" * (RECORD_BOUND + 1 + counter % 2))
        genuine = [i.key for i in await self.mailbox.list(keys.LEASES) if "/node-" in i.key]
        if genuine:
            data = await self.mailbox.get(genuine[counter % len(genuine)])
            if data is not None:
                await self._put(keys.lease("trent"), data)

    async def _put(self, key: str, data: bytes) -> None:
        await self.mailbox.put(key, data)
        self.planted.add(key)

    def _forged_snapshot(self, r: int, node: str = "eve") -> bytes:
        schema = self.manifest.fragment_schema(r % self.K)
        huge = b"\xca\xf2\x49\x71"  # 1e30 as little-endian F32
        delta = {
            p.name: TensorBytes(dtype="F32", shape=p.shape, data=huge * p.numel)
            for p in schema.parameters
        }
        payload = compress(delta, "off")
        record = Snapshot(
            node=node,
            nonce="e" * 16,
            round=r,
            base_round=r - self.K if r >= self.K else -1,
            samples=10**9,
            steps=1,
            digest=payload_digest(payload),
        )
        return seal(to_bytes(record, WRONG), payload)


async def manifest_of(mailbox: Mailbox, stop: Path) -> tuple[Manifest, int] | None:
    """The run's manifest once it exists, read as any reader can (no signature check: the
    first manifest key holding a manifest record), with its slot."""
    while not stop.exists():
        slot = 0
        while (blob := await mailbox.get(keys.manifest(slot))) is not None:
            try:
                return read_record(unseal(blob).record, Manifest), slot
            except FormatError:
                slot += 1
        await asyncio.sleep(0.02)
    return None


async def squat_manifest(mailbox: Mailbox) -> list[str]:
    """The first two manifest keys, squatted before the run exists."""
    planted = []
    for slot, data in ((0, b"\x00garbage" * 8), (1, b"\x03" * (RECORD_OBJECT_BOUND + 1))):
        if await mailbox.create(keys.manifest(slot), data):
            planted.append(keys.manifest(slot))
    return planted


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    mailbox = mailbox_from_url(args.mailbox)
    stop = Path(args.stop)
    squatted = await squat_manifest(mailbox)
    Path(args.ready).touch()
    found = await manifest_of(mailbox, stop)
    if found is None:
        return {"planted": squatted, "refused": [], "replaced": [], "passes": 0}
    manifest, slot = found
    writer = Writer(mailbox, manifest, args.nodes.split(","))
    writer.planted |= set(squatted)
    # A forged manifest behind the genuine one: no reader gets that far.
    forged = attrs.evolve(manifest, nonce="e" * 16, creator="eve")
    await writer.plant(keys.manifest(slot + 1), seal(to_bytes(forged, WRONG)))
    while not stop.exists():
        await writer.run_pass()
        await asyncio.sleep(args.interval)
    await writer.run_pass()  # one last pass over what the nodes wrote while closing
    return {
        "planted": sorted(writer.planted),
        "refused": sorted(writer.refused),
        "replaced": writer.replaced,
        "passes": writer.passes,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mailbox", required=True)
    parser.add_argument("--stop", required=True, help="stop once this file exists")
    parser.add_argument("--out", required=True)
    parser.add_argument("--ready", required=True, help="touched once the manifest is squatted")
    parser.add_argument("--nodes", required=True, help="the honest node ids, comma-separated")
    parser.add_argument("--interval", type=float, default=0.02, help="seconds between passes")
    args = parser.parse_args()
    started = time.monotonic()
    result = asyncio.run(main_async(args))
    result["seconds"] = time.monotonic() - started
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
