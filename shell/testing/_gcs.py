"""A local Google Cloud Storage for tests: gcp-storage-emulator on 127.0.0.1, usable without pytest.

obstore's GCS client (Rust ``object_store``) speaks only GCS's XML API (since arrow-rs#4207:
the XML API has the full set of preconditions and list offsets), while gcp-storage-emulator
implements the JSON API and, of the XML API, only an object GET and PUT, without the ``ETag``
header object_store requires, and with no preconditions in either API. So this module runs the
emulator's own storage and JSON routes in-process, and serves on top of them the XML requests
obstore sends, as GCS documents them:

- ``PUT /bucket/object``, honouring ``x-goog-if-generation-match`` (``0``: only if absent;
  otherwise 412 ``PreconditionFailed``), answering with ``ETag`` and ``x-goog-generation``;
- ``GET`` and ``HEAD /bucket/object`` (with ``Range``), ``DELETE /bucket/object``;
- ``GET /bucket?list-type=2`` with ``prefix``, ``start-after`` and continuation tokens;
- multipart uploads (``POST ?uploads``, ``PUT ?partNumber=&uploadId=``, ``POST ?uploadId=``,
  ``DELETE ?uploadId=``), whose parts stay invisible until completed.

Requests are served one at a time (a lock around each), so a precondition check and its write
are one atomic step, as on GCS. docs/operations.md says what this means for what the tests show.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import secrets
import tempfile
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from email.utils import format_datetime
from functools import partial
from http import HTTPStatus
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit
from xml.sax.saxutils import escape

__all__ = ["gcs_emulator"]

_LIST_PAGE = 1000
_OBJECT = re.compile(r"^/(?P<bucket>[-.\w]+)/(?P<name>.+)$")
_BUCKET = re.compile(r"^/(?P<bucket>[-.\w]+)/?$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


@contextlib.contextmanager
def gcs_emulator(bucket: str = "gradientmail", prefix: str = "mailbox") -> Iterator[str]:
    """Run the GCS emulator on 127.0.0.1 and yield ``gs://bucket/prefix?service_account=...``.

    The URL names a service-account file (written to a temporary directory, removed on exit)
    that points obstore at the emulator (``gcs_base_url``) with OAuth off, so the URL alone
    opens the mailbox in any process on this machine.
    """
    from gcp_storage_emulator import server as emulator
    from gcp_storage_emulator.handlers import buckets
    from gcp_storage_emulator.storage import Storage

    storage = Storage(use_memory_fs=True)
    buckets.create_bucket(bucket, storage)
    handler: Any = _handler_class(emulator.RequestHandler)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(handler, storage))
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, name="gcs-emulator", daemon=True)
    thread.start()
    host, port = httpd.server_address[:2]
    with tempfile.TemporaryDirectory(prefix="gcs-emulator-") as directory:
        account = os.path.join(directory, "service-account.json")
        with open(account, "w") as file:
            json.dump(
                {
                    "gcs_base_url": f"http://{host!s}:{port}",
                    "disable_oauth": True,
                    "client_email": "",
                    "private_key": "",
                    "private_key_id": "",
                },
                file,
            )
        try:
            yield f"gs://{bucket}/{prefix}?" + urlencode(
                {"service_account": account, "allow_http": "true"}, safe="/"
            )
        finally:
            httpd.shutdown()
            httpd.server_close()
            thread.join(timeout=5)


def _handler_class(base: type[Any]) -> type[Any]:
    """The emulator's request handler with the XML API in front of its JSON routes."""
    lock = threading.Lock()
    uploads: dict[str, tuple[str, str, dict[int, bytes]]] = {}

    class Handler(base):  # type: ignore[misc]
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            """Quiet: tests read failures from the client side."""

        def do_GET(self) -> None:
            self._serve("GET")

        def do_HEAD(self) -> None:
            self._serve("HEAD")

        def do_PUT(self) -> None:
            self._serve("PUT")

        def do_POST(self) -> None:
            self._serve("POST")

        def do_DELETE(self) -> None:
            self._serve("DELETE")

        def do_PATCH(self) -> None:
            with lock:
                super().do_PATCH()

        def _serve(self, method: str) -> None:
            parts = urlsplit(self.path)
            query = {
                name: values[0]
                for name, values in parse_qs(parts.query, keep_blank_values=True).items()
            }
            obj = _OBJECT.match(parts.path)
            listing = _BUCKET.match(parts.path) if query.get("list-type") == "2" else None
            json_api = parts.path.startswith(("/storage/", "/upload/", "/download/", "/b/"))
            body = self._body() if method in ("PUT", "POST") else b""
            with lock:
                if json_api or (obj is None and listing is None):
                    self._json_api(method, body)
                elif listing is not None:
                    self._list(listing["bucket"], query)
                else:
                    assert obj is not None
                    self._object(method, obj["bucket"], unquote(obj["name"]), query, body)

        def _json_api(self, method: str, body: bytes) -> None:
            # The emulator reads the body itself; hand it what was already read.
            import io

            self.rfile = io.BufferedReader(io.BytesIO(body))
            self.close_connection = True
            getattr(super(), f"do_{method}")()

        def _body(self) -> bytes:
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else b""

        def _object(
            self, method: str, bucket: str, name: str, query: dict[str, str], body: bytes
        ) -> None:
            upload = query.get("uploadId")
            if method == "POST" and "uploads" in query:
                upload_id = secrets.token_hex(16)
                uploads[upload_id] = (bucket, name, {})
                self._xml(
                    HTTPStatus.OK,
                    "<InitiateMultipartUploadResult>"
                    f"<Bucket>{escape(bucket)}</Bucket><Key>{escape(name)}</Key>"
                    f"<UploadId>{upload_id}</UploadId></InitiateMultipartUploadResult>",
                )
            elif upload is not None:
                self._multipart(method, upload, query, body)
            elif method == "PUT":
                self._put(bucket, name, body)
            elif method in ("GET", "HEAD"):
                self._get(bucket, name, head=method == "HEAD")
            elif method == "DELETE":
                self._delete(bucket, name)
            else:
                self._error(HTTPStatus.NOT_IMPLEMENTED, "NotImplemented", f"{method} {name}")

        def _multipart(self, method: str, upload: str, query: dict[str, str], body: bytes) -> None:
            if upload not in uploads:
                self._error(HTTPStatus.NOT_FOUND, "NoSuchUpload", upload)
                return
            bucket, name, parts = uploads[upload]
            if method == "PUT":
                parts[int(query["partNumber"])] = body
                self._reply(HTTPStatus.OK, {"ETag": _etag(body)})
            elif method == "DELETE":
                del uploads[upload]
                self._reply(HTTPStatus.NO_CONTENT)
            else:  # POST: complete, from the parts the request names, in its order
                numbers = [int(n) for n in re.findall(rb"<PartNumber>(\d+)</PartNumber>", body)]
                if any(n not in parts for n in numbers):
                    self._error(HTTPStatus.BAD_REQUEST, "InvalidPart", upload)
                    return
                if not self._precondition(bucket, name):
                    return
                data = b"".join(parts[n] for n in numbers)
                del uploads[upload]
                etag = self._store(bucket, name, data)
                self._xml(
                    HTTPStatus.OK,
                    "<CompleteMultipartUploadResult>"
                    f"<Bucket>{escape(bucket)}</Bucket><Key>{escape(name)}</Key>"
                    f"<ETag>{escape(etag)}</ETag></CompleteMultipartUploadResult>",
                    {"ETag": etag},
                )

        def _precondition(self, bucket: str, name: str) -> bool:
            wanted = self.headers.get("x-goog-if-generation-match")
            if wanted is None:
                return True
            current = self._meta(bucket, name)
            generation = "0" if current is None else str(current["generation"])
            if generation == wanted.strip():
                return True
            self._error(HTTPStatus.PRECONDITION_FAILED, "PreconditionFailed", name)
            return False

        def _put(self, bucket: str, name: str, body: bytes) -> None:
            if not self._precondition(bucket, name):
                return
            etag = self._store(bucket, name, body)
            generation = self._meta(bucket, name)["generation"]  # type: ignore[index]
            self._reply(HTTPStatus.OK, {"ETag": etag, "x-goog-generation": generation})

        def _store(self, bucket: str, name: str, data: bytes) -> str:
            from gcp_storage_emulator.handlers import objects

            obj = objects._make_object_resource(
                f"http://{self.headers.get('Host')}",
                bucket,
                name,
                self.headers.get("Content-Type", "application/octet-stream"),
                str(len(data)),
            )
            self.storage.create_file(bucket, name, data, objects._checksums(data, obj))
            return _etag(data)

        def _meta(self, bucket: str, name: str) -> dict[str, Any] | None:
            from gcp_storage_emulator.exceptions import NotFound

            try:
                meta: dict[str, Any] = self.storage.get_file_obj(bucket, name)
                return meta
            except NotFound:
                return None

        def _get(self, bucket: str, name: str, *, head: bool) -> None:
            meta = self._meta(bucket, name)
            if meta is None:
                self._error(HTTPStatus.NOT_FOUND, "NoSuchKey", name)
                return
            data: bytes = self.storage.get_file(bucket, name)
            headers = {
                "ETag": _etag(data),
                "Last-Modified": format_datetime(_updated(meta), usegmt=True),
                "x-goog-generation": str(meta["generation"]),
                "Content-Type": meta.get("contentType") or "application/octet-stream",
                "Accept-Ranges": "bytes",
            }
            status = HTTPStatus.OK
            wanted = _RANGE.match(self.headers.get("Range") or "")
            if wanted is not None and data:
                start = int(wanted[1])
                end = min(len(data) - 1, int(wanted[2])) if wanted[2] else len(data) - 1
                if start >= len(data):
                    self._error(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE, "InvalidRange", name)
                    return
                headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
                data, status = data[start : end + 1], HTTPStatus.PARTIAL_CONTENT
            self._reply(status, headers, data, head=head)

        def _delete(self, bucket: str, name: str) -> None:
            from gcp_storage_emulator.exceptions import NotFound

            try:
                self.storage.delete_file(bucket, name)
            except NotFound:
                self._error(HTTPStatus.NOT_FOUND, "NoSuchKey", name)
                return
            self._reply(HTTPStatus.NO_CONTENT)

        def _list(self, bucket: str, query: dict[str, str]) -> None:
            from gcp_storage_emulator.exceptions import NotFound

            prefix = query.get("prefix", "")
            delimiter = query.get("delimiter") or None
            after = max(query.get("start-after", ""), query.get("continuation-token", ""))
            page = min(int(query.get("max-keys", _LIST_PAGE)), _LIST_PAGE)
            try:
                items, prefixes = self.storage.get_file_list(bucket, prefix or None, delimiter)
            except NotFound:
                self._error(HTTPStatus.NOT_FOUND, "NoSuchBucket", bucket)
                return
            items = [item for item in items if item["name"] > after]
            shown, rest = items[:page], items[page:]
            entries = "".join(
                f"<Contents><Key>{escape(item['name'])}</Key>"
                f"<LastModified>{_updated(item).strftime('%Y-%m-%dT%H:%M:%S.%fZ')}"
                f"</LastModified><Size>{item['size']}</Size>"
                f"<ETag>{escape(_etag_of(item))}</ETag></Contents>"
                for item in shown
            )
            common = "".join(
                f"<CommonPrefixes><Prefix>{escape(p)}</Prefix></CommonPrefixes>" for p in prefixes
            )
            token = (
                f"<NextContinuationToken>{escape(shown[-1]['name'])}</NextContinuationToken>"
                if rest
                else ""
            )
            self._xml(
                HTTPStatus.OK,
                f"<ListBucketResult><Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix>"
                f"<KeyCount>{len(shown)}</KeyCount><IsTruncated>{str(bool(rest)).lower()}"
                f"</IsTruncated>{entries}{common}{token}</ListBucketResult>",
            )

        def _error(self, status: HTTPStatus, code: str, detail: str) -> None:
            self._xml(
                status, f"<Error><Code>{code}</Code><Message>{escape(detail)}</Message></Error>"
            )

        def _xml(
            self, status: HTTPStatus, text: str, headers: dict[str, str] | None = None
        ) -> None:
            body = ('<?xml version="1.0" encoding="UTF-8"?>' + text).encode()
            self._reply(status, {"Content-Type": "application/xml", **(headers or {})}, body)

        def _reply(
            self,
            status: HTTPStatus,
            headers: dict[str, str] | None = None,
            body: bytes = b"",
            *,
            head: bool = False,
        ) -> None:
            self.send_response(status.value, status.phrase)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head and status != HTTPStatus.NO_CONTENT:
                self.wfile.write(body)

    return Handler


def _etag(data: bytes) -> str:
    return f'"{hashlib.md5(data).hexdigest()}"'


def _etag_of(item: dict[str, Any]) -> str:
    md5 = item.get("md5Hash")
    return f'"{base64.b64decode(md5).hex()}"' if md5 else f'"{quote(str(item["generation"]))}"'


def _updated(meta: dict[str, Any]) -> datetime:
    text = str(meta.get("updated") or meta.get("timeCreated"))
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
