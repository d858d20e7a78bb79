"""DirectoryMailbox across processes: racing creates, writers killed mid-write, leftovers."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gradientmail._clock import run_sync
from gradientmail.mailboxes._directory import OFFLOADED_BYTES, TEMP_PREFIX, DirectoryMailbox
from gradientmail.mailboxes._protocol import MailboxError, ObjectInfo

RACER = """
import asyncio, json, os, sys
from gradientmail.mailboxes._directory import DirectoryMailbox

# fsync makes writes durable, not atomic: the race is decided by link(2) either way.
mailbox = DirectoryMailbox(sys.argv[1], fsync=False)
keys = [f"rounds/{i:020d}/commit" for i in range(int(sys.argv[2]))]
print("ready", flush=True)
sys.stdin.readline()

async def race():
    return [key for key in keys if await mailbox.create(key, b"winner %d" % os.getpid())]

print(json.dumps({"pid": os.getpid(), "won": asyncio.run(race())}), flush=True)
"""

WRITER = """
import asyncio, sys
from gradientmail.mailboxes._directory import DirectoryMailbox

mailbox = DirectoryMailbox(sys.argv[1])
data = bytes(range(256)) * (int(sys.argv[3]) // 256)
print("writing", flush=True)
asyncio.run(getattr(mailbox, sys.argv[2])("rounds/7/snapshots/node", data))
print("written", flush=True)
"""


def _python(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_eight_processes_racing_on_a_hundred_keys_have_one_winner_each(tmp_path: Path) -> None:
    racers = [_python(RACER, str(tmp_path), "100") for _ in range(8)]
    for racer in racers:
        assert racer.stdout is not None and racer.stdout.readline().strip() == "ready"
    for racer in racers:  # start them together, after their imports
        assert racer.stdin is not None
        racer.stdin.write("go\n")
        racer.stdin.flush()
    results = [json.loads(racer.communicate(timeout=120)[0]) for racer in racers]
    assert all(racer.returncode == 0 for racer in racers)
    winners: dict[str, int] = {}
    for result in results:
        for key in result["won"]:
            assert key not in winners, f"{key} won by both {winners[key]} and {result['pid']}"
            winners[key] = result["pid"]
    assert len(winners) == 100, f"{100 - len(winners)} keys have no winner"

    async def check() -> None:
        mailbox = DirectoryMailbox(tmp_path)
        for key, pid in winners.items():
            assert await mailbox.get(key) == b"winner %d" % pid
        assert len(await mailbox.list("rounds/")) == 100

    asyncio.run(check())


@pytest.mark.parametrize("operation", ["put", "create"])
def test_a_writer_killed_mid_write_leaves_no_visible_object(tmp_path: Path, operation: str) -> None:
    size = 128 * 2**20
    directory = tmp_path / "rounds" / "7" / "snapshots"
    for _attempt in range(5):
        writer = _python(WRITER, str(tmp_path), operation, str(size))
        assert writer.stdout is not None and writer.stdout.readline().strip() == "writing"
        temporary = _wait_for_temporary(directory, writer)
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=60)
        if temporary is not None and not (directory / "node").exists():
            break  # killed mid-write, as wanted; otherwise the write won the race: try again
    else:
        pytest.fail("could not kill the writer mid-write in 5 attempts")

    async def check() -> None:
        mailbox = DirectoryMailbox(tmp_path)
        assert await mailbox.get("rounds/7/snapshots/node") is None
        assert await mailbox.list("") == []
        assert any(p.name.startswith(TEMP_PREFIX) for p in directory.iterdir()), "left behind"
        assert await mailbox.create("rounds/7/snapshots/node", b"retry") is True

    asyncio.run(check())


def _wait_for_temporary(directory: Path, writer: subprocess.Popen[str]) -> Path | None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and writer.poll() is None:
        if directory.exists():
            for path in directory.iterdir():
                if path.name.startswith(TEMP_PREFIX) and path.stat().st_size > 0:
                    return path
        time.sleep(0.001)
    return None


def test_stale_temporaries_are_removed_at_open_and_never_listed(tmp_path: Path) -> None:
    directory = tmp_path / "rounds" / "3"
    directory.mkdir(parents=True)
    stale, fresh = directory / f"{TEMP_PREFIX}1-dead", directory / f"{TEMP_PREFIX}2-live"
    stale.write_bytes(b"crashed writer")
    fresh.write_bytes(b"writer in progress")
    two_hours_ago = time.time() - 7200
    os.utime(stale, (two_hours_ago, two_hours_ago))
    (directory / "commit").write_bytes(b"record")

    mailbox = DirectoryMailbox(tmp_path)
    assert not stale.exists() and fresh.exists()
    listed = asyncio.run(mailbox.list(""))
    assert [info.key for info in listed] == ["rounds/3/commit"]


def test_foreign_files_are_not_listed(tmp_path: Path) -> None:
    (tmp_path / "notes from an operator.txt").write_text("hello")
    (tmp_path / "ok").write_text("object")
    listed = asyncio.run(DirectoryMailbox(tmp_path).list(""))
    assert [info.key for info in listed] == ["ok"]


def test_delete_removes_directories_it_leaves_empty(tmp_path: Path) -> None:
    async def main() -> None:
        mailbox = DirectoryMailbox(tmp_path)
        await mailbox.put("rounds/00000000000000000001/snapshots/a", b"1")
        await mailbox.put("rounds/00000000000000000002/commit", b"2")
        await mailbox.delete("rounds/00000000000000000001/snapshots/a")
        assert sorted(p.name for p in (tmp_path / "rounds").iterdir()) == ["00000000000000000002"]
        await mailbox.delete("rounds/00000000000000000002/commit")
        assert tmp_path.exists() and list(tmp_path.iterdir()) == []

    asyncio.run(main())


def test_a_key_cannot_also_be_a_directory_of_keys(tmp_path: Path) -> None:
    async def main() -> None:
        mailbox = DirectoryMailbox(tmp_path)
        assert await mailbox.create("a/b", b"1") is True
        with pytest.raises(MailboxError, match="directory") as caught:
            await mailbox.create("a", b"2")
        assert caught.value.key == "a" and caught.value.operation == "create"
        with pytest.raises(MailboxError, match="directory"):
            await mailbox.put("a", b"2")
        assert await mailbox.get("a") is None
        with pytest.raises(MailboxError, match="is an object"):
            await mailbox.put("a/b/c", b"3")
        assert await mailbox.get("a/b/c") is None

    asyncio.run(main())


def test_versions_change_on_every_overwrite(tmp_path: Path) -> None:
    async def main() -> None:
        mailbox = DirectoryMailbox(tmp_path, fsync=False)
        seen = set()
        for _ in range(5):
            await mailbox.put("leases/node", b"same bytes, same size")
            [info] = await mailbox.list("leases/")
            seen.add(info.version)
            await asyncio.sleep(0.02)  # more than a filesystem timestamp tick
        assert len(seen) == 5

    asyncio.run(main())


def test_an_unwritable_root_is_a_mailbox_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    mailbox = DirectoryMailbox(blocker / "mailbox")  # opening creates nothing, so cannot fail
    with pytest.raises(MailboxError) as caught:
        asyncio.run(mailbox.put("a", b"x"))
    assert caught.value.operation == "put" and caught.value.key == "a"


def test_opening_and_reading_a_missing_directory_creates_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "run"
    mailbox = DirectoryMailbox(missing)

    async def read() -> tuple[bytes | None, list[ObjectInfo]]:
        return await mailbox.get("manifest"), await mailbox.list("")

    assert asyncio.run(read()) == (None, [])
    assert not (tmp_path / "no").exists()
    asyncio.run(mailbox.create("rounds/a", b"x"))
    assert (missing / "rounds" / "a").read_bytes() == b"x"


class _Parts(list[bytes]):
    """Parts of a put that note the thread that writes them."""

    def __init__(self, parts: list[bytes]) -> None:
        super().__init__(parts)
        self.threads: list[str] = []

    def __iter__(self):  # type: ignore[no-untyped-def]
        self.threads.append(threading.current_thread().name)
        return super().__iter__()


def test_large_writes_run_beside_the_loop_and_small_ones_on_it(tmp_path: Path) -> None:
    """A write of ``OFFLOADED_BYTES`` bytes or more runs on asyncio's thread pool, so two of
    them awaited together are written side by side; smaller writes, and any write of a
    coroutine driven without an event loop (``run_sync``), run on the caller's thread."""
    mailbox = DirectoryMailbox(tmp_path / "mailbox", fsync=False)
    large = [_Parts([bytes([i]) * (OFFLOADED_BYTES // 2)] * 2) for i in range(2)]
    small = _Parts([b"x" * 1024])

    async def write() -> None:
        await asyncio.gather(
            mailbox.put("rounds/1/params", large[0]), mailbox.create("rounds/1/state", large[1])
        )
        await mailbox.put("rounds/1/small", small)

    asyncio.run(write())
    here = threading.current_thread().name
    assert all(p.threads and p.threads[-1] != here for p in large)  # the last: the write
    assert small.threads and set(small.threads) == {here}
    for i, key in enumerate(["rounds/1/params", "rounds/1/state"]):
        assert asyncio.run(mailbox.get(key)) == bytes([i]) * OFFLOADED_BYTES
    driven = _Parts([b"y" * OFFLOADED_BYTES])
    run_sync(mailbox.put("rounds/2/params", driven))
    assert driven.threads and set(driven.threads) == {here}
    assert asyncio.run(mailbox.get("rounds/2/params")) == b"y" * OFFLOADED_BYTES


def test_reads_limited_to_large_sizes_run_beside_the_loop(tmp_path: Path) -> None:
    """A get whose ``limit`` allows ``OFFLOADED_BYTES`` or more (a snapshot or payload read)
    runs on the thread pool; a record's small limit, or none, keeps it on the caller's thread.
    Observed with a profile hook on every thread, which replaces nothing."""
    mailbox = DirectoryMailbox(tmp_path / "mailbox", fsync=False)
    asyncio.run(mailbox.put("rounds/1/a", b"a" * 100))
    asyncio.run(mailbox.put("rounds/1/b", b"b" * 100))
    seen: list[tuple[str, str]] = []

    def profile(frame: Any, event: str, arg: object) -> None:
        if event == "call" and frame.f_code.co_name == "_read_file":
            seen.append(
                (frame.f_locals["path"].rsplit("/", 1)[-1], threading.current_thread().name)
            )

    async def read() -> list[bytes | None]:
        big = [mailbox.get(k, limit=OFFLOADED_BYTES) for k in ("rounds/1/a", "rounds/1/b")]
        return [*await asyncio.gather(*big), await mailbox.get("rounds/1/a", limit=1024)]

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        found = asyncio.run(read())
        unlimited = asyncio.run(mailbox.get("rounds/1/b"))
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    assert found == [b"a" * 100, b"b" * 100, b"a" * 100] and unlimited == b"b" * 100
    here = threading.current_thread().name
    assert len(seen) == 4
    assert all(thread != here for _, thread in seen[:2]), seen
    assert [thread for _, thread in seen[2:]] == [here, here], seen
