"""A squatted commit key costs reads, not the round (Decision 17, ``core.slots``): in a signed
run the round's commit is the first object at its commit keys that verifies; forgeries and
garbage before it are reported once, read a bounded number of times, and never stop a round or
let it commit twice."""

from __future__ import annotations

import asyncio

import pytest
from examples import KEYRING
from tamper import TamperingMailbox, flip

from gradientmail._clock import MonotonicClock
from gradientmail._events import Event, Rejected
from gradientmail._node.exchange import Exchange
from gradientmail.core import keys
from gradientmail.core.envelope import seal
from gradientmail.core.errors import FormatError
from gradientmail.core.records import Commit, Included, PayloadRef, to_bytes
from gradientmail.core.signing import Keyring
from gradientmail.mailboxes._memory import MemoryMailbox
from gradientmail.testing._audit import _read_commits

WRONG = Keyring.of(b"a forger's guess at the secret..")
R = 5


def commit(closer: str, nonce: str, r: int = R) -> Commit:
    digest = "ab" * 32
    return Commit(
        round=r,
        fragment=1,
        base_round=r - 2,
        closer=closer,
        attempt=0,
        nonce=nonce,
        included=(
            Included(node=closer, nonce=nonce, samples=8, steps=4, base_round=r - 2, digest=digest),
        ),
        params=PayloadRef(key=keys.params(r, nonce), digest=digest, size=10),
        state=PayloadRef(key=keys.state(r, nonce), digest=digest, size=10),
    )


def squat(store: MemoryMailbox, r: int = R) -> None:
    """A forgery (well formed, wrong secret) at the round's first commit key, garbage at the
    second, and a genuine commit of another round replayed at the third."""

    async def plant() -> None:
        assert await store.create(
            keys.commit(r, 0), seal(to_bytes(commit("eve", "e" * 16, r), WRONG))
        )
        assert await store.create(keys.commit(r, 1), b"\x00garbage" * 8)
        other = seal(to_bytes(commit("node-1", "1" * 16, r + 2), KEYRING))
        assert await store.create(keys.commit(r, 2), other)

    asyncio.run(plant())


def exchange(store: object, events: list[Event]) -> Exchange:
    return Exchange(store, MonotonicClock(), keyring=KEYRING, on_event=events.append)  # type: ignore[arg-type]


def test_a_closer_commits_at_the_first_free_key_and_every_reader_finds_that_commit() -> None:
    store = MemoryMailbox()
    squat(store)
    events: list[Event] = []
    closer, rival, reader = (exchange(store, events) for _ in range(3))
    ours = commit("node-0", "0" * 16)

    async def run() -> None:
        assert await reader.commit(R) is None, "no commit yet: the walk ends at a free key"
        created = await closer.create_commit(ours)
        assert created.outcome == "created" and created.key == keys.commit(R, 3)
        # A second attempt's closer finds the round committed, not a key to take.
        lost = await rival.create_commit(commit("node-2", "2" * 16))
        assert lost.outcome == "taken" and lost.key == keys.commit(R, 3)
        assert not await store.get(keys.commit(R, 4)), "the round committed once"
        assert await reader.commit(R) == ours
        assert await rival.commit(R) == ours

    asyncio.run(run())
    rejected = {(e.key, e.reason.split(": ", 1)[-1]) for e in events if isinstance(e, Rejected)}
    assert {key for key, _ in rejected} == {keys.commit(R, s) for s in range(3)}
    reasons = dict(rejected)
    assert "bad signature" in reasons[keys.commit(R, 0)]
    assert "magic" in reasons[keys.commit(R, 1)]
    assert "names round 7" in reasons[keys.commit(R, 2)]


def test_a_passed_key_is_read_twice_once_and_never_again() -> None:
    """A learner polls the round's commit every poll: the squatted keys cost two reads each,
    the first time, then each poll is one GET of the first key not passed."""
    store = MemoryMailbox()
    squat(store)
    learner = exchange(store, [])

    async def polls(n: int) -> None:
        for _ in range(n):
            assert await learner.commit(R) is None

    asyncio.run(polls(1))
    gets = _gets(store)
    assert gets == 3 * 2 + 1, gets  # three keys passed after two reads each, one free key
    asyncio.run(polls(10))
    assert _gets(store) - gets == 10, "each later poll reads one key"


def test_a_read_damaged_in_transit_does_not_pass_a_genuine_commit() -> None:
    """Passing a key after one failed read would let a corrupted read of a genuine commit send a
    closer to the next key and commit the round twice; a second read tells them apart."""
    inner = MemoryMailbox()
    ours = commit("node-0", "0" * 16)
    asyncio.run(exchange(inner, []).create_commit(ours))
    damaged = TamperingMailbox(inner)
    damaged.corrupt_reads(keys.commit(R), flip(9), times=1)
    events: list[Event] = []
    rival = exchange(damaged, events)
    lost = asyncio.run(rival.create_commit(commit("node-2", "2" * 16)))
    assert lost.outcome == "taken" and damaged.tampered == [keys.commit(R)]
    assert asyncio.run(rival.commit(R)) == ours
    assert not [e for e in events if isinstance(e, Rejected)]
    assert asyncio.run(inner.get(keys.commit(R, 1))) is None


def test_every_key_squatted_is_a_clear_error_not_a_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keys, "MAX_SLOT", 2)
    store = MemoryMailbox()
    squat(store)
    with pytest.raises(FormatError, match="every commit key of the round"):
        asyncio.run(exchange(store, []).create_commit(commit("node-0", "0" * 16)))
    with pytest.raises(FormatError, match="every commit key of the round"):
        asyncio.run(exchange(store, []).commit(R))


def test_the_audit_passes_squatted_keys_and_finds_a_round_committed_twice() -> None:
    store = MemoryMailbox()
    squat(store)
    ours = commit("node-0", "0" * 16)
    asyncio.run(exchange(store, []).create_commit(ours))
    listing = {info.key: info.size for info in asyncio.run(store.list(keys.round_prefix(R)))}
    violations: list[str] = []
    audited = exchange(store, [])
    assert asyncio.run(_read_commits(audited, {R: listing}, violations)) == {R: ours}
    assert violations == []
    # A second commit that verifies, written past the first (no honest closer does that).
    twice = seal(to_bytes(commit("node-2", "2" * 16), KEYRING))
    assert asyncio.run(store.create(keys.commit(R, 4), twice))
    listing = {info.key: info.size for info in asyncio.run(store.list(keys.round_prefix(R)))}
    asyncio.run(_read_commits(exchange(store, []), {R: listing}, violations))
    assert violations == [f"round {R} committed 2 times: {keys.commit(R, 3)}, {keys.commit(R, 4)}"]


def _gets(store: MemoryMailbox) -> int:
    return store.stats["get"]
