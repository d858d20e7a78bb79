"""Keys, errors and request counters shared by every mailbox."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradientmail.mailboxes._protocol import (
    BadKey,
    MailboxError,
    RequestStats,
    TransientMailboxError,
    is_valid_key,
    validate_key,
    validate_prefix,
)
from gradientmail.testing._conformance import BAD_KEYS, BAD_PREFIXES

CHARSET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-"
segments = st.text(CHARSET, min_size=1, max_size=40).filter(lambda s: s not in (".", ".."))
keys = st.lists(segments, min_size=1, max_size=8).map("/".join)


@given(keys)
def test_keys_from_the_charset_are_valid(key: str) -> None:
    assert validate_key(key) == key
    assert validate_prefix(key) == key
    assert validate_prefix(key + "/") == key + "/"


@given(keys, st.sampled_from(" ~#?*%\\:\"'<>|\x00\n\té"), st.data())
def test_a_character_outside_the_charset_is_rejected(
    key: str, bad: str, data: st.DataObject
) -> None:
    position = data.draw(st.integers(0, len(key)))
    spoiled = key[:position] + bad + key[position:]
    with pytest.raises(BadKey, match="outside"):
        validate_key(spoiled, store="memory://x", operation="get")


def documented_rule(key: str) -> bool:
    """``validate_key``'s documented rule, spelled out independently of its code."""
    segments = key.split("/")
    return (
        0 < len(key.encode()) <= 1024
        and all(s not in ("", ".", "..") for s in segments)
        and all(set(s) <= set(CHARSET) and len(s.encode()) <= 255 for s in segments)
    )


@given(
    st.one_of(
        st.text(CHARSET + "/.é\x00 ", max_size=24),
        st.lists(st.sampled_from(["", ".", "..", "a", "k" * 255, "k" * 256, "é"]), max_size=6).map(
            "/".join
        ),
    )
)
def test_a_key_is_valid_exactly_when_the_documented_rule_says(key: str) -> None:
    assert is_valid_key(key) == documented_rule(key)
    if not documented_rule(key):
        with pytest.raises(BadKey):
            validate_key(key)


@pytest.mark.parametrize("key", BAD_KEYS)
def test_bad_keys_are_rejected_with_their_store_and_operation(key: str) -> None:
    with pytest.raises(BadKey) as caught:
        validate_key(key, store="s3://b/run", operation="create")
    error = caught.value
    assert isinstance(error, ValueError) and isinstance(error, MailboxError)
    assert (error.store, error.key, error.operation) == ("s3://b/run", key, "create")
    assert "s3://b/run" in str(error) and "create" in str(error)


@pytest.mark.parametrize("prefix", BAD_PREFIXES)
def test_bad_prefixes_are_rejected(prefix: str) -> None:
    with pytest.raises(BadKey, match="prefix"):
        validate_prefix(prefix)


def test_the_empty_prefix_lists_everything_and_length_limits_hold() -> None:
    assert validate_prefix("") == ""
    longest = "/".join(["k" * 255] * 3 + ["k" * 254, "k"])
    assert len(longest) == 1024 and validate_key(longest) == longest
    with pytest.raises(BadKey, match="1024"):
        validate_key(longest + "k")
    with pytest.raises(BadKey, match="255"):
        validate_key("k" * 256)
    with pytest.raises(BadKey, match="str"):
        validate_key(b"bytes")  # type: ignore[arg-type]


def test_transient_errors_are_mailbox_errors() -> None:
    error = TransientMailboxError("timed out", store="s3://b", key="k", operation="get")
    assert isinstance(error, MailboxError)
    assert str(error) == "get 'k' on s3://b: timed out"


def test_request_stats_count_exactly_across_threads() -> None:
    stats = RequestStats()

    def hammer() -> None:
        for _ in range(5_000):
            stats.count("get", bytes_in=3)
            stats.count("create", bytes_out=2)

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert stats.snapshot() == {
        "get": 40_000,
        "put": 0,
        "create": 40_000,
        "list": 0,
        "delete": 0,
        "bytes_in": 120_000,
        "bytes_out": 80_000,
    }
    assert stats["get"] == 40_000
    with pytest.raises(ValueError, match="head"):
        stats.count("head")
