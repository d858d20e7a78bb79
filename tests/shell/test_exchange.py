"""The exchange remembers the payloads it wrote: reading one back needs no request, and nothing
but the exact payload it wrote (same key, digest and size) is ever served from memory. It
remembers its snapshots too, but reads them from the store every time and uses what it
remembers only when the stored bytes are exactly the ones it published."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

import attrs
import pytest

from gradientmail._clock import MonotonicClock
from gradientmail._node.exchange import Exchange
from gradientmail._node.spill import SpilledBase
from gradientmail.core import keys
from gradientmail.core.codecs import compress
from gradientmail.core.envelope import payload_digest
from gradientmail.core.errors import FormatError
from gradientmail.core.records import Snapshot
from gradientmail.core.tensors import TensorBytes
from gradientmail.mailboxes._memory import MemoryMailbox

LIMIT = 2**20


def tensors(seed: float, n: int = 64) -> dict[str, TensorBytes]:
    data = struct.pack(f"<{n}f", *(seed + i for i in range(n)))
    return {
        "b.weight": TensorBytes(dtype="F32", shape=(n,), data=data),
        "a.bias": TensorBytes(dtype="F32", shape=(2,), data=struct.pack("<2f", seed, -seed)),
    }


def gets(mailbox: MemoryMailbox) -> int:
    return mailbox.stats.snapshot()["get"]


def two_nodes() -> tuple[MemoryMailbox, MemoryMailbox, Exchange, Exchange]:
    """Two handles on one store, and the exchanges of a writer ("closer") and a reader."""
    store = MemoryMailbox()
    writer_box, reader_box = store.handle(), store.handle()
    writer = Exchange(writer_box, MonotonicClock(), node="closer")
    return writer_box, reader_box, writer, Exchange(reader_box, MonotonicClock(), node="other")


def test_a_payload_read_back_by_its_writer_needs_no_request() -> None:
    writer_box, reader_box, writer, reader = two_nodes()

    async def main() -> None:
        ref = await writer.write_payload(keys.params(4, "ab" * 8), tensors(1.0), "off")
        mine = await writer.read_payload(ref, limit=LIMIT)
        theirs = await reader.read_payload(ref, limit=LIMIT)
        assert gets(writer_box) == 0, "the writer read its own payload from memory"
        assert gets(reader_box) == 1, "another node's exchange reads the store"
        assert mine == theirs == dict(sorted(tensors(1.0).items()))
        assert list(mine) == ["a.bias", "b.weight"], "sorted by name, as a read from the store"

    asyncio.run(main())


def test_a_reference_with_another_digest_or_size_is_read_from_the_store() -> None:
    mailbox = MemoryMailbox().handle()
    exchange = Exchange(mailbox, MonotonicClock(), node="closer")

    async def main() -> None:
        ref = await exchange.write_payload(keys.state(8, "cd" * 8), tensors(2.0), "off")
        forged = attrs.evolve(ref, digest="0" * 64)
        with pytest.raises(FormatError, match="digest") as error:
            await exchange.read_payload(forged, limit=LIMIT)
        assert error.value.key == ref.key
        resized = attrs.evolve(ref, size=ref.size + 1)
        with pytest.raises(FormatError, match="bytes"):
            await exchange.read_payload(resized, limit=LIMIT)
        assert gets(mailbox) == 2

    asyncio.run(main())


def test_a_large_payload_hashed_while_it_is_written_has_its_own_digest(tmp_path: Path) -> None:
    # From HASHED_BESIDE bytes on, the digest is computed on another thread during the put;
    # the reference must name the bytes stored, which another node reads and verifies.
    from gradientmail._node.exchange import HASHED_BESIDE
    from gradientmail.mailboxes import mailbox_from_url

    url = f"file://{tmp_path}"
    writer = Exchange(mailbox_from_url(url), MonotonicClock(), node="closer")
    reader = Exchange(mailbox_from_url(url), MonotonicClock(), node="other")
    n = HASHED_BESIDE // 4 + 1024
    big = tensors(7.0, n=n)

    async def main() -> None:
        ref = await writer.write_payload(keys.params(3, "78" * 8), big, "off", remember=False)
        stored = (tmp_path / ref.key).read_bytes()
        assert ref.size == len(stored) > HASHED_BESIDE
        assert ref.digest == payload_digest(stored[_header(stored) :])
        assert await reader.read_payload(ref, limit=2 * ref.size) == dict(sorted(big.items()))

    asyncio.run(main())


def _header(blob: bytes) -> int:
    from gradientmail.core.envelope import HEADER_BYTES, unseal

    return HEADER_BYTES + len(unseal(blob).record)


def test_a_deleted_payload_is_gone_for_its_writer_too() -> None:
    mailbox = MemoryMailbox().handle()
    exchange = Exchange(mailbox, MonotonicClock(), node="closer")

    async def main() -> None:
        ref = await exchange.write_payload(keys.params(1, "ef" * 8), tensors(3.0), "off")
        await exchange.delete(ref.key)
        assert await exchange.read_payload(ref, limit=LIMIT) is None
        assert gets(mailbox) == 1

    asyncio.run(main())


def test_the_memory_is_bounded_oldest_payload_first() -> None:
    one = sum(len(t.data) for t in tensors(0.0).values())
    mailbox = MemoryMailbox().handle()
    exchange = Exchange(mailbox, MonotonicClock(), node="closer", written_cache=2 * one)

    async def main() -> None:
        refs = [
            await exchange.write_payload(keys.params(r, "12" * 8), tensors(float(r)), "off")
            for r in (0, 4, 8)
        ]
        for r, ref in zip((0, 4, 8), refs, strict=True):
            assert await exchange.read_payload(ref, limit=LIMIT) == dict(
                sorted(tensors(float(r)).items())
            )
        assert gets(mailbox) == 1, "only the oldest of three was forgotten and read again"

    asyncio.run(main())


def test_no_memory_with_a_zero_budget_and_a_negative_one_is_refused() -> None:
    mailbox = MemoryMailbox().handle()
    exchange = Exchange(mailbox, MonotonicClock(), written_cache=0)

    async def main() -> None:
        ref = await exchange.write_payload(keys.params(0, "34" * 8), tensors(5.0), "zstd")
        assert await exchange.read_payload(ref, limit=LIMIT) == dict(sorted(tensors(5.0).items()))
        assert gets(mailbox) == 1

    asyncio.run(main())
    with pytest.raises(ValueError, match="written_cache"):
        Exchange(mailbox, MonotonicClock(), written_cache=-1)


def test_forgotten_payloads_are_read_from_the_store() -> None:
    mailbox = MemoryMailbox().handle()
    exchange = Exchange(mailbox, MonotonicClock(), node="closer")

    async def main() -> None:
        ref = await exchange.write_payload(keys.params(2, "56" * 8), tensors(6.0), "off")
        held = exchange.remembered_bytes
        assert held == sum(len(t.data) for t in tensors(6.0).values())
        exchange.forget_written(ref.key, keys.state(2, "56" * 8))  # one never written: no-op
        assert exchange.remembered_bytes == 0
        assert await exchange.read_payload(ref, limit=LIMIT) == dict(sorted(tensors(6.0).items()))
        assert gets(mailbox) == 1

    asyncio.run(main())


async def publish(exchange: Exchange, r: int, seed: float) -> Snapshot:
    data = compress(tensors(seed), "zstd")
    snapshot = Snapshot(
        node=exchange.node,
        nonce="78" * 8,
        round=r,
        base_round=r - 4,
        samples=64,
        steps=10,
        digest=payload_digest(data),
    )
    assert await exchange.publish(snapshot, data, "zstd", tensors(seed), bound=1 << 20)
    return snapshot


def test_a_snapshot_is_read_from_the_store_and_matches_what_another_node_reads() -> None:
    writer_box, _, writer, reader = two_nodes()

    async def main() -> None:
        record = await publish(writer, 9, 7.0)
        blob = await writer_box.get(keys.snapshot(9, "closer"))
        assert blob is not None
        assert writer.remembered_bytes == sum(len(t.data) for t in tensors(7.0).values()) + len(
            blob
        )
        mine = await writer.snapshot(9, "closer", limit=LIMIT)
        theirs = await reader.snapshot(9, "closer", limit=LIMIT)
        assert mine == theirs == (record, dict(sorted(tensors(7.0).items())))
        assert gets(writer_box) == 2, "the writer still reads the stored bytes"
        writer.forget_written(keys.snapshot(9, "closer"))
        assert writer.remembered_bytes == 0
        assert await writer.snapshot(9, "closer", limit=LIMIT) == theirs

    asyncio.run(main())


def test_a_tampered_snapshot_is_checked_and_refused_by_its_writer_too() -> None:
    _, hostile, writer, _ = two_nodes()

    async def main() -> None:
        await publish(writer, 5, 1.0)
        key = keys.snapshot(5, "closer")
        blob = await hostile.get(key)
        assert blob is not None
        await hostile.put(key, blob[:-1] + bytes([blob[-1] ^ 1]))
        with pytest.raises(FormatError, match="digest") as error:
            await writer.snapshot(5, "closer", limit=LIMIT)
        assert error.value.key == key
        # Another incarnation's snapshot under the key, whole and valid, is what the store holds.
        other = Exchange(hostile, MonotonicClock(), node="closer")
        await hostile.delete(key)
        theirs = await publish(other, 5, 2.0)
        assert await writer.snapshot(5, "closer", limit=LIMIT) == (
            theirs,
            dict(sorted(tensors(2.0).items())),
        )

    asyncio.run(main())


@pytest.mark.parametrize("spill_base", [False, True])
def test_a_lone_node_remembers_only_the_newest_commit_of_each_fragment(
    tmp_path: Path, spill_base: bool
) -> None:
    """A closer keeps the outer state of the newest commit of each fragment, and the exchange
    forgets what each commit supersedes, so a long run holds one momentum per fragment (its
    master is the learner's base, when the base is in memory) and no payload of every
    round's. A base kept in a file (``spill_base``) holds the fragment's parameters there."""
    pytest.importorskip("torch")
    from virtual_run import drift, lone_session, make_model

    model = make_model()
    model_bytes = sum(4 * p.numel() for p in model.parameters())
    url = f"file://{tmp_path / 'run'}"
    with lone_session(
        model, url, overlap_steps=1, spill_base=spill_base, spill_dir=tmp_path
    ) as session:
        drift(model, session, 48)
    assert session.rounds_seen >= 16
    node = session._node  # the Session's own runtime
    assert node.syncer is not None and node.trainer is not None
    kept = node.syncer._kept
    assert sorted(kept) == [0, 1]
    assert all(k.momentum is not None for k in kept.values())
    assert all(k.base() is not None for k in kept.values())
    bases = node.trainer._base
    if spill_base:
        # The learner holds no tensors of its base, so the closer keeps the master itself.
        assert all(isinstance(b, SpilledBase) for b in bases)
        assert sum(b.nbytes for b in bases if isinstance(b, SpilledBase)) == model_bytes
        assert all(k.master is not None and k.shared is None for k in kept.values())
        assert sorted(p.name for p in tmp_path.iterdir()) == ["run"], "the files are unlinked"
        assert node.syncer._held() == 2 * model_bytes  # one F32 master and momentum each
    else:
        assert all(k.master is None for k in kept.values()), "the learner's base, shared"
        assert node.syncer._held() == model_bytes  # one F32 momentum of each fragment
    assert node.exchange.remembered_bytes <= model_bytes


@pytest.mark.parametrize("where", ["memory", "directory"])
def test_an_oversized_object_at_a_record_key_costs_one_bounded_read(
    where: str, tmp_path: Path
) -> None:
    """A 64 MiB object squatting the next commit key, the manifest or a head: each read of it
    is one request that transfers at most the record bound, and it is rejected unread. The
    commit and manifest keys are read twice, then passed for good (``core.slots``): later
    polls read only the round's next commit key, and the manifest is looked for at the next
    manifest key."""
    from gradientmail.mailboxes._directory import DirectoryMailbox

    mailbox = MemoryMailbox() if where == "memory" else DirectoryMailbox(tmp_path / "run")
    huge = b"\x00" * (64 * 2**20)
    for key in (keys.commit(7), keys.MANIFEST, keys.head(0)):
        asyncio.run(mailbox.put(key, huge))
    exchange = Exchange(mailbox, MonotonicClock())
    before = mailbox.stats.snapshot()
    for _ in range(3):  # a learner polls the next commit key again and again
        assert asyncio.run(exchange.commit(7)) is None
    assert asyncio.run(exchange.manifest()) is None  # passed: no run yet
    assert asyncio.run(exchange.head(0)) is None
    after = mailbox.stats.snapshot()
    # Polls: the squatted key twice and the next once, then the next key once each time; the
    # manifest: the squatted key twice and the next once; the head once.
    assert after["get"] - before["get"] == (2 + 1) + 1 + 1 + (2 + 1) + 1, "one request a read"
    assert after["bytes_in"] - before["bytes_in"] == 0, "nothing of the 64 MiB downloaded"
    with pytest.raises(FormatError, match="not downloaded"):
        asyncio.run(exchange.commit_at(7, 0))
