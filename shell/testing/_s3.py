"""A local S3 for tests: moto's server on 127.0.0.1, usable without pytest."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from urllib.parse import urlencode, urlsplit, urlunsplit

__all__ = ["moto_s3", "with_prefix"]

_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
}
# Real settings that would send requests elsewhere or sign them with real credentials.
_CLEARED = (
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_PROFILE",
    "AWS_ENDPOINT",
    "AWS_ENDPOINT_URL",
)

_WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


@contextlib.contextmanager
def moto_s3(bucket: str = "gradientmail", prefix: str = "mailbox") -> Iterator[str]:
    """Run a moto S3 server on 127.0.0.1 and yield ``s3://bucket/prefix?endpoint=...``.

    Sets test credentials in the environment for the duration (restoring it after), creates
    ``bucket``, and stops the server on exit. Use :func:`with_prefix` for isolated mailboxes in
    one bucket.
    """
    from moto.server import ThreadedMotoServer

    with _environment(_CREDENTIALS, _CLEARED), _quiet("werkzeug"):
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            _serialize_conditional_writes(server)
            host, port = server.get_host_and_port()
            endpoint = f"http://{host}:{port}"
            _create_bucket(endpoint, bucket)
            yield f"s3://{bucket}/{prefix}?" + urlencode(
                {"endpoint": endpoint, "region": _CREDENTIALS["AWS_REGION"]}, safe=":/"
            )
        finally:
            server.stop()


def with_prefix(url: str, prefix: str) -> str:
    """``url`` with its path replaced by ``prefix`` (query kept): another mailbox, same bucket."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + prefix.strip("/"), parts.query, ""))


def _create_bucket(endpoint: str, bucket: str) -> None:
    import boto3  # type: ignore[import-untyped]  # moto depends on it

    client = boto3.client("s3", endpoint_url=endpoint, region_name=_CREDENTIALS["AWS_REGION"])
    client.create_bucket(Bucket=bucket)


def _serialize_conditional_writes(server: Any) -> None:
    """Make moto's If-None-Match check and its write one atomic step, as S3 documents.

    moto checks the precondition, then writes, in separate steps on a threaded server, so two
    racing creates could both pass the check; real S3 guarantees one winner.
    """
    wsgi_server = getattr(server, "_server", None)
    if wsgi_server is None:
        return
    app: _WsgiApp = wsgi_server.app
    lock = threading.Lock()

    def serialized(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        conditional = environ.get("HTTP_IF_NONE_MATCH") or environ.get("HTTP_IF_MATCH")
        if environ.get("REQUEST_METHOD") not in ("PUT", "POST") or not conditional:
            return app(environ, start_response)
        with lock:
            return list(app(environ, start_response))

    wsgi_server.app = serialized


@contextlib.contextmanager
def _environment(values: dict[str, str], cleared: Iterable[str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in (*values, *cleared)}
    os.environ.update(values)
    for name in cleared:
        os.environ.pop(name, None)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
