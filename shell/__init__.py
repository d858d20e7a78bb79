"""gradientmail: DiLoCo and Streaming DiLoCo through a shared bucket.

Every node trains its own copy of the model; every few hundred steps it mails the bucket a
compact delta for one fragment; a round closes on a quorum, one node applies the outer
optimizer, and everyone merges the result without stopping.

    from gradientmail import DiLoCo, Session, mailbox_from_url

    with Session(model, algorithm=DiLoCo(inner_steps=100),
                 mailbox=mailbox_from_url("s3://bucket/run")) as session:
        for batch in batches:
            ...  # forward, backward, optimizer step
            session.step(samples=tokens_in(batch))
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gradientmail._clock import Clock, MonotonicClock
from gradientmail._events import (
    Callback,
    Claimed,
    Clipped,
    Committed,
    Event,
    Excluded,
    Failed,
    Joined,
    JsonLines,
    LeaseExpired,
    Left,
    Merged,
    Published,
    Rebased,
    Rejected,
    Retried,
    Stalled,
    TookOver,
    combined,
    log_events,
)
from gradientmail._session import Session, align
from gradientmail.core.algorithm import DiLoCo
from gradientmail.core.errors import (
    ConfigMismatch,
    FormatError,
    GradientmailError,
    NonFinite,
    ProtocolError,
    RejectedObject,
    SchemaMismatch,
)
from gradientmail.core.signing import Keyring
from gradientmail.mailboxes import (
    BadKey,
    DirectoryMailbox,
    Mailbox,
    MailboxError,
    MemoryMailbox,
    ObjectInfo,
    StoreUnavailable,
    TransientMailboxError,
    mailbox_from_url,
)

if TYPE_CHECKING:
    from gradientmail.mailboxes import ObjectStoreMailbox

__all__ = [
    "BadKey",
    "Callback",
    "Claimed",
    "Clipped",
    "Clock",
    "Committed",
    "ConfigMismatch",
    "DiLoCo",
    "DirectoryMailbox",
    "Event",
    "Excluded",
    "Failed",
    "FormatError",
    "GradientmailError",
    "Joined",
    "JsonLines",
    "Keyring",
    "LeaseExpired",
    "Left",
    "Mailbox",
    "MailboxError",
    "MemoryMailbox",
    "Merged",
    "MonotonicClock",
    "NonFinite",
    "ObjectInfo",
    "ObjectStoreMailbox",
    "ProtocolError",
    "Published",
    "Rebased",
    "Rejected",
    "RejectedObject",
    "Retried",
    "SchemaMismatch",
    "Session",
    "Stalled",
    "StoreUnavailable",
    "TookOver",
    "TransientMailboxError",
    "align",
    "combined",
    "log_events",
    "mailbox_from_url",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "ObjectStoreMailbox":  # needs obstore (the ``s3`` extra)
        return importlib.import_module("gradientmail.mailboxes").ObjectStoreMailbox
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
