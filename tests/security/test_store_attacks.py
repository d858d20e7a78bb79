"""The hostile writer's attacks on create-only keys, against each cloud store's own conditional
create (moto's S3, the GCS emulator, Azurite): nothing overwrites an honest record, a squatter
never passes for the honest writer, and in a race an honest create reports a win exactly when
the stored bytes are its own."""

from __future__ import annotations

import asyncio
import threading

from examples import KEYRING
from hostile import WRONG

from gradientmail import mailbox_from_url
from gradientmail._clock import MonotonicClock
from gradientmail._events import Event, Rejected
from gradientmail._node.exchange import Exchange
from gradientmail.core import keys
from gradientmail.core.envelope import seal
from gradientmail.core.records import Claim, to_bytes
from gradientmail.mailboxes._protocol import Mailbox

RACES = 12


def claim_blob(node: str, r: int, attempt: int, keyring: object) -> bytes:
    claim = Claim(node=node, nonce=("a" if node == "eve" else "b") * 16, round=r, attempt=attempt)
    return seal(to_bytes(claim, keyring))  # type: ignore[arg-type]


def test_hostile_creates_on_create_only_keys(store_url: str) -> None:
    events: list[Event] = []

    async def main() -> None:
        honest = Exchange(
            mailbox_from_url(store_url), MonotonicClock(), keyring=KEYRING, on_event=events.append
        )
        hostile: Mailbox = mailbox_from_url(store_url)  # its own client; no run secret

        # An honest claim first: every hostile create over it fails and changes nothing.
        mine = claim_blob("node-0", 3, 0, KEYRING)
        assert (await honest.create_record(keys.claim(3, 0), mine)).outcome == "created"
        for forged in (claim_blob("eve", 3, 0, WRONG), b"\x00garbage" * 64, mine + b"x"):
            assert await hostile.create(keys.claim(3, 0), forged) is False
        assert await hostile.get(keys.claim(3, 0)) == mine
        assert [c.node for c in await honest.claims(3)] == ["node-0"]

        # Squatted first: the honest create is told "taken", never "created", and the
        # squatter's objects are rejected, not read as claims.
        await hostile.create(keys.claim(4, 0), claim_blob("eve", 4, 0, WRONG))
        await hostile.create(keys.claim(4, 1), b"\xff\xfe not a claim")
        outcome = await honest.create_record(keys.claim(4, 0), claim_blob("node-0", 4, 0, KEYRING))
        assert outcome.outcome == "taken"
        assert await honest.claims(4) == []
        rejected = {e.key: e.reason for e in events if isinstance(e, Rejected)}
        assert "bad signature" in rejected[keys.claim(4, 0)]
        assert keys.claim(4, 1) in rejected
        await hostile.close()
        await honest.mailbox.close()

    asyncio.run(main())


def test_an_honest_create_racing_a_hostile_one_wins_only_with_its_own_bytes(store_url: str) -> None:
    outcomes: list[tuple[bool, bool, bytes | None, bytes, bytes]] = []
    for n in range(RACES):
        key = keys.claim(100 + n, 0)
        honest_bytes = claim_blob("node-0", 100 + n, 0, KEYRING)
        hostile_bytes = claim_blob("eve", 100 + n, 0, WRONG)
        barrier = threading.Barrier(2)
        won: dict[str, bool] = {}

        def create(who: str, data: bytes, key: str = key, barrier=barrier, won=won) -> None:  # type: ignore[no-untyped-def]
            async def run() -> None:
                mailbox = mailbox_from_url(store_url)
                barrier.wait(timeout=30)
                won[who] = await mailbox.create(key, data)
                await mailbox.close()

            asyncio.run(run())

        threads = [
            threading.Thread(target=create, args=("honest", honest_bytes)),
            threading.Thread(target=create, args=("hostile", hostile_bytes)),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        stored = asyncio.run(_get(store_url, key))
        outcomes.append((won["honest"], won["hostile"], stored, honest_bytes, hostile_bytes))
    for honest_won, hostile_won, stored, honest_bytes, hostile_bytes in outcomes:
        assert honest_won != hostile_won, "exactly one of two racing creates wins"
        assert stored == (honest_bytes if honest_won else hostile_bytes)


async def _get(url: str, key: str) -> bytes | None:
    mailbox = mailbox_from_url(url)
    try:
        return await mailbox.get(key)
    finally:
        await mailbox.close()
