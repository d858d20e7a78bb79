"""Fixtures for the mailbox tests (the servers themselves live in tests/conftest.py)."""

from __future__ import annotations

import secrets

import pytest

from gradientmail.testing._s3 import with_prefix


@pytest.fixture
def moto_url(s3_server_url: str) -> str:
    """A mailbox URL on the session's moto server, under a prefix no other test uses."""
    return with_prefix(s3_server_url, f"test-{secrets.token_hex(6)}")
