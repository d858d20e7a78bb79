"""specs/ lives at the repository root, outside the installed package: make it importable."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402
import worlds  # noqa: E402


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the explorations the selected tests need, in the background (``worlds``)."""
    worlds.start(item.name for item in session.items)


def pytest_sessionfinish(session: pytest.Session) -> None:
    worlds.stop()
