"""The envelope: the one byte layout of every object in the mailbox.

An envelope is a fixed 20-byte header, the record (canonical JSON, opaque here), then the
payload (bytes ``codecs.compress`` produced, or nothing). All integers are little-endian:

======  =====  ==============================================================
offset  bytes  field
======  =====  ==============================================================
0       4      magic ``b"GMEV"``
4       1      format version, ``FORMAT_VERSION``
5       1      codec id: 0 ``"off"``, 1 ``"zstd"`` (``CODEC_IDS``)
6       2      reserved, zero
8       4      record length in bytes
12      8      payload length in bytes
20      ...    record, then payload, then nothing
======  =====  ==============================================================

Both lengths are explicit so that a truncated object is told apart from a corrupt one, and a
reader bounds the record before it parses any JSON. The record carries ``payload_digest`` of
the payload as stored; readers compare it before they decompress anything.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from typing import TypeAlias

import attrs

from gradientmail.core.codecs import COMPRESSIONS, Compression
from gradientmail.core.errors import FormatError

__all__ = [
    "CODEC_IDS",
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "MAGIC",
    "MAX_RECORD_BYTES",
    "Payload",
    "Sealed",
    "payload_digest",
    "seal",
    "seal_parts",
    "unseal",
]

MAGIC = b"GMEV"
FORMAT_VERSION = 1
CODEC_IDS: Mapping[Compression, int] = {"off": 0, "zstd": 1}
MAX_RECORD_BYTES = 1 << 20
"""The largest record ``seal`` writes, and ``unseal``'s default bound (bytes)."""

_HEADER = struct.Struct("<4sBBHIQ")
HEADER_BYTES = _HEADER.size
_CODECS: Mapping[int, Compression] = {code: name for name, code in CODEC_IDS.items()}


@attrs.frozen(kw_only=True)
class Sealed:
    """The parts of an envelope: its record bytes and its payload as stored (still compressed
    under ``compression``; empty when the object carries no tensors). The payload is a view of
    the envelope's bytes, not a copy: a payload the size of a fragment is held once."""

    record: bytes = attrs.field(repr=lambda r: f"<{len(r)} bytes>")
    compression: Compression
    payload: bytes | memoryview = attrs.field(repr=lambda p: f"<{len(p)} bytes>")


Payload: TypeAlias = bytes | Sequence[bytes | memoryview]
"""A payload as stored: one bytes object, or parts whose concatenation it is
(``codecs.compress_parts``), so that sealing copies the data once."""


def _parts(payload: Payload | memoryview) -> Sequence[bytes | memoryview]:
    return (payload,) if isinstance(payload, bytes | memoryview) else payload


def payload_digest(payload: Payload | memoryview) -> str:
    """SHA-256, as 64 lowercase hex digits, of ``payload`` as stored in the envelope."""
    digest = hashlib.sha256()
    for part in _parts(payload):
        digest.update(part)
    return digest.hexdigest()


def seal(
    record: bytes, payload: Payload | memoryview = b"", *, compression: Compression = "off"
) -> bytes:
    """The envelope of ``record`` and ``payload`` (already compressed under ``compression``).

    Raises ``ValueError`` for an empty record or one over ``MAX_RECORD_BYTES``, an unknown
    compression, or a ``"zstd"`` envelope without a payload.
    """
    return b"".join(seal_parts(record, payload, compression=compression))


def seal_parts(
    record: bytes, payload: Payload | memoryview = b"", *, compression: Compression = "off"
) -> list[bytes | memoryview]:
    """``seal``'s envelope as parts to be written one after the other: the header and record,
    then ``payload``'s parts, uncopied. Raises as ``seal``."""
    if compression not in CODEC_IDS:
        raise ValueError(f"unknown compression {compression!r}; expected one of {COMPRESSIONS}")
    if not record:
        raise ValueError("an envelope needs a non-empty record")
    if len(record) > MAX_RECORD_BYTES:
        raise ValueError(f"record of {len(record)} bytes exceeds {MAX_RECORD_BYTES} bytes")
    parts = _parts(payload)
    size = sum(len(part) for part in parts)
    if compression != "off" and not size:
        raise ValueError(
            f'an empty payload must be sealed with compression "off", not {compression!r}'
        )
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, CODEC_IDS[compression], 0, len(record), size)
    return [header + record, *parts]


def unseal(blob: bytes, *, max_record: int = MAX_RECORD_BYTES, key: str | None = None) -> Sealed:
    """The parts of the envelope ``blob``, read as untrusted input.

    ``max_record`` bounds the record length in bytes; ``key`` only names the object in errors.
    Raises ``FormatError`` for a short or foreign header, an unknown format version or codec,
    a record over ``max_record``, or lengths that disagree with the blob (truncated, or with
    trailing bytes). The record's content is not parsed here.
    """
    if len(blob) < HEADER_BYTES:
        raise FormatError(
            f"truncated envelope: {len(blob)} bytes, the header alone is {HEADER_BYTES}", key=key
        )
    magic, version, codec, reserved, record_len, payload_len = _HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise FormatError(f"not a gradientmail envelope (magic {magic!r})", key=key)
    if version != FORMAT_VERSION:
        raise FormatError(
            f"envelope format version {version} is not supported (this reader knows "
            f"{FORMAT_VERSION}); upgrade gradientmail",
            key=key,
        )
    compression = _CODECS.get(codec)
    if compression is None:
        raise FormatError(f"unknown codec id {codec} in envelope", key=key)
    if reserved:
        raise FormatError(f"reserved envelope field is {reserved}, expected 0", key=key)
    _check_lengths(len(blob), record_len, payload_len, max_record, key)
    if compression != "off" and not payload_len:
        raise FormatError(f"envelope declares codec {compression!r} but no payload", key=key)
    end = HEADER_BYTES + record_len
    payload = memoryview(blob)[end:] if len(blob) > end else b""
    return Sealed(record=bytes(blob[HEADER_BYTES:end]), compression=compression, payload=payload)


def _check_lengths(
    size: int, record_len: int, payload_len: int, max_record: int, key: str | None
) -> None:
    if not record_len:
        raise FormatError("envelope has an empty record", key=key)
    if record_len > max_record:
        raise FormatError(
            f"envelope record of {record_len} bytes exceeds the bound of {max_record} bytes",
            key=key,
        )
    expected = HEADER_BYTES + record_len + payload_len
    if size < expected:
        raise FormatError(
            f"truncated envelope: {size} bytes, its header declares {expected}", key=key
        )
    if size > expected:
        raise FormatError(
            f"envelope has {size - expected} trailing bytes after its declared {expected}",
            key=key,
        )
