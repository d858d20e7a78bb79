"""The mailbox: the five storage primitives the protocol stands on, and their errors.

Every run shares nothing but a mailbox: an object-store bucket or a directory. The protocol
needs only ``get``, ``put`` (overwrite, used only by a key's single owner), ``create``
(put-if-absent, the only synchronization primitive), ``list`` (sorted on the client, because
some stores list unordered) and ``delete``. No compare-and-swap, rename or lock is assumed.

Keys are ``/``-separated segments of ``[A-Za-z0-9._-]``; no segment is empty, ``.`` or ``..``
or longer than 255 bytes (a file name); no leading ``/``; at most 1024 bytes (S3's limit). One
key must not be a directory of another (``a`` and ``a/b``): a directory mailbox cannot hold
both, and the protocol's layout never needs it.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Sequence
from typing import Protocol, TypeAlias, runtime_checkable

import attrs

from gradientmail.core.errors import GradientmailError

__all__ = [
    "BadKey",
    "Data",
    "Mailbox",
    "MailboxError",
    "ObjectInfo",
    "RequestStats",
    "StoreUnavailable",
    "TooLarge",
    "TransientMailboxError",
    "data_size",
    "joined",
    "takes_parts",
    "validate_key",
    "validate_prefix",
]

MAX_KEY_BYTES = 1024
"""The longest key in bytes (S3's limit for an object key)."""

MAX_SEGMENT_BYTES = 255
"""The longest segment in bytes (NAME_MAX, the longest file name on POSIX filesystems)."""

_SEGMENT = re.compile(r"[A-Za-z0-9._-]+")
# Every key the protocol writes matches this (ASCII, so characters are bytes): one match
# clears it, and only a key that fails is taken apart to say why.
_PLAIN_KEY = re.compile(r"[A-Za-z0-9._-]{1,255}(?:/[A-Za-z0-9._-]{1,255})*")
_KINDS = ("get", "put", "create", "list", "delete")

Data: TypeAlias = bytes | Sequence[bytes | memoryview]
"""An object's bytes as a writer hands them over: one ``bytes``, or parts whose concatenation
they are (a payload's header and each tensor's memory, so that a large payload is never copied
whole to be written). Only a mailbox whose ``takes_parts`` is true is handed parts."""


def data_size(data: Data) -> int:
    """The object's size in bytes."""
    return len(data) if isinstance(data, bytes) else sum(memoryview(p).nbytes for p in data)


def joined(data: Data) -> bytes:
    """The object's bytes in one piece (a copy when ``data`` is parts)."""
    return data if isinstance(data, bytes) else b"".join(data)


def takes_parts(mailbox: object) -> bool:
    """Whether ``mailbox``'s ``put`` and ``create`` take ``Data`` in parts (a class attribute
    ``takes_parts``; a mailbox without it is handed ``bytes``)."""
    return getattr(mailbox, "takes_parts", False) is True


class MailboxError(GradientmailError):
    """A mailbox request failed; says which store, key and operation.

    Attributes:
        store: the mailbox's URL.
        key: the key or list prefix of the request.
        operation: ``get``, ``put``, ``create``, ``list``, ``delete`` or ``open``.
    """

    def __init__(self, message: str, *, store: str, key: str, operation: str) -> None:
        self.store = store
        self.key = key
        self.operation = operation
        super().__init__(f"{operation} {key!r} on {store}: {message}")


class TransientMailboxError(MailboxError):
    """A failure that may pass: the caller may retry the same request.

    A write that raises this may or may not have landed; ``put`` is idempotent, and a retried
    ``create`` that returns False should be read back (its data carries the writer's nonce).
    """


class StoreUnavailable(MailboxError):
    """Every try of a request failed transiently for longer than the node's outage limit
    (``Session(outage_timeout=...)``): the store is taken to be gone, and the node stops.

    Attributes beyond ``MailboxError``'s: ``seconds`` the request kept failing, ``tries``."""

    def __init__(
        self, message: str, *, store: str, key: str, operation: str, seconds: float, tries: int
    ) -> None:
        self.seconds = seconds
        self.tries = tries
        super().__init__(message, store=store, key=key, operation=operation)


class TooLarge(MailboxError):
    """The object at ``key`` is larger than the ``limit`` its reader gave ``get``; at most
    ``limit`` bytes of it were transferred.

    Attributes beyond ``MailboxError``'s: ``size`` (bytes; at least ``limit + 1``, the whole
    object's size where the store says it) and ``limit``."""

    def __init__(self, *, store: str, key: str, size: int, limit: int) -> None:
        self.size = size
        self.limit = limit
        super().__init__(
            f"object of {size} bytes exceeds the bound of {limit} bytes; not downloaded",
            store=store,
            key=key,
            operation="get",
        )


class BadKey(MailboxError, ValueError):
    """A key or prefix outside the documented charset or length; nothing was sent."""


def validate_key(key: str, *, store: str = "?", operation: str = "?") -> str:
    """Return ``key`` unchanged if it is a valid mailbox key, else raise :class:`BadKey`.

    Valid: ``/``-separated segments of ``[A-Za-z0-9._-]``, none empty, ``.`` or ``..``, none
    longer than 255 bytes, no leading or trailing ``/``, at most 1024 bytes in all.
    """
    problem = _key_problem(key)
    if problem is not None:
        raise BadKey(problem, store=store, key=key, operation=operation)
    return key


def validate_prefix(prefix: str, *, store: str = "?", operation: str = "list") -> str:
    """Return ``prefix`` unchanged if it can prefix keys for ``list``, else raise :class:`BadKey`.

    A prefix is ``""``, a valid key, or a valid key followed by ``/``. It matches keys as a plain
    string prefix (``rounds/0000`` matches ``rounds/00001/commit``).
    """
    body = prefix[:-1] if prefix.endswith("/") else prefix
    problem = None if prefix == "" else _key_problem(body)
    if problem is not None:
        raise BadKey(f"bad list prefix: {problem}", store=store, key=prefix, operation=operation)
    return prefix


def is_valid_key(key: str) -> bool:
    """Whether ``key`` is a valid key; lists skip foreign objects and temporaries that fail."""
    return _key_problem(key) is None


def _key_problem(key: str) -> str | None:
    # Every request checks its key, and a node asks for the same few keys again and again.
    return _str_key_problem(key) if type(key) is str else _any_key_problem(key)


@functools.lru_cache(maxsize=8192)
def _str_key_problem(key: str) -> str | None:
    return _any_key_problem(key)


def _any_key_problem(key: str) -> str | None:
    if (
        isinstance(key, str)
        and len(key) <= MAX_KEY_BYTES
        and _PLAIN_KEY.fullmatch(key) is not None
        and ("." not in key or all(s not in (".", "..") for s in key.split("/")))
    ):
        return None
    if not isinstance(key, str):
        return f"a key is a str, not {type(key).__name__}"
    if key == "":
        return "the key is empty"
    if len(key.encode()) > MAX_KEY_BYTES:
        return f"the key is longer than {MAX_KEY_BYTES} bytes"
    if key.startswith("/"):
        return "a key must not start with '/' (keys are relative to the mailbox)"
    for segment in key.split("/"):
        if segment in ("", ".", ".."):
            return f"segment {segment!r} is not allowed (no empty, '.' or '..' segments)"
        if _SEGMENT.fullmatch(segment) is None:
            return f"segment {segment!r} has characters outside [A-Za-z0-9._-]"
        if len(segment) > MAX_SEGMENT_BYTES:
            return f"a segment is longer than {MAX_SEGMENT_BYTES} bytes"
    return None


@attrs.frozen(kw_only=True)
class ObjectInfo:
    """One object as ``list`` reports it.

    Attributes:
        key: the object's key.
        size: its length in bytes.
        version: an opaque string that changes whenever the object is overwritten: an etag for
            object stores (a rewrite with identical bytes may keep it); mtime, size and inode for
            directories (two same-size rewrites within one filesystem timestamp tick, a few
            milliseconds, that reuse the inode may keep it); a counter in memory.
        modified: when the object was last written, in seconds: Unix time for directories and
            object stores (the store's clock), the mailbox clock's time in memory; None where a
            store does not say. ``gradientmail gc``'s time horizon reads it.
        md5: the MD5 of the object's bytes, lowercase hex, where the listing says it: an S3 or
            GCS etag that is a plain MD5 (an object written in one request without SSE-KMS);
            objects up to 64 KiB in memory; None elsewhere (directories, Azure). Observers
            recognize a lease renewal from it without a GET (``core.leases``).
    """

    key: str
    size: int
    version: str
    modified: float | None = None
    md5: str | None = None


class RequestStats:
    """Requests a mailbox sent, by kind, and the payload bytes it moved; safe across threads.

    ``bytes_in`` counts object bytes read from the store (``get`` bodies, read-backs);
    ``bytes_out`` counts object bytes written to it (``put`` and ``create`` bodies). A request
    the store's client retried internally counts once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys((*_KINDS, "bytes_in", "bytes_out"), 0)

    def count(self, kind: str, *, bytes_in: int = 0, bytes_out: int = 0) -> None:
        """Record one request of ``kind`` (get, put, create, list or delete)."""
        if kind not in _KINDS:
            raise ValueError(f"unknown request kind {kind!r}; expected one of {_KINDS}")
        with self._lock:
            self._counts[kind] += 1
            self._counts["bytes_in"] += bytes_in
            self._counts["bytes_out"] += bytes_out

    def snapshot(self) -> dict[str, int]:
        """The counters now: get, put, create, list, delete, bytes_in, bytes_out."""
        with self._lock:
            return dict(self._counts)

    def __getitem__(self, name: str) -> int:
        """One counter by name, as in :meth:`snapshot`."""
        with self._lock:
            return self._counts[name]

    def __repr__(self) -> str:
        return f"RequestStats({self.snapshot()})"


@runtime_checkable
class Mailbox(Protocol):
    """Where the nodes of a run meet. Every method validates its key first (:class:`BadKey`).

    Implementations: :class:`~gradientmail.mailboxes.MemoryMailbox`,
    :class:`~gradientmail.mailboxes.DirectoryMailbox`,
    :class:`~gradientmail.mailboxes.ObjectStoreMailbox`; any other must pass
    :func:`gradientmail.testing.check_mailbox`. Methods may be awaited from several event loops
    in different threads at once.
    """

    url: str
    """Where the mailbox lives, as :func:`~gradientmail.mailboxes.mailbox_from_url` accepts it."""

    stats: RequestStats
    """Requests sent through this handle."""

    async def get(self, key: str, *, limit: int | None = None) -> bytes | None:
        """The object's bytes, or None if there is no object at ``key``. Never partial.

        ``limit`` (bytes): an object larger than this raises :class:`TooLarge` after at most
        ``limit`` bytes of it were transferred (a ranged GET, or the file's size read first),
        so a reader bounds what a hostile or corrupt object can cost it."""
        ...

    async def put(self, key: str, data: bytes, *, durable: bool = True) -> None:
        """Write ``data`` at ``key``, replacing any object; readers see the old or the new.

        ``durable=False``: the caller can do without the object should the machine holding the
        store crash (see ``create``)."""
        ...

    async def create(self, key: str, data: bytes, *, durable: bool = True) -> bool:
        """Write ``data`` at ``key`` only if absent: True if this call wrote it, else False.

        ``data`` must be unique to the writer (embed a nonce): an ambiguous outcome (timeout,
        retried request, conflict) is resolved by reading the object back and comparing bytes.

        ``durable=False`` asks for no more than atomic visibility: readers still see all of
        ``data`` or nothing, but after a crash of the machine holding the store (power loss,
        kernel panic; not a crash of the writing process) the object may be missing, empty or
        cut short. A store that is durable anyway ignores it; a directory skips its fsyncs.
        """
        ...

    async def list(self, prefix: str, *, after: str | None = None) -> list[ObjectInfo]:
        """Objects whose keys start with ``prefix`` (a plain string prefix, recursive), sorted
        by key, only keys greater than ``after`` when given."""
        ...

    async def delete(self, key: str) -> None:
        """Remove the object at ``key``; a missing key is not an error."""
        ...

    async def close(self) -> None:
        """Release the handle's resources; the stored objects stay."""
        ...
