"""One string names a mailbox: ``mailbox_from_url``."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import unquote, urlsplit

from gradientmail.mailboxes._protocol import Mailbox

__all__ = ["mailbox_from_url"]

_SCHEMES = ("file", "memory", "s3", "s3a", "gs", "az", "azure", "abfs", "abfss")


def mailbox_from_url(url: str | os.PathLike[str], **options: Any) -> Mailbox:
    """The mailbox ``url`` names.

    - ``/shared/run1``, ``run1`` or ``file:///shared/run1``: a
      :class:`~gradientmail.mailboxes.DirectoryMailbox` (``options``: ``fsync``, ``offload``);
    - ``memory://name``: ``MemoryMailbox.named(name)``
      (:class:`~gradientmail.mailboxes.MemoryMailbox`), shared by every handle of that name in the
      process (``options``: ``faults``, ``clock``);
    - ``s3://bucket/prefix``, ``gs://bucket/prefix``, ``az://container/prefix``, with store
      settings as query parameters, e.g. ``s3://run1/a?endpoint=http://127.0.0.1:9000&region=auto``
      for MinIO, R2 or moto: an :class:`~gradientmail.mailboxes.ObjectStoreMailbox`
      (``options``: its keyword arguments). Credentials come from the environment.
    """
    text = os.fspath(url)
    if "://" not in text:
        if not text:
            raise ValueError("the mailbox URL is empty; give a directory, memory://, s3://, ...")
        return _directory(text, options)
    parts = urlsplit(text)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"{text!r}: a file:// URL names a local path (file:///path)")
        return _directory(unquote(parts.path), options)
    if parts.scheme == "memory":
        from gradientmail.mailboxes._memory import MemoryMailbox

        name = (parts.netloc + parts.path).strip("/")
        if not name:
            raise ValueError(f"{text!r}: a memory mailbox needs a name, as in memory://run1")
        return MemoryMailbox.named(name, **options)
    if parts.scheme in _SCHEMES:
        from gradientmail.mailboxes._objectstore import ObjectStoreMailbox

        return ObjectStoreMailbox(text, **options)
    known = ", ".join(f"{scheme}://" for scheme in _SCHEMES)
    raise ValueError(
        f"{text!r}: unknown mailbox scheme {parts.scheme!r}; expected a path or {known}"
    )


def _directory(path: str, options: dict[str, Any]) -> Mailbox:
    from gradientmail.mailboxes._directory import DirectoryMailbox

    return DirectoryMailbox(path, **options)
