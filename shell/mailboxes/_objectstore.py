"""A mailbox in an object store (S3, GCS, Azure Blob, R2, MinIO) through ``obstore``.

``create`` is the store's conditional put (``PutMode "create"``: S3 and R2 send
``If-None-Match: *``, GCS ``ifGenerationMatch=0``, Azure ``If-None-Match: *``), which S3 has
guaranteed since August 2024: exactly one of several racing creates gets 200, the others 412.

Its outcome can be ambiguous: the client may retry a request whose first attempt landed (the
retry then gets 412 for our own object), a timeout hides whether the object was written, and S3
answers 409 ConditionalRequestConflict to racing creates, which obstore reports as
``AlreadyExistsError`` although nothing may be stored. Every such case is resolved the same way:
read the object back and compare it byte for byte with what this call wrote (the protocol's data
always embeds the writer's nonce, so equal bytes mean this call won); if there is no object, the
create is sent again.
"""

from __future__ import annotations

import asyncio
import io
import random
import re
from collections.abc import Awaitable, Callable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import obstore
from obstore import exceptions as obstore_errors

from gradientmail.mailboxes._protocol import (
    Data,
    MailboxError,
    ObjectInfo,
    RequestStats,
    TooLarge,
    TransientMailboxError,
    data_size,
    is_valid_key,
    joined,
    validate_key,
    validate_prefix,
)

if TYPE_CHECKING:
    from obstore import GetResult, ObjectMeta
    from obstore.store import ClientConfig, ObjectStore, RetryConfig
    from typing_extensions import Buffer

__all__ = [
    "CLOUD_SCHEMES",
    "PARTS_IN_FLIGHT",
    "PART_BYTES",
    "STREAM_ABOVE",
    "ObjectStoreMailbox",
    "open_store",
]

CLOUD_SCHEMES = ("s3", "s3a", "gs", "az", "azure", "abfs", "abfss")
"""URL schemes :class:`ObjectStoreMailbox` opens."""

# obstore retries 5xx answers, dropped connections and timeouts of safe requests itself, with
# exponential backoff and jitter; these bound it so a dead store surfaces within about a minute.
DEFAULT_RETRY: RetryConfig = {
    "max_retries": 5,
    "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=5)},
    "retry_timeout": timedelta(seconds=60),
}
# A whole request, body included, must finish within `timeout`: 64 MiB at 1 MB/s takes 64 s.
DEFAULT_CLIENT: ClientConfig = {"connect_timeout": timedelta(seconds=5), "timeout": "300s"}

_CLIENT_KEYS = {"allow_http", "allow_invalid_certificates", "timeout", "connect_timeout"}
_BOOLEAN = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
_PERMANENT = (
    obstore_errors.PermissionDeniedError,
    obstore_errors.UnauthenticatedError,
    obstore_errors.InvalidPathError,
    obstore_errors.NotSupportedError,
    obstore_errors.UnknownConfigurationKeyError,
)
# 4xx answers that a retry may cure: timeout, conflict, too many requests.
_RETRYABLE_4XX = {"408", "409", "429"}
_STATUS = re.compile(r"status code: (\d{3})")
_STREAM_CHUNK = 8 * 2**20
PART_BYTES = 16 * 2**20
"""Parts of a multipart upload (bytes): a ``put`` above this is sent in parts."""
PARTS_IN_FLIGHT = 4
"""Parts of one upload sent at once."""
STREAM_ABOVE = 16 * 2**20
"""A ``get`` of this many bytes or more streams into its result (bytes)."""
# What a failed request raises: obstore's errors, and OSError for I/O, connection and timeouts.
_REQUEST_ERRORS = (obstore_errors.BaseError, OSError)

_T = TypeVar("_T")
_Listing = list[ObjectInfo]  # spelled out here: inside the class, `list` is the method


def open_store(
    url: str,
    *,
    client_options: ClientConfig | None = None,
    retry_config: RetryConfig | None = None,
    **config: str,
) -> ObjectStore:
    """An obstore store for ``url``, e.g. ``s3://bucket/prefix?endpoint=http://host:9000``.

    Query parameters are store configuration (``endpoint``, ``region``, GCS ``base_url``, any
    key obstore documents for the scheme) except ``allow_http``, ``allow_invalid_certificates``,
    ``timeout`` and ``connect_timeout``, which configure the HTTP client. An ``http://``
    endpoint turns on ``allow_http``. Credentials come from the usual environment variables
    (``AWS_ACCESS_KEY_ID``, ``GOOGLE_APPLICATION_CREDENTIALS``, ``AZURE_STORAGE_ACCOUNT_KEY``, ...).
    """
    parts = urlsplit(url)
    if parts.scheme not in CLOUD_SCHEMES:
        raise ValueError(f"{url!r}: an object-store URL starts with one of {CLOUD_SCHEMES}")
    client: dict[str, Any] = {**DEFAULT_CLIENT, **(client_options or {})}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name in _CLIENT_KEYS:
            client[name] = _BOOLEAN.get(value.lower(), value)
        else:
            config[name] = value
    if any(str(value).startswith("http://") for value in config.values()):
        client.setdefault("allow_http", True)
    bare = urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
    try:
        settings = cast(dict[str, Any], config)  # obstore checks names and values itself
        return obstore.store.from_url(
            bare,
            client_options=cast("ClientConfig", client),
            retry_config=retry_config or DEFAULT_RETRY,
            **settings,
        )
    except (obstore_errors.BaseError, ValueError) as error:
        raise ValueError(f"cannot open {url!r}: {_first_line(error)}") from error


class ObjectStoreMailbox:
    """A mailbox in an object store.

    ``put`` takes ``Data`` in parts (``takes_parts``) and streams a large one into a multipart
    upload a part's size at a time; ``create`` joins them (one conditional request).

    Args:
        target: a URL as :func:`open_store` takes, or an obstore store object (``S3Store``,
            ``MemoryStore``, ``LocalStore``, ...).
        url: how messages name the mailbox; defaults to ``target`` or a description of it.
        attempts: how many times a request that failed transiently (after obstore's own
            retries) is sent in all, with exponential backoff from 0.1 s; at least 1.
        client_options, retry_config, config: passed to :func:`open_store` with a URL.
    """

    takes_parts = True

    def __init__(
        self,
        target: str | ObjectStore,
        *,
        url: str | None = None,
        attempts: int = 3,
        client_options: ClientConfig | None = None,
        retry_config: RetryConfig | None = None,
        **config: str,
    ) -> None:
        if attempts < 1:
            raise ValueError(f"attempts must be at least 1, got {attempts}")
        if isinstance(target, str):
            self._store = open_store(
                target, client_options=client_options, retry_config=retry_config, **config
            )
        else:
            self._store = target
        self.url = url or (target if isinstance(target, str) else _describe(target))
        self.stats = RequestStats()
        self._attempts = attempts

    async def get(self, key: str, *, limit: int | None = None) -> bytes | None:
        """The object's bytes, or None. An object of ``STREAM_ABOVE`` bytes or more streams,
        on a worker thread, straight into the one ``bytes`` returned (see ``_ChunkReader``), so
        memory peaks at its size plus one chunk; a smaller one is downloaded whole, then
        copied into ``bytes``."""
        validate_key(key, store=self.url, operation="get")
        return await self._retry("get", key, lambda: self._get(key, limit))

    async def put(self, key: str, data: Data, *, durable: bool = True) -> None:
        validate_key(key, store=self.url, operation="put")
        await self._retry("put", key, lambda: self._put(key, data))

    async def create(self, key: str, data: Data, *, durable: bool = True) -> bool:
        """``Mailbox.create``; parts are joined first (a conditional create is one request,
        and an ambiguous one is resolved by comparing the bytes read back)."""
        validate_key(key, store=self.url, operation="create")
        whole = joined(data)
        return await self._retry("create", key, lambda: self._create(key, whole))

    async def delete(self, key: str) -> None:
        validate_key(key, store=self.url, operation="delete")
        await self._retry("delete", key, lambda: self._delete(key))

    async def list(self, prefix: str, *, after: str | None = None) -> list[ObjectInfo]:
        validate_prefix(prefix, store=self.url)
        return await self._retry("list", prefix, lambda: self._list(prefix, after))

    async def close(self) -> None:
        """Nothing to release: obstore pools connections per store and frees them with it."""

    def __repr__(self) -> str:
        return f"ObjectStoreMailbox({self.url!r})"

    async def _retry(self, operation: str, key: str, send: Callable[[], Awaitable[_T]]) -> _T:
        for attempt in range(self._attempts):
            try:
                return await send()
            except TransientMailboxError:
                if attempt + 1 == self._attempts:
                    raise
            except MailboxError:
                raise
            except _REQUEST_ERRORS as error:
                mapped = self._error(error, operation, key)
                if attempt + 1 == self._attempts or not isinstance(mapped, TransientMailboxError):
                    raise mapped from error
            await asyncio.sleep(0.1 * 2**attempt * (0.5 + random.random()))
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _get(self, key: str, limit: int | None) -> bytes | None:
        received = 0
        try:
            result = await self._open(key, limit)
            size = result.meta["size"]  # the whole object's, also for a ranged GET
            if limit is not None and size > limit:
                raise TooLarge(store=self.url, key=key, size=size, limit=limit)
            if size >= STREAM_ABOVE:
                data = await asyncio.to_thread(_read_stream, result, size)
            else:
                data = (await result.bytes_async()).to_bytes()
            received = len(data)
            return data
        except FileNotFoundError as error:
            self._raise_if_no_bucket(error, "get", key)
            return None
        finally:
            self.stats.count("get", bytes_in=received)

    async def _open(self, key: str, limit: int | None) -> GetResult:
        """A GET of ``key``; with ``limit``, of its first ``limit`` bytes (an empty object
        answers such a range with an error, and is fetched whole, which costs nothing)."""
        if limit is None or limit < 1:
            return await obstore.get_async(self._store, key)
        try:
            return await obstore.get_async(self._store, key, options={"range": (0, limit)})
        except obstore_errors.BaseError as error:
            if not _range_refused(error):
                raise  # anything else is the request's failure, for the caller to map
            return await obstore.get_async(self._store, key)

    async def _put(self, key: str, data: Data) -> None:
        # Above PART_BYTES obstore uploads in parts (multipart upload, block list), sending
        # slices of `data` (or of each of its parts, gathered a part's size at a time) without
        # copying it whole; an interrupted upload leaves no object.
        size = data_size(data)
        self.stats.count("put", bytes_out=size)
        body: bytes | list[memoryview]
        if isinstance(data, bytes) or size <= PART_BYTES:
            body = joined(data)
        else:
            body = [memoryview(part).cast("B") for part in data if len(part)]
        await obstore.put_async(
            self._store, key, body, chunk_size=PART_BYTES, max_concurrency=PARTS_IN_FLIGHT
        )

    async def _create(self, key: str, data: bytes) -> bool:
        self.stats.count("create", bytes_out=len(data))
        try:
            await obstore.put_async(self._store, key, data, mode="create")
            return True
        except (obstore_errors.AlreadyExistsError, obstore_errors.PreconditionError) as error:
            failure: MailboxError = TransientMailboxError(
                f"conflicting concurrent write, retry: {_first_line(error)}",
                store=self.url, key=key, operation="create",
            )  # fmt: skip
        except FileNotFoundError as error:
            self._raise_if_no_bucket(error, "create", key)
            raise self._error(error, "create", key) from error
        except _REQUEST_ERRORS as error:
            failure = self._error(error, "create", key)
            if not isinstance(failure, TransientMailboxError):
                raise failure from error
        ours = await self._holds(key, data)
        if ours is None:
            raise failure  # nothing landed (yet): the caller or our retry may send it again
        return ours

    async def _holds(self, key: str, data: bytes) -> bool | None:
        """Whether the object at ``key`` is exactly ``data``; None if there is none.

        Streams and compares chunk by chunk, so a large payload is not held twice.
        """
        received = 0
        try:
            result = await obstore.get_async(self._store, key)
            if result.meta["size"] != len(data):
                return False
            expected = memoryview(data)
            async for chunk in result.stream(min_chunk_size=_STREAM_CHUNK):
                if expected[received : received + len(chunk)] != chunk:
                    return False
                received += len(chunk)
            return received == len(data)
        except FileNotFoundError:
            return None
        finally:
            self.stats.count("get", bytes_in=received)

    async def _delete(self, key: str) -> None:
        self.stats.count("delete")
        try:
            await obstore.delete_async(self._store, key)
        except FileNotFoundError:
            return  # S3 answers 204 for a missing key; local stores raise

    async def _list(self, prefix: str, after: str | None) -> _Listing:
        self.stats.count("list")
        # obstore matches prefixes by whole path segments; list the enclosing "directory" and
        # filter by the plain string prefix here. S3 lists from `offset` (start-after) on.
        directory = prefix.rpartition("/")[0]
        stream = obstore.list(self._store, directory or None, offset=after, chunk_size=1000)
        infos = [
            _object_info(meta)
            async for batch in stream
            for meta in batch
            if _wanted(meta["path"], prefix, after)
        ]
        infos.sort(key=lambda info: info.key)
        return infos

    def _error(self, error: BaseException, operation: str, key: str) -> MailboxError:
        message = _first_line(error)
        status = _STATUS.search(str(error))
        permanent = isinstance(error, _PERMANENT) or (
            status is not None and status[1].startswith("4") and status[1] not in _RETRYABLE_4XX
        )
        kind = MailboxError if permanent else TransientMailboxError
        return kind(message, store=self.url, key=key, operation=operation)

    def _raise_if_no_bucket(self, error: FileNotFoundError, operation: str, key: str) -> None:
        # S3 answers 404 NoSuchBucket for a missing bucket; that is a setup error, not "absent".
        if "NoSuchBucket" in str(error):
            raise MailboxError(
                "the bucket does not exist", store=self.url, key=key, operation=operation
            ) from error


class _ChunkReader(io.RawIOBase):
    """A raw reader over a download's chunks, for ``io.BufferedReader.read(size)``: that call
    allocates the ``bytes`` it returns once, at full size, and has this reader fill it in
    place (``readinto``), so the object is never held twice."""

    def __init__(self, chunks: Iterator[Buffer]) -> None:
        self._chunks = chunks
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Buffer) -> int:
        if not self._pending:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._pending = memoryview(chunk).cast("B")
        out = memoryview(buffer).cast("B")
        n = min(len(out), len(self._pending))
        out[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n


def _read_stream(result: GetResult, size: int) -> bytes:
    chunks = iter(result.stream(min_chunk_size=_STREAM_CHUNK))
    data = io.BufferedReader(_ChunkReader(chunks), buffer_size=_STREAM_CHUNK).read(size)
    if len(data) != size:
        raise OSError(f"the download ended after {len(data)} of {size} bytes")
    return data


def _range_refused(error: BaseException) -> bool:
    """Whether a ranged GET failed for its range (HTTP 416, or a local store's "invalid
    range"), as on an empty object; not for a failure of the request itself."""
    status = _STATUS.search(str(error))
    return (status is not None and status[1] == "416") or "range" in _first_line(error).lower()


def _wanted(key: str, prefix: str, after: str | None) -> bool:
    return key.startswith(prefix) and (after is None or key > after) and is_valid_key(key)


def _object_info(meta: ObjectMeta) -> ObjectInfo:
    version = meta["e_tag"] or meta["version"] or f"{meta['last_modified'].timestamp()}"
    etag = (meta["e_tag"] or "").strip('"').lower()
    return ObjectInfo(
        key=meta["path"],
        size=meta["size"],
        version=f"{version}-{meta['size']}",
        modified=meta["last_modified"].timestamp(),
        md5=etag if _MD5.fullmatch(etag) else None,
    )


# An etag that is an MD5 of the bytes: S3 and GCS (XML API) for an object written in one
# request without SSE-KMS. Multipart etags ("...-3") and Azure's ("0x8D...") are not.
_MD5 = re.compile(r"[0-9a-f]{32}")


def _describe(store: ObjectStore) -> str:
    prefix = getattr(store, "prefix", None)
    return f"obstore:{type(store).__name__}" + (f":{prefix}" if prefix else "")


def _first_line(error: BaseException) -> str:
    return str(error).strip().split("\n", 1)[0][:500]
