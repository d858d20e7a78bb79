"""Every mailbox passes the same conformance suite, 64 MiB objects included."""

from __future__ import annotations

from pathlib import Path

import pytest
from obstore.store import LocalStore, MemoryStore

from gradientmail.mailboxes._directory import DirectoryMailbox
from gradientmail.mailboxes._memory import Faults, MemoryMailbox
from gradientmail.mailboxes._objectstore import ObjectStoreMailbox
from gradientmail.testing._conformance import check_mailbox

LARGE = 64 * 2**20


def test_memory_mailbox() -> None:
    check_mailbox(MemoryMailbox().handle, large_size=LARGE)


def test_memory_mailbox_with_delays() -> None:
    # Delays interleave the racing threads differently without changing any outcome.
    store = MemoryMailbox()
    check_mailbox(lambda: store.handle(faults=Faults(seed=1, delay=(0.0, 0.002))), large_size=2**16)


def test_named_memory_mailbox_handles_share_a_store() -> None:
    check_mailbox(lambda: MemoryMailbox.named("conformance"), large_size=2**16)


def test_directory_mailbox(tmp_path: Path) -> None:
    check_mailbox(lambda: DirectoryMailbox(tmp_path / "mailbox"), large_size=LARGE)


def test_directory_mailbox_offloading_to_threads(tmp_path: Path) -> None:
    check_mailbox(lambda: DirectoryMailbox(tmp_path / "mailbox", offload=True), large_size=2**20)


def test_object_store_mailbox_on_memory_store() -> None:
    store = MemoryStore()
    check_mailbox(lambda: ObjectStoreMailbox(store), large_size=LARGE)


def test_object_store_mailbox_on_local_store(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, mkdir=True)
    check_mailbox(lambda: ObjectStoreMailbox(store), large_size=LARGE)


def test_object_store_mailbox_on_each_cloud_store(store_url: str) -> None:
    # Each store's local server (moto, the GCS emulator, Azurite), threads and processes racing.
    # moto moves about 10 MB/s through Python; the 64 MiB run is the slow variant below.
    check_mailbox(lambda: ObjectStoreMailbox(store_url), large_size=8 * 2**20, url=store_url)


def test_directory_mailbox_with_racing_processes(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'mailbox'}"
    check_mailbox(lambda: DirectoryMailbox(tmp_path / "mailbox"), large_size=2**20, url=url)


@pytest.mark.slow
@pytest.mark.s3
def test_object_store_mailbox_on_moto_server_with_64_mib_objects(moto_url: str) -> None:
    check_mailbox(lambda: ObjectStoreMailbox(moto_url), large_size=LARGE)


@pytest.mark.slow
@pytest.mark.s3
def test_many_racers_on_moto_server(moto_url: str) -> None:
    check_mailbox(lambda: ObjectStoreMailbox(moto_url), large_size=2**20, racers=64)


@pytest.mark.slow
def test_many_racers_on_directory(tmp_path: Path) -> None:
    check_mailbox(lambda: DirectoryMailbox(tmp_path), large_size=256 * 2**20, racers=64)


# Observers recognize a lease renewal from the MD5 a listing gives (core.leases.renewal): the
# bytes a node writes for a lease must be those the core predicts, and the stores the docs
# name must list the MD5, or every renewal would silently cost every observer a GET.
LISTS_MD5 = {"s3": True, "gs": True, "az": False}


def test_a_written_lease_lists_the_md5_the_core_predicts(store_url: str) -> None:
    import asyncio

    from gradientmail._clock import MonotonicClock
    from gradientmail._node.exchange import Exchange
    from gradientmail.core.leases import lease_md5
    from gradientmail.core.records import Lease
    from gradientmail.core.signing import Keyring

    keyring = Keyring.of(b"the run secret, at least 16 bytes")
    lease = Lease(node="node-a", nonce="0123456789abcdef", counter=12, left=True)

    async def write_and_list() -> str | None:
        exchange = Exchange(ObjectStoreMailbox(store_url), MonotonicClock(), keyring=keyring)
        await exchange.put_lease(lease)
        return (await exchange.lease_infos())["node-a"].md5

    listed = asyncio.run(write_and_list())
    if LISTS_MD5[store_url.split(":", 1)[0]]:
        assert listed == lease_md5(lease, keyring)
    else:
        assert listed is None, "an opaque etag is not taken for an MD5"


def test_the_memory_mailbox_lists_the_md5_the_core_predicts() -> None:
    import asyncio

    from gradientmail._clock import MonotonicClock
    from gradientmail._node.exchange import Exchange
    from gradientmail.core.leases import lease_md5
    from gradientmail.core.records import Lease

    lease = Lease(node="node-a", nonce="0123456789abcdef", counter=3)

    async def write_and_list() -> str | None:
        exchange = Exchange(MemoryMailbox(), MonotonicClock())
        await exchange.put_lease(lease)
        return (await exchange.lease_infos())["node-a"].md5

    assert asyncio.run(write_and_list()) == lease_md5(lease, None)
