"""Mailboxes: where the nodes of a run meet, behind one protocol of five primitives.

``Mailbox`` is the protocol (``get``, ``put``, ``create``, ``list``, ``delete``); any store
that passes ``gradientmail.testing.check_mailbox`` will do. Three ship with the library:

- ``MemoryMailbox``: in one process, for tests and simulation, with injectable ``Faults``;
- ``DirectoryMailbox``: a local or shared POSIX directory, safe across processes;
- ``ObjectStoreMailbox``: S3, GCS, Azure Blob, R2, MinIO through ``obstore`` (the ``s3`` extra;
  imported on first use).

``mailbox_from_url`` opens any of them from a URL.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gradientmail.mailboxes._directory import DirectoryMailbox
from gradientmail.mailboxes._memory import Faults, MemoryMailbox
from gradientmail.mailboxes._protocol import (
    BadKey,
    Mailbox,
    MailboxError,
    ObjectInfo,
    RequestStats,
    StoreUnavailable,
    TooLarge,
    TransientMailboxError,
)
from gradientmail.mailboxes._urls import mailbox_from_url

if TYPE_CHECKING:
    from gradientmail.mailboxes._objectstore import ObjectStoreMailbox

__all__ = [
    "BadKey",
    "DirectoryMailbox",
    "Faults",
    "Mailbox",
    "MailboxError",
    "MemoryMailbox",
    "ObjectInfo",
    "ObjectStoreMailbox",
    "RequestStats",
    "StoreUnavailable",
    "TooLarge",
    "TransientMailboxError",
    "mailbox_from_url",
]


def __getattr__(name: str) -> Any:
    if name == "ObjectStoreMailbox":  # needs obstore (the ``s3`` extra)
        module = importlib.import_module("gradientmail.mailboxes._objectstore")
        return module.ObjectStoreMailbox
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
