"""A local Azure Blob Storage for tests: Azurite on 127.0.0.1, usable without pytest.

Azurite is an npm package (``make venv`` installs it under ``.node/``); :func:`azurite_blob`
finds its ``azurite-blob`` program through ``$AZURITE_BLOB``, then ``PATH``, then ``.node/`` in
the current directory. Azurite implements the conditional headers Azure documents
(``If-None-Match: *`` on Put Blob answers 409 ``BlobAlreadyExists``), so the mailbox's
create-only writes meet the real precondition logic.
"""

from __future__ import annotations

import base64
import contextlib
import email.utils
import hashlib
import hmac
import http.client
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlencode

__all__ = ["ACCOUNT", "ACCOUNT_KEY", "AzuriteMissing", "azurite_blob", "azurite_program"]

ACCOUNT = "devstoreaccount1"
"""Azurite's well-known development account."""
ACCOUNT_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
"""Its well-known key (public: Azurite documents it; it opens nothing outside this machine)."""
_API_VERSION = "2021-08-06"
_START_TIMEOUT = 30.0


class AzuriteMissing(RuntimeError):
    """Azurite's program was not found (install it with ``make venv`` or ``npm install``)."""


def azurite_program() -> str:
    """The path of ``azurite-blob``; :class:`AzuriteMissing` if it is nowhere to be found."""
    for candidate in (
        os.environ.get("AZURITE_BLOB"),
        shutil.which("azurite-blob"),
        str(Path(".node/node_modules/.bin/azurite-blob").resolve()),
    ):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise AzuriteMissing(
        "azurite-blob not found: set AZURITE_BLOB, put it on PATH, or run `make venv` "
        "(npm install --prefix .node azurite)"
    )


@contextlib.contextmanager
def azurite_blob(container: str = "gradientmail", prefix: str = "mailbox") -> Iterator[str]:
    """Run Azurite's blob service on 127.0.0.1 and yield ``az://container/prefix?...``.

    Sets ``AZURE_STORAGE_ACCOUNT_KEY`` for the duration (restoring it after), so the URL and
    that variable open the mailbox in any process; creates ``container`` (3 to 63 characters);
    keeps everything in memory, sends no telemetry, and stops the service on exit.
    """
    port = _free_port()
    process = subprocess.Popen(
        [
            azurite_program(),
            "--blobHost", "127.0.0.1",
            "--blobPort", str(port),
            "--inMemoryPersistence",
            "--disableTelemetry",
            "--skipApiVersionCheck",
            "--silent",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    saved = os.environ.get("AZURE_STORAGE_ACCOUNT_KEY")
    os.environ["AZURE_STORAGE_ACCOUNT_KEY"] = ACCOUNT_KEY
    try:
        _create_container(process, port, container)
        endpoint = f"http://127.0.0.1:{port}/{ACCOUNT}"
        yield f"az://{container}/{prefix}?" + urlencode(
            {"account_name": ACCOUNT, "endpoint": endpoint}, safe=":/"
        )
    finally:
        if saved is None:
            os.environ.pop("AZURE_STORAGE_ACCOUNT_KEY", None)
        else:
            os.environ["AZURE_STORAGE_ACCOUNT_KEY"] = saved
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _create_container(process: subprocess.Popen[bytes], port: int, container: str) -> None:
    """Create ``container`` with a Shared Key request, retrying until Azurite listens."""
    deadline = time.monotonic() + _START_TIMEOUT
    while True:
        if process.poll() is not None:
            error = process.stderr.read().decode(errors="replace") if process.stderr else ""
            raise RuntimeError(f"Azurite exited with {process.returncode}: {error.strip()}")
        try:
            status = _put_container(port, container)
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"Azurite did not listen on port {port} within 30 s") from None
            time.sleep(0.1)
            continue
        if status not in (201, 409):  # 409: it exists already
            raise RuntimeError(f"creating container {container!r} on Azurite answered {status}")
        return


def _put_container(port: int, container: str) -> int:
    date = email.utils.formatdate(usegmt=True)
    # Shared Key: verb, eleven empty standard headers, the x-ms headers, the resource.
    to_sign = "\n".join(
        [
            "PUT", *([""] * 11),
            f"x-ms-date:{date}",
            f"x-ms-version:{_API_VERSION}",
            f"/{ACCOUNT}/{ACCOUNT}/{container}\nrestype:container",
        ]
    )  # fmt: skip
    key = base64.b64decode(ACCOUNT_KEY)
    signature = base64.b64encode(hmac.new(key, to_sign.encode(), hashlib.sha256).digest())
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request(
            "PUT",
            f"/{ACCOUNT}/{container}?restype=container",
            body=b"",
            headers={
                "x-ms-date": date,
                "x-ms-version": _API_VERSION,
                "Authorization": f"SharedKey {ACCOUNT}:{signature.decode()}",
            },
        )
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()
