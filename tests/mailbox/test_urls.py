"""mailbox_from_url: one string names a directory, a memory store or a bucket."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradientmail.mailboxes._directory import DirectoryMailbox
from gradientmail.mailboxes._memory import MemoryMailbox
from gradientmail.mailboxes._objectstore import ObjectStoreMailbox
from gradientmail.mailboxes._urls import mailbox_from_url


def test_paths_and_file_urls_open_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for url in (str(tmp_path / "a"), tmp_path / "a", (tmp_path / "a").as_uri()):
        mailbox = mailbox_from_url(url)
        assert isinstance(mailbox, DirectoryMailbox) and mailbox.root == tmp_path / "a"
    monkeypatch.chdir(tmp_path)
    relative = mailbox_from_url("runs/b")
    assert isinstance(relative, DirectoryMailbox) and relative.root == tmp_path / "runs" / "b"
    assert (
        mailbox_from_url("file://localhost" + str(tmp_path / "c")).url == (tmp_path / "c").as_uri()
    )
    assert isinstance(mailbox_from_url(str(tmp_path / "d"), fsync=False), DirectoryMailbox)


def test_a_file_url_with_spaces_is_unquoted(tmp_path: Path) -> None:
    mailbox = mailbox_from_url((tmp_path / "with space").as_uri())
    assert isinstance(mailbox, DirectoryMailbox) and mailbox.root.name == "with space"


def test_memory_urls_share_a_store_by_name() -> None:
    mailbox = mailbox_from_url("memory://urls-test")
    assert isinstance(mailbox, MemoryMailbox) and mailbox.url == "memory://urls-test"


def test_bucket_urls_open_object_stores() -> None:
    url = "s3://bucket/run/1?endpoint=http://127.0.0.1:9000&region=us-east-1"
    mailbox = mailbox_from_url(url)
    assert isinstance(mailbox, ObjectStoreMailbox) and mailbox.url == url
    gcs = mailbox_from_url("gs://bucket/run?base_url=http://127.0.0.1:4443&skip_signature=true")
    assert isinstance(gcs, ObjectStoreMailbox)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("ftp://host/run", "unknown mailbox scheme 'ftp'"),
        ("", "empty"),
        ("memory://", "needs a name"),
        ("file://otherhost/run", "local path"),
        ("s3://bucket/run?no_such_setting=1", "no_such_setting"),
    ],
)
def test_bad_urls_say_what_is_wrong(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mailbox_from_url(url)
