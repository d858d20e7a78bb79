from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from cluster import Cluster


@pytest.fixture
def cluster_factory(tmp_path: Path) -> Iterator[type[Cluster]]:
    made: list[Cluster] = []

    class Tracked(Cluster):
        def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
            super().__init__(*args, **kwargs)
            made.append(self)

    yield Tracked
    for cluster in made:
        cluster.kill_all()


@pytest.fixture(scope="session")
def s3_url(s3_server_url: str) -> str:
    return s3_server_url
