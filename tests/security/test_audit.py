"""``audit`` of a signed run: it needs the run's keyring, reports what does not verify as
rejected (as the nodes ignore it) and still finds real violations among verified records."""

from __future__ import annotations

import asyncio

import attrs
import pytest

torch = pytest.importorskip("torch")

from examples import KEYRING, THIRD  # noqa: E402
from examples import commit as example_commit  # noqa: E402
from virtual_run import committed_rounds, run_nodes  # noqa: E402

from gradientmail import ProtocolError  # noqa: E402
from gradientmail.adapters.torch import TorchBackend  # noqa: E402
from gradientmail.core import keys  # noqa: E402
from gradientmail.core.envelope import seal, unseal  # noqa: E402
from gradientmail.core.records import Lease, Snapshot, read_record, to_bytes  # noqa: E402
from gradientmail.core.signing import Keyring  # noqa: E402
from gradientmail.mailboxes._memory import MemoryMailbox  # noqa: E402
from gradientmail.testing import AuditError, audit  # noqa: E402

WRONG = Keyring.of(THIRD)


@pytest.fixture(scope="module")
def signed() -> tuple[MemoryMailbox, list[int]]:
    store, events, _, _ = run_nodes(keyring=KEYRING, steps=30)
    return store, committed_rounds(events)


def copy_of(store: MemoryMailbox) -> MemoryMailbox:
    async def copy() -> MemoryMailbox:
        out = MemoryMailbox()
        for info in await store.list(""):
            data = await store.get(info.key)
            assert data is not None
            await out.put(info.key, data)
        return out

    return asyncio.run(copy())


def test_a_signed_run_needs_its_keyring_and_an_unsigned_run_none(
    signed: tuple[MemoryMailbox, list[int]],
) -> None:
    store, rounds = signed
    with pytest.raises(
        ProtocolError, match=r"run is signed and audit has no secret: pass keyring="
    ):
        audit(store)
    with pytest.raises(ProtocolError, match="does not verify with audit's secret"):
        audit(store, keyring=WRONG)
    assert audit(store, keyring=KEYRING).rounds == tuple(rounds)
    unsigned, _, _, _ = run_nodes(steps=10)
    with pytest.raises(ProtocolError, match="run is not signed but audit has a secret"):
        audit(unsigned, keyring=KEYRING)


def test_forged_and_replayed_commits_are_rejected_not_violations(
    signed: tuple[MemoryMailbox, list[int]],
) -> None:
    store, rounds = copy_of(signed[0]), signed[1]
    last = max(rounds)

    async def plant() -> None:
        genuine = await store.get(keys.commit(last))
        assert genuine is not None
        # A genuine commit replayed where the fragment's chain would continue, a forgery of
        # it squatting the round after, and garbage under a third round's commit key.
        await store.create(keys.commit(last + 2), genuine)
        forged = seal(to_bytes(example_commit(last + 4), WRONG))
        await store.create(keys.commit(last + 4), forged)
        await store.create(keys.commit(last + 5), b"\x00 not a commit")
        lease = Lease(node="eve", nonce="e" * 16, counter=1)
        await store.put(keys.lease("eve"), seal(to_bytes(lease, WRONG)))

    asyncio.run(plant())
    report = audit(store, backend=TorchBackend(), keyring=KEYRING)
    assert report.rounds == tuple(rounds) and report.recomputed == len(rounds)
    rejected = dict(report.rejected)
    assert "names round" in rejected[keys.commit(last + 2)]
    assert "bad signature" in rejected[keys.commit(last + 4)]
    assert keys.commit(last + 5) in rejected
    assert "bad signature" in rejected[keys.lease("eve")]
    assert set(rejected) == {
        keys.commit(last + 2),
        keys.commit(last + 4),
        keys.commit(last + 5),
        keys.lease("eve"),
    }


def test_an_included_snapshot_that_does_not_verify_is_still_a_violation(
    signed: tuple[MemoryMailbox, list[int]],
) -> None:
    store, rounds = copy_of(signed[0]), signed[1]

    async def overwrite() -> str:
        key = (await store.list(keys.snapshots(rounds[0])))[0].key
        blob = await store.get(key)
        assert blob is not None
        sealed = unseal(blob)
        record = read_record(sealed.record, Snapshot, verifier=KEYRING)
        await store.put(key, seal(to_bytes(record, WRONG), sealed.payload))
        return key

    key = asyncio.run(overwrite())
    with pytest.raises(AuditError, match=f"round {rounds[0]}: included snapshot unreadable") as e:
        audit(store, keyring=KEYRING)
    assert any(key in v and "bad signature" in v for v in e.value.violations)


def test_a_late_snapshot_at_a_collected_rounds_freed_key_is_reported_not_a_violation(
    signed: tuple[MemoryMailbox, list[int]],
) -> None:
    """Collection deletes a round's snapshots; a process that had not seen the commit yet may
    then publish to the round at the freed key. In a round the rule collects, a snapshot of
    another process there is that late one (reported); the included process's own snapshot
    changed is still a violation, and so is anything in a round the rule keeps."""
    first = signed[1][0]

    def replaced(**changes: object) -> tuple[MemoryMailbox, str]:
        store = copy_of(signed[0])

        async def overwrite() -> str:
            key = (await store.list(keys.snapshots(first)))[0].key
            blob = await store.get(key)
            assert blob is not None
            sealed = unseal(blob)
            record = read_record(sealed.record, Snapshot, verifier=KEYRING)
            late = attrs.evolve(record, **changes)
            await store.put(key, seal(to_bytes(late, KEYRING), sealed.payload))
            return key

        return store, asyncio.run(overwrite())

    store, key = replaced(nonce="f" * 16)
    report = audit(store, keyring=KEYRING, keep=1)
    assert (key, f"a late snapshot, written after round {first} was collected") in report.rejected
    with pytest.raises(AuditError, match=f"round {first}: {key} differs from what the commit"):
        audit(store, keyring=KEYRING, keep=None)  # nothing collected: it cannot be late
    store, key = replaced(samples=7)
    with pytest.raises(AuditError, match=f"round {first}: {key} differs from what the commit"):
        audit(store, keyring=KEYRING, keep=1)
