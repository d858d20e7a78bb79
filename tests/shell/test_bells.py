"""Bells: a Session's loops wake each other instead of waiting for the next poll.

The polls remain for what other nodes do; what a node does itself (a capture to upload, its own
snapshot to consider, its own commit to fetch) is handled at once. A lone node with a poll
interval of 20 s shows it: without bells every round would wait several polls at the overlap
bound, so the run below would take minutes.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from gradientmail._clock import ThreadBell as Bell

torch = pytest.importorskip("torch")

from virtual_run import drift, make_model  # noqa: E402

from gradientmail import DiLoCo, Session, align, mailbox_from_url  # noqa: E402

LONG = 20.0  # seconds: a poll interval nothing in these tests may wait out


def test_a_ring_from_another_thread_ends_the_sleep() -> None:
    bell = Bell()

    async def sleeper() -> float:
        start = time.monotonic()
        threading.Timer(0.1, bell.ring).start()
        await bell.sleep(LONG)
        return time.monotonic() - start

    assert asyncio.run(sleeper()) < LONG / 2


def test_a_ring_before_the_sleep_is_not_lost_and_counts_once() -> None:
    bell = Bell()

    async def sleeps() -> tuple[float, float]:
        bell.ring()
        start = time.monotonic()
        await bell.sleep(LONG)  # rang before: returns at once
        first = time.monotonic() - start
        start = time.monotonic()
        await bell.sleep(0.2)  # nothing rang since: a full sleep
        return first, time.monotonic() - start

    first, second = asyncio.run(sleeps())
    assert first < LONG / 2
    assert second >= 0.19


def test_a_lone_node_with_slow_polls_never_waits_for_them(tmp_path: Path) -> None:
    """Overlap 1 blocks every publish until its round commits: the node's own upload, close
    and fetch must each happen at once, and close must not wait out a poll either."""
    algorithm = DiLoCo(inner_steps=4, fragments=2, overlap_steps=1)
    mailbox = mailbox_from_url(f"file://{tmp_path / 'run'}")
    model = make_model()
    start = time.monotonic()
    with Session(
        model,
        algorithm=algorithm,
        mailbox=mailbox,
        poll_interval=LONG,
        lease_every=1.0,
        lease_timeout=2 * 1.0 + LONG,
        callbacks=(),
    ) as session:
        drift(model, session, 16)
        seen = session.rounds_seen
    elapsed = time.monotonic() - start
    assert seen >= 5, f"rounds committed while training: {seen}"
    assert elapsed < LONG, f"{elapsed:.1f} s: a loop waited for a poll"
    fresh = make_model()
    assert align(fresh, mailbox=mailbox) >= seen
    for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
