"""Record signatures: HMAC-SHA256 over the canonical record, two secrets during a rotation,
and where a node's secret comes from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from examples import NEW, OLD, RECORDS, THIRD

from gradientmail._secrets import SECRET_ENV, SECRET_FILE_ENV, keyring_from
from gradientmail.core.errors import FormatError
from gradientmail.core.records import Record, canonical, read_record, to_bytes
from gradientmail.core.signing import MIN_SECRET_BYTES, Keyring

ids = [type(r).__name__ for r in RECORDS]


@pytest.mark.parametrize("record", RECORDS, ids=ids)
def test_a_signed_record_verifies_and_reads_back(record: Record) -> None:
    data = to_bytes(record, Keyring.of(OLD))
    assert json.loads(data)["signature"] != ""
    assert read_record(data, type(record), verifier=Keyring.of(OLD)) == record
    # Without a verifier (an unsigned reader, an audit) the signature is ignored.
    assert read_record(data, type(record)) == record


@pytest.mark.parametrize("record", RECORDS, ids=ids)
def test_an_unsigned_record_is_rejected_in_a_signed_run(record: Record) -> None:
    with pytest.raises(FormatError, match="some/key: record is unsigned"):
        read_record(to_bytes(record), type(record), key="some/key", verifier=Keyring.of(OLD))


@pytest.mark.parametrize("record", RECORDS, ids=ids)
def test_a_record_signed_with_another_secret_is_rejected(record: Record) -> None:
    with pytest.raises(FormatError, match="bad signature"):
        read_record(to_bytes(record, Keyring.of(THIRD)), type(record), verifier=Keyring.of(OLD))


def _altered(value: Any) -> Any:
    """The record's JSON with one field changed the way a forger would."""
    for name in ("round", "counter", "samples", "attempt", "creator"):
        if name in value:
            changed = value[name] + 1 if isinstance(value[name], int) else value[name] + "x"
            return {**value, name: changed}
    raise AssertionError(value)


@pytest.mark.parametrize("record", RECORDS, ids=ids)
def test_every_field_is_covered_by_the_signature(record: Record) -> None:
    value = json.loads(to_bytes(record, Keyring.of(OLD)))
    with pytest.raises(FormatError, match="bad signature"):
        read_record(canonical(_altered(value)), type(record), verifier=Keyring.of(OLD))
    # The kind and format are covered too: the same bytes cannot pass for another kind.
    retyped = {**value, "format": 1, "kind": "lease" if value["kind"] != "lease" else "claim"}
    with pytest.raises(FormatError):
        read_record(canonical(retyped), type(record), verifier=Keyring.of(OLD))


@pytest.mark.parametrize("signature", [None, 7, "", "00" * 32, ["x"], "é" * 64])
def test_malformed_signatures_are_bad_signatures(signature: object) -> None:
    value = json.loads(to_bytes(RECORDS[1], Keyring.of(OLD)))
    value["signature"] = signature
    expected = "unsigned" if signature is None else "bad signature"
    with pytest.raises(FormatError, match=expected):
        read_record(canonical(value), type(RECORDS[1]), verifier=Keyring.of(OLD))


def test_during_a_rotation_both_secrets_verify_and_the_first_signs() -> None:
    rotating = Keyring.of(NEW, OLD)
    record = RECORDS[2]
    for writer in (Keyring.of(OLD), Keyring.of(NEW), rotating, Keyring.of(OLD, NEW)):
        assert read_record(to_bytes(record, writer), type(record), verifier=rotating) == record
    # It signs with NEW: a node that holds only NEW accepts it, one that holds only OLD not.
    data = to_bytes(record, rotating)
    assert read_record(data, type(record), verifier=Keyring.of(NEW)) == record
    with pytest.raises(FormatError, match="bad signature"):
        read_record(data, type(record), verifier=Keyring.of(OLD))


def test_a_keyring_refuses_short_many_or_no_secrets_and_never_shows_them() -> None:
    with pytest.raises(ValueError, match=f"at least {MIN_SECRET_BYTES} bytes"):
        Keyring.of(b"short")
    with pytest.raises(ValueError, match="1 to 2 secrets"):
        Keyring.of(OLD, NEW, THIRD)
    with pytest.raises(ValueError, match="1 to 2 secrets"):
        Keyring.parse(" , \n")
    with pytest.raises(TypeError):
        Keyring(secrets=("text",))  # type: ignore[arg-type]
    keyring = Keyring.of(OLD, NEW)
    assert OLD.decode() not in repr(keyring) and "2 secret" in repr(keyring)
    assert Keyring.parse(f" {NEW.decode()} ,\n{OLD.decode()}\n") == Keyring.of(NEW, OLD)


def test_the_secret_comes_from_the_argument_the_file_or_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text(f"{NEW.decode()}\n{OLD.decode()}\n", encoding="utf-8")
    empty: dict[str, str] = {}
    assert keyring_from(environ=empty) is None
    assert keyring_from(OLD, environ=empty) == Keyring.of(OLD)
    assert keyring_from(OLD.decode(), environ=empty) == Keyring.of(OLD)
    assert keyring_from([NEW, OLD], environ=empty) == Keyring.of(NEW, OLD)
    assert keyring_from(secret_file=path, environ=empty) == Keyring.of(NEW, OLD)
    assert keyring_from(environ={SECRET_ENV: OLD.decode()}) == Keyring.of(OLD)
    assert keyring_from(environ={SECRET_FILE_ENV: str(path)}) == Keyring.of(NEW, OLD)
    # An argument wins over the environment.
    assert keyring_from(NEW, environ={SECRET_ENV: OLD.decode()}) == Keyring.of(NEW)
    with pytest.raises(ValueError, match="not both"):
        keyring_from(OLD, secret_file=path)
    path.write_text("short\n", encoding="utf-8")
    with pytest.raises(ValueError, match=f"secret file '{path}'"):
        keyring_from(secret_file=path, environ=empty)
