"""Shared test settings: Hypothesis profiles, the ``slow`` marker, and one local server per
cloud store (moto for S3, gcp-storage-emulator for GCS, Azurite for Azure) for the session."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

# Hypothesis loads a built-in "ci" profile when CI is set; ours bounds the suite on top of it.
settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile("dev", max_examples=100, deadline=None, print_blob=True)
settings.register_profile(
    "thorough",
    max_examples=5_000,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", help="run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# CI sets this: an emulator that cannot start fails its tests instead of skipping them.
REQUIRE_EMULATORS = os.environ.get("GRADIENTMAIL_REQUIRE_EMULATORS") == "1"
STORES = ("s3", "gcs", "azure")


@pytest.fixture(scope="session")
def s3_server_url() -> Iterator[str]:
    """``s3://gradientmail/mailbox?endpoint=...``: moto's S3 server on 127.0.0.1."""
    from gradientmail.testing._s3 import moto_s3

    with moto_s3() as url:
        yield url


@pytest.fixture(scope="session")
def gcs_server_url() -> Iterator[str]:
    """``gs://gradientmail/mailbox?service_account=...``: the GCS emulator on 127.0.0.1."""
    from gradientmail.testing._gcs import gcs_emulator

    with gcs_emulator() as url:
        yield url


@pytest.fixture(scope="session")
def azure_server_url() -> Iterator[str]:
    """``az://gradientmail/mailbox?...``: Azurite's blob service on 127.0.0.1."""
    from gradientmail.testing._azure import AzuriteMissing, azurite_blob

    try:
        server = azurite_blob()
        url = server.__enter__()
    except AzuriteMissing as error:
        if REQUIRE_EMULATORS:
            raise
        pytest.skip(str(error))
    try:
        yield url
    finally:
        server.__exit__(None, None, None)


@pytest.fixture(params=STORES)
def store_url(request: pytest.FixtureRequest) -> str:
    """A fresh mailbox URL (its own prefix) on each cloud store's local server in turn."""
    from gradientmail.testing._s3 import with_prefix

    server: str = request.getfixturevalue(f"{request.param}_server_url")
    return with_prefix(server, f"test-{secrets.token_hex(6)}")
