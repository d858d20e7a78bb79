"""Settings shared by the simulation tests."""

from __future__ import annotations

import pytest

from gradientmail.testing.sim_config import KNOWN_WORKAROUNDS


@pytest.fixture
def workarounds() -> dict[str, str]:
    """``KNOWN_WORKAROUNDS``: overrides that steer the swarm around the protocol bugs found
    and not fixed yet (each reproduced by a strict xfail in test_sim_findings.py)."""
    return dict(KNOWN_WORKAROUNDS)
