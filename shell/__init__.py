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

from gradientmail.clock import Clock, MonotonicClock
from gradientmail.core.algorithm import DiLoCo
from gradientmail.core.errors import (
    ConfigMismatch,
    FormatError,
    NonFinite,
    ProtocolError,
    SchemaMismatch,
)
from gradientmail.events import (
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
    TookOver,
    combined,
    log_events,
)
from gradientmail.mailbox import BadKey, Mailbox, MailboxError, ObjectInfo, TransientMailboxError
from gradientmail.session import Session, align
from gradientmail.urls import mailbox_from_url

__all__ = [
    "BadKey",
    "Callback",
    "Claimed",
    "Clipped",
    "Clock",
    "Committed",
    "ConfigMismatch",
    "DiLoCo",
    "Event",
    "Excluded",
    "Failed",
    "FormatError",
    "Joined",
    "JsonLines",
    "LeaseExpired",
    "Left",
    "Mailbox",
    "MailboxError",
    "Merged",
    "MonotonicClock",
    "NonFinite",
    "ObjectInfo",
    "ProtocolError",
    "Published",
    "Rebased",
    "Rejected",
    "Retried",
    "SchemaMismatch",
    "Session",
    "TookOver",
    "TransientMailboxError",
    "align",
    "combined",
    "log_events",
    "mailbox_from_url",
]

__version__ = "0.1.0"
