"""Fixtures for the mailbox tests: one moto S3 server on 127.0.0.1 for the whole session."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from gradientmail.testing._s3 import moto_s3, with_prefix


@pytest.fixture(scope="session")
def moto_server_url() -> Iterator[str]:
    """``s3://gradientmail/mailbox?endpoint=http://127.0.0.1:PORT&region=us-east-1``."""
    with moto_s3() as url:
        yield url


@pytest.fixture
def moto_url(moto_server_url: str) -> str:
    """A mailbox URL on the session's moto server, under a prefix no other test uses."""
    return with_prefix(moto_server_url, f"test-{secrets.token_hex(6)}")
