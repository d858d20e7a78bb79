"""ObjectStoreMailbox: URLs, errors, and creates whose outcome the network hid.

The ambiguous cases run against the real moto server through a small TCP proxy that loses
what a flaky network loses: the reply to a conditional PUT that landed, or the request itself,
or a 409 ConditionalRequestConflict in place of an answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pytest
from obstore.store import MemoryStore, S3Store

from gradientmail.mailboxes._objectstore import ObjectStoreMailbox, open_store
from gradientmail.mailboxes._protocol import MailboxError, TransientMailboxError
from gradientmail.testing._s3 import with_prefix

_CONFLICT_BODY = (
    b"<Error><Code>ConditionalRequestConflict</Code><Message>retry the upload</Message></Error>"
)
CONFLICT = (
    b"HTTP/1.1 409 Conflict\r\nContent-Type: application/xml\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(_CONFLICT_BODY), _CONFLICT_BODY)
)


class FlakyProxy:
    """Forwards TCP to ``upstream``; spoils the next conditional PUTs as told.

    Each budget counts conditional PUTs (those with ``If-None-Match``): ``lose_replies`` are
    delivered but their answers dropped with the connection; ``drop_requests`` never reach the
    server; ``conflicts`` are answered 409 by the proxy without reaching the server.
    """

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.lose_replies = self.drop_requests = self.conflicts = 0
        self.spoiled = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            lose_reply = threading.Event()
            threading.Thread(target=self._requests, args=(client, server, lose_reply)).start()
            threading.Thread(target=self._replies, args=(server, client, lose_reply)).start()

    def _spoil(self, chunk: bytes) -> str | None:
        if b"if-none-match" not in chunk.lower():
            return None
        with self._lock:
            for budget in ("drop_requests", "conflicts", "lose_replies"):
                if getattr(self, budget) > 0:
                    setattr(self, budget, getattr(self, budget) - 1)
                    self.spoiled += 1
                    return budget
        return None

    def _requests(
        self, client: socket.socket, server: socket.socket, lose: threading.Event
    ) -> None:
        while chunk := _receive(client):
            spoil = self._spoil(chunk)
            if spoil == "conflicts":
                _read_request(client, chunk)
                client.sendall(CONFLICT)
            if spoil in ("drop_requests", "conflicts"):
                break
            if spoil == "lose_replies":
                lose.set()
            server.sendall(chunk)
        _hang_up(client, server)

    def _replies(self, server: socket.socket, client: socket.socket, lose: threading.Event) -> None:
        # A reply to a spoiled request means the write landed; the client never hears of it.
        while (chunk := _receive(server)) and not lose.is_set():
            try:
                client.sendall(chunk)
            except OSError:
                break
        _hang_up(client, server)


def _receive(connection: socket.socket) -> bytes:
    try:
        return connection.recv(1 << 16)
    except OSError:
        return b""


def _read_request(client: socket.socket, received: bytes) -> None:
    """Read the rest of a request whose start is ``received``, so the client sees our answer."""
    while b"\r\n\r\n" not in received:
        received += _receive(client)
    head, _, body = received.partition(b"\r\n\r\n")
    length = re.search(rb"(?i)content-length: *(\d+)", head)
    missing = int(length[1]) - len(body) if length else 0
    while missing > 0 and (chunk := _receive(client)):
        missing -= len(chunk)


def _hang_up(*connections: socket.socket) -> None:
    for connection in connections:
        with contextlib.suppress(OSError):
            connection.shutdown(socket.SHUT_RDWR)  # wakes the other pump blocked in recv
        connection.close()


@contextmanager
def flaky_url(url: str) -> Iterator[tuple[str, FlakyProxy]]:
    """``url`` rerouted through a :class:`FlakyProxy` in front of its endpoint."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    endpoint = urlsplit(query["endpoint"])
    assert endpoint.hostname is not None and endpoint.port is not None
    proxy = FlakyProxy((endpoint.hostname, endpoint.port))
    query["endpoint"] = f"http://127.0.0.1:{proxy.port}"
    try:
        yield urlunsplit(parts._replace(query=urlencode(query, safe=":/"))), proxy
    finally:
        proxy.close()


@pytest.mark.s3
@pytest.mark.parametrize("spoil", ["lose_replies", "drop_requests", "conflicts"])
def test_an_ambiguous_create_is_resolved_by_reading_back(moto_url: str, spoil: str) -> None:
    async def main() -> None:
        with flaky_url(moto_url) as (url, proxy):
            mailbox = ObjectStoreMailbox(url)
            setattr(proxy, spoil, 1)
            assert await mailbox.create("rounds/1/snapshots/a", b"nonce 1f2e") is True
            assert proxy.spoiled == 1
            # A 409 stored nothing: the read-back finds no object and the create is sent again.
            assert mailbox.stats["create"] == (2 if spoil == "conflicts" else 1)
            setattr(proxy, spoil, 1)
            assert await mailbox.create("rounds/1/snapshots/a", b"nonce 9c8b") is False
        assert await ObjectStoreMailbox(moto_url).get("rounds/1/snapshots/a") == b"nonce 1f2e"

    asyncio.run(main())


@pytest.mark.s3
def test_a_create_whose_reply_is_lost_reads_the_object_back(moto_url: str) -> None:
    async def main() -> None:
        with flaky_url(moto_url) as (url, proxy):
            mailbox = ObjectStoreMailbox(url)
            proxy.lose_replies = 1
            assert await mailbox.create("commit", b"x" * 3_000_000) is True
            counts = mailbox.stats.snapshot()
        assert counts["get"] == 1 and counts["bytes_in"] == 3_000_000, counts

    asyncio.run(main())


@pytest.mark.s3
def test_a_race_lost_to_another_writer_stays_lost(moto_url: str) -> None:
    async def main() -> None:
        other = ObjectStoreMailbox(moto_url)
        assert await other.create("claims/0000", b"theirs") is True
        with flaky_url(moto_url) as (url, proxy):
            proxy.lose_replies = 1
            assert await ObjectStoreMailbox(url).create("claims/0000", b"ours") is False
        assert await other.get("claims/0000") == b"theirs"

    asyncio.run(main())


@pytest.mark.s3
def test_a_missing_bucket_is_a_setup_error(s3_server_url: str) -> None:
    parts = urlsplit(s3_server_url)
    url = urlunsplit(parts._replace(netloc="no-such-bucket"))
    mailbox = ObjectStoreMailbox(url)
    with pytest.raises(MailboxError) as caught:
        asyncio.run(mailbox.get("manifest"))
    assert not isinstance(caught.value, TransientMailboxError)
    assert "no-such-bucket" in str(caught.value) and "manifest" in str(caught.value)


def test_an_unreachable_store_is_a_transient_error() -> None:
    mailbox = ObjectStoreMailbox(
        "s3://bucket/run?endpoint=http://127.0.0.1:9",
        attempts=2,
        retry_config={"max_retries": 0},
    )
    with pytest.raises(TransientMailboxError) as caught:
        asyncio.run(mailbox.create("manifest", b"x"))
    assert caught.value.operation == "create" and caught.value.key == "manifest"
    assert mailbox.stats.snapshot()["create"] == 2, "each attempt counts"


def test_open_store_reads_settings_from_the_query() -> None:
    store = open_store("s3://bucket/runs/a?endpoint=http://127.0.0.1:9000&region=auto")
    assert isinstance(store, S3Store)
    assert store.prefix == "runs/a"
    assert store.config["endpoint"] == "http://127.0.0.1:9000"
    assert store.config["region"] == "auto"
    assert store.client_options is not None
    assert str(store.client_options["allow_http"]).lower() == "true", "an http endpoint allows http"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("s3://bucket/run?bogus=1", "bogus"),
        ("ftp://bucket/run", "starts with one of"),
    ],
)
def test_open_store_rejects_bad_urls(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        open_store(url)
    assert url in str(caught.value)


def test_a_store_object_is_named_by_its_kind() -> None:
    assert ObjectStoreMailbox(MemoryStore()).url == "obstore:MemoryStore"
    assert ObjectStoreMailbox(MemoryStore(), url="memory://mine").url == "memory://mine"


def test_attempts_must_be_positive() -> None:
    with pytest.raises(ValueError, match="attempts"):
        ObjectStoreMailbox(MemoryStore(), attempts=0)


def test_with_prefix_keeps_the_endpoint() -> None:
    url = "s3://b/one?endpoint=http://127.0.0.1:1&region=us-east-1"
    assert (
        with_prefix(url, "two/three")
        == "s3://b/two/three?endpoint=http://127.0.0.1:1&region=us-east-1"
    )
