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
