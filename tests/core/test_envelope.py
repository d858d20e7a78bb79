"""The envelope: a pinned byte layout, exact lengths, and FormatError for anything else."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradientmail.core.codecs import (
    COMPRESSIONS,
    Compression,
    compress,
    compress_parts,
    decompress,
)
from gradientmail.core.envelope import (
    HEADER_BYTES,
    MAX_RECORD_BYTES,
    Sealed,
    payload_digest,
    seal,
    unseal,
)
from gradientmail.core.errors import FormatError
from gradientmail.core.tensors import TensorBytes

records = st.binary(min_size=1, max_size=64)


@st.composite
def envelopes(draw: st.DrawFn) -> tuple[bytes, bytes, Compression]:
    compression: Compression = draw(st.sampled_from(COMPRESSIONS))
    payload = draw(st.binary(min_size=1 if compression == "zstd" else 0, max_size=64))
    return draw(records), payload, compression


def header(
    *,
    magic: bytes = b"GMEV",
    version: int = 1,
    codec: int = 0,
    reserved: int = 0,
    record: int = 2,
    payload: int = 0,
) -> bytes:
    return struct.pack("<4sBBHIQ", magic, version, codec, reserved, record, payload)


def test_layout_is_pinned() -> None:
    blob = seal(b"{}", b"xyz", compression="zstd")
    assert (
        blob == b"GMEV\x01\x01\x00\x00" + b"\x02\x00\x00\x00" + (3).to_bytes(8, "little") + b"{}xyz"
    )
    assert HEADER_BYTES == 20
    assert unseal(seal(b"{}")) == Sealed(record=b"{}", compression="off", payload=b"")


@given(envelopes())
def test_round_trip(parts: tuple[bytes, bytes, Compression]) -> None:
    record, payload, compression = parts
    blob = seal(record, payload, compression=compression)
    assert blob == seal(record, payload, compression=compression)
    assert len(blob) == HEADER_BYTES + len(record) + len(payload)
    assert unseal(blob) == Sealed(record=record, compression=compression, payload=payload)


@given(st.sampled_from(COMPRESSIONS))
def test_envelope_carries_a_real_payload_end_to_end(compression: Compression) -> None:
    tensors = {"w": TensorBytes(dtype="BF16", shape=(3, 2), data=bytes(range(12)))}
    payload = compress(tensors, compression)
    sealed = unseal(seal(b'{"digest":"..."}', payload, compression=compression))
    assert payload_digest(sealed.payload) == payload_digest(payload)
    assert decompress(sealed.payload, sealed.compression, limit=1 << 16) == tensors


@given(envelopes(), st.data())
def test_a_payload_in_parts_seals_and_digests_as_its_concatenation(
    parts: tuple[bytes, bytes, Compression], data: st.DataObject
) -> None:
    record, payload, compression = parts
    cuts = sorted(data.draw(st.lists(st.integers(0, len(payload)), max_size=4)))
    pieces = [payload[a:b] for a, b in zip([0, *cuts], [*cuts, len(payload)], strict=True)]
    assert seal(record, pieces, compression=compression) == seal(
        record, payload, compression=compression
    )
    assert payload_digest(pieces) == payload_digest(payload)


@given(st.sampled_from(COMPRESSIONS))
def test_compressed_parts_are_the_payload(compression: Compression) -> None:
    tensors = {
        "w": TensorBytes(dtype="BF16", shape=(3, 2), data=bytes(range(12))),
        "b": TensorBytes(dtype="F32", shape=(2,), data=bytes(range(8))),
    }
    parts = compress_parts(tensors, compression)
    assert b"".join(parts) == compress(tensors, compression)
    assert decompress(b"".join(parts), compression, limit=1 << 16) == tensors


def check_mutated(parts: tuple[bytes, bytes, Compression], data: st.DataObject) -> None:
    blob = bytearray(seal(parts[0], parts[1], compression=parts[2]))
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(blob)))
        action = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if action == "flip" and at < len(blob):
            blob[at] ^= data.draw(st.integers(1, 255))
        elif action == "cut":
            del blob[at:]
        else:
            blob[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    try:
        sealed = unseal(bytes(blob))
    except FormatError:
        return
    # A mutation that still parses kept the header consistent with the blob.
    assert HEADER_BYTES + len(sealed.record) + len(sealed.payload) == len(blob)


@given(envelopes(), st.data())
def test_mutated_envelopes_raise_only_format_error(
    parts: tuple[bytes, bytes, Compression], data: st.DataObject
) -> None:
    check_mutated(parts, data)


@given(st.binary(max_size=100))
def test_random_blobs_raise_format_error(blob: bytes) -> None:
    with pytest.raises(FormatError):
        unseal(blob)


@given(st.binary(max_size=100))
def test_random_bodies_behind_a_valid_magic_raise_only_format_error(body: bytes) -> None:
    try:
        sealed = unseal(b"GMEV" + body)
    except FormatError:
        return
    assert len(sealed.record) >= 1


@pytest.mark.slow
@pytest.mark.timeout(3600)  # 100,000 examples outlast the suite's 600 s default
@settings(max_examples=100_000)
@given(envelopes(), st.data())
def test_unseal_fuzz_large(parts: tuple[bytes, bytes, Compression], data: st.DataObject) -> None:
    check_mutated(parts, data)


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (b"", "truncated envelope: 0 bytes, the header alone is 20"),
        (header()[:19], "truncated envelope: 19 bytes"),
        (header(magic=b"PK\x03\x04") + b"{}", "not a gradientmail envelope"),
        (header(version=2) + b"{}", "format version 2 is not supported"),
        (header(version=0) + b"{}", "format version 0 is not supported"),
        (header(codec=7) + b"{}", "unknown codec id 7"),
        (header(reserved=1) + b"{}", "reserved envelope field is 1"),
        (header(record=0), "empty record"),
        (header(record=MAX_RECORD_BYTES + 1), "exceeds the bound of 1048576 bytes"),
        (header(record=2**32 - 1), "exceeds the bound"),
        (header() + b"{", "truncated envelope: 21 bytes, its header declares 22"),
        (header(payload=2**64 - 1) + b"{}", "truncated envelope"),
        (header() + b"{}x", "1 trailing bytes"),
        (header(payload=1) + b"{}xy", "1 trailing bytes"),
        (header(codec=1) + b"{}", "declares codec 'zstd' but no payload"),
    ],
)
def test_unseal_rejects(blob: bytes, message: str) -> None:
    with pytest.raises(FormatError, match=message):
        unseal(blob)


def test_errors_name_the_key_and_the_record_bound_is_a_parameter() -> None:
    with pytest.raises(FormatError, match=r"^rounds/1/commit: not a gradientmail") as info:
        unseal(b"x" * 40, key="rounds/1/commit")
    assert info.value.key == "rounds/1/commit" and isinstance(info.value, ValueError)
    blob = seal(b"0123456789")
    assert unseal(blob, max_record=10).record == b"0123456789"
    with pytest.raises(FormatError, match="10 bytes exceeds the bound of 9 bytes"):
        unseal(blob, max_record=9)


def test_seal_refuses_what_unseal_would_refuse() -> None:
    with pytest.raises(ValueError, match="non-empty record"):
        seal(b"")
    with pytest.raises(ValueError, match="exceeds 1048576 bytes"):
        seal(b"x" * (MAX_RECORD_BYTES + 1))
    with pytest.raises(ValueError, match="unknown compression 'lz4'"):
        seal(b"{}", b"x", compression="lz4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty payload must be sealed"):
        seal(b"{}", compression="zstd")
    with pytest.raises(ValueError, match="empty payload must be sealed"):
        seal(b"{}", [b"", b""], compression="zstd")


def test_payload_digest_is_sha256_hex() -> None:
    assert payload_digest(b"") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    assert payload_digest(b"abc") == (
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    )
