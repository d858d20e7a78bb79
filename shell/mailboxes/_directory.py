"""A mailbox in a directory: safe across processes on one machine or a shared POSIX filesystem.

A key ``a/b/c`` is the file ``root/a/b/c``. Every write goes to a temporary file in the target's
directory first and is fsynced before it gets its name, so a reader never sees a partial object
and a crash leaves at most an invisible temporary:

- ``create`` hard-links the temporary to the key's name; ``link(2)`` fails with EEXIST when the
  name is taken, atomically, which makes it the put-if-absent the protocol synchronizes on;
- ``put`` renames the temporary over the key's name (``rename(2)`` replaces atomically).

Temporaries are named ``~gm-tmp-...``; ``~`` is outside the key charset, so no key collides with
one and ``list`` skips them. Temporaries older than an hour (a crashed writer's) are removed
when a mailbox is opened.
"""

from __future__ import annotations

import asyncio
import errno
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from gradientmail.mailboxes._protocol import (
    Data,
    MailboxError,
    ObjectInfo,
    RequestStats,
    TooLarge,
    TransientMailboxError,
    data_size,
    is_valid_key,
    validate_key,
    validate_prefix,
)

__all__ = ["DirectoryMailbox"]

TEMP_PREFIX = "~gm-tmp-"
"""How temporaries are named; '~' keeps them apart from every valid key."""

STALE_TEMP_SECONDS = 3600.0
"""A temporary older than this (by mtime, seconds) belongs to a dead writer and is removed."""

# Errors a retry may cure (a busy or flaky disk, an NFS server that restarted, a full disk that
# garbage collection may free); anything else (permissions, read-only filesystem) is permanent.
_TRANSIENT_ERRNOS = frozenset(
    {errno.EIO, errno.ESTALE, errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.ETIMEDOUT}
    | {errno.ENOSPC, errno.EDQUOT}
)
_MISSING = (FileNotFoundError, NotADirectoryError, IsADirectoryError)
# A concurrent delete may remove an empty directory between our mkdir and our open.
_DIRECTORY_ATTEMPTS = 8

_T = TypeVar("_T")

OFFLOADED_BYTES = 4 * 2**20
"""Writes of at least this many bytes, and reads whose ``limit`` allows that many, run on
asyncio's thread pool even without ``offload``: the hand-off is nothing beside such a request,
and a loop that awaits two at once (``Clock.gather``: a closer's parameters and outer state, or
the snapshots it fetches ahead) then has them carried out side by side. Reads of records, whose
limits are small, and reads without a limit stay on the caller's thread."""


def _in_event_loop() -> bool:
    """Whether the caller runs on an event loop (one that can await a thread); a coroutine that
    ``run_sync`` drives has none."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


_Listing = list[ObjectInfo]  # spelled out here: inside the class, `list` is the method


class _KeyConflict(Exception):
    """A key is a directory of another key, or the other way round."""


class DirectoryMailbox:
    """A mailbox whose objects are files under ``root``.

    Args:
        root: the mailbox's directory. Opening it creates nothing: a missing directory reads
            as an empty mailbox (so ``gradientmail status`` of a mistyped path leaves no trace)
            and is created by the first write.
        fsync: flush each object and its directory entry to stable storage before the write
            returns (on by default; off only for throwaway test mailboxes).
        offload: run each file operation in asyncio's default thread pool, so that the event
            loop runs other tasks meanwhile. Off by default: the file operations then run on
            the calling thread and the coroutines return without yielding, except writes of
            ``OFFLOADED_BYTES`` bytes or more and reads limited to that many or more, which
            run on the pool (so two payloads awaited together move side by side). A node's
            loops await their small requests one at a time on their own threads, so a thread
            hop buys those nothing and costs CPU on every request (docs/decisions.md,
            "Directory requests run on the caller's thread").

    ``put`` and ``create`` take ``Data`` in parts (``takes_parts``): each part is written to the
    temporary file in turn, so a payload is never joined into one copy to be written.
    """

    takes_parts = True

    def __init__(
        self, root: str | os.PathLike[str], *, fsync: bool = True, offload: bool = False
    ) -> None:
        self.root = Path(root).absolute()
        self.url = self.root.as_uri()
        # Paths are plain strings below: pathlib's parsing cost more CPU per request than the
        # system calls of a small read.
        self._root = str(self.root)
        self.stats = RequestStats()
        self._fsync = fsync
        self._offload = offload
        try:
            if self.root.exists():
                remove_stale_temporaries(self.root, older_than=STALE_TEMP_SECONDS)
        except OSError as error:
            raise MailboxError(str(error), store=self.url, key="", operation="open") from error

    async def get(self, key: str, *, limit: int | None = None) -> bytes | None:
        path = self._path(key, "get")
        data = await self._run("get", key, _read_file, path, limit, size=limit or 0)
        if isinstance(data, int):
            self.stats.count("get")
            raise TooLarge(store=self.url, key=key, size=data, limit=limit or 0)
        self.stats.count("get", bytes_in=0 if data is None else len(data))
        return data

    async def put(self, key: str, data: Data, *, durable: bool = True) -> None:
        path = self._path(key, "put")
        size = data_size(data)
        self.stats.count("put", bytes_out=size)
        await self._run("put", key, self._replace, path, data, self._fsync and durable, size=size)

    async def create(self, key: str, data: Data, *, durable: bool = True) -> bool:
        path = self._path(key, "create")
        size = data_size(data)
        self.stats.count("create", bytes_out=size)
        return await self._run(
            "create", key, self._link, path, data, self._fsync and durable, size=size
        )

    async def delete(self, key: str) -> None:
        path = self._path(key, "delete")
        self.stats.count("delete")
        await self._run("delete", key, self._unlink, path)

    async def list(self, prefix: str, *, after: str | None = None) -> list[ObjectInfo]:
        validate_prefix(prefix, store=self.url)
        self.stats.count("list")
        return await self._run("list", prefix, self._walk, prefix, after)

    async def close(self) -> None:
        """Nothing to release: every request opens and closes its own files."""

    def __repr__(self) -> str:
        return f"DirectoryMailbox({str(self.root)!r})"

    def _path(self, key: str, operation: str) -> str:
        validate_key(key, store=self.url, operation=operation)
        # Validated keys have no '.', '..' or empty segment, so the path stays under root.
        return f"{self._root}/{key}"

    async def _run(
        self, operation: str, key: str, function: Callable[..., _T], *args: object, size: int = 0
    ) -> _T:
        try:
            if (self._offload or size >= OFFLOADED_BYTES) and _in_event_loop():
                return await asyncio.to_thread(function, *args)
            return function(*args)
        except _KeyConflict as error:
            raise MailboxError(str(error), store=self.url, key=key, operation=operation) from None
        except OSError as error:
            kind = TransientMailboxError if error.errno in _TRANSIENT_ERRNOS else MailboxError
            raise kind(str(error), store=self.url, key=key, operation=operation) from error

    def _link(self, path: str, data: Data, fsync: bool) -> bool:
        directory = os.path.dirname(path)
        temp = self._write_temporary(directory, data, fsync)
        try:
            os.link(temp, path)
        except FileExistsError:
            if os.path.isdir(path):
                raise _KeyConflict(f"{path} is a directory of other keys") from None
            return False
        finally:
            _remove(temp)
        if fsync:
            _sync_directory(directory)
        return True

    def _replace(self, path: str, data: Data, fsync: bool) -> None:
        directory = os.path.dirname(path)
        temp = self._write_temporary(directory, data, fsync)
        try:
            os.replace(temp, path)
        except IsADirectoryError:
            raise _KeyConflict(f"{path} is a directory of other keys") from None
        finally:
            _remove(temp)
        if fsync:
            _sync_directory(directory)

    def _unlink(self, path: str) -> None:
        try:
            os.unlink(path)
        except _MISSING:
            return
        # Remove directories the delete left empty, so garbage collection leaves no husks.
        directory = os.path.dirname(path)
        while directory != self._root:
            try:
                os.rmdir(directory)
            except OSError:
                return
            directory = os.path.dirname(directory)

    def _write_temporary(self, directory: str, data: Data, fsync: bool) -> str:
        """A fully written (and, with ``fsync``, fsynced) temporary file in ``directory``."""
        for _ in range(_DIRECTORY_ATTEMPTS):
            temp = f"{directory}/{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
            try:
                # The directory usually exists (a round's keys share theirs): open first and
                # make it only when missing, one system call instead of two.
                descriptor = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            except FileNotFoundError:
                try:
                    os.makedirs(directory, exist_ok=True)
                except (FileExistsError, NotADirectoryError):
                    raise _KeyConflict(f"a key above {directory} is an object") from None
                continue  # a concurrent delete may remove it again before the next open
            except NotADirectoryError:
                raise _KeyConflict(f"a key above {directory} is an object") from None
            try:
                with os.fdopen(descriptor, "wb") as file:
                    for part in (data,) if isinstance(data, bytes) else data:
                        file.write(part)
                    file.flush()
                    if fsync:
                        os.fsync(file.fileno())
            except BaseException:
                _remove(temp)
                raise
            return temp
        raise OSError(errno.EBUSY, f"{directory} kept disappearing under concurrent deletes")

    def _walk(self, prefix: str, after: str | None) -> _Listing:
        base = prefix.rpartition("/")[0]
        infos: _Listing = []
        pending = [base]
        while pending:
            relative = pending.pop()
            for name, is_dir in _entries(f"{self._root}/{relative}" if relative else self._root):
                key = f"{relative}/{name}" if relative else name
                if not is_valid_key(key):
                    continue  # temporaries and foreign files
                if is_dir:
                    if (key + "/").startswith(prefix) or prefix.startswith(key + "/"):
                        pending.append(key)
                elif key.startswith(prefix) and (after is None or key > after):
                    info = _stat(f"{self._root}/{key}", key)
                    if info is not None:
                        infos.append(info)
        infos.sort(key=lambda info: info.key)
        return infos


def _sync_directory(directory: str) -> None:
    # The new name is durable only once its directory is (POSIX fsync(2)).
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return


def _read_file(path: str, limit: int | None) -> bytes | int | None:
    """The file's bytes; None if missing; its size (an int) if that is above ``limit``. An
    open file keeps its content: writers replace files by renaming, never in place."""
    try:
        with open(path, "rb") as file:
            if limit is not None:
                size = os.fstat(file.fileno()).st_size
                if size > limit:
                    return size
            return file.read()
    except _MISSING:
        return None


def _entries(directory: str) -> list[tuple[str, bool]]:
    try:
        with os.scandir(directory) as entries:
            return [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _stat(path: str, key: str) -> ObjectInfo | None:
    try:
        status = os.stat(path)
    except FileNotFoundError:
        return None  # deleted while we listed
    version = f"{status.st_mtime_ns}-{status.st_size}-{status.st_ino}"
    return ObjectInfo(
        key=key, size=status.st_size, version=version, modified=status.st_mtime_ns / 1e9
    )


def remove_stale_temporaries(root: Path, *, older_than: float) -> int:
    """Delete temporaries under ``root`` last modified more than ``older_than`` seconds ago.

    Returns how many were removed. A live writer's temporary is younger (it is renamed or
    linked within one write), so only crashed writers' leftovers go.
    """
    cutoff = time.time() - older_than
    removed = 0
    for directory, _, files in os.walk(root):
        for name in files:
            if not name.startswith(TEMP_PREFIX):
                continue
            path = Path(directory, name)
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:
                continue
    return removed
