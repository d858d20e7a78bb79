"""A node's events as TensorBoard scalars, read back from the event files TensorBoard writes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorboard")
torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parents[1] / "shell"))

from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    EventAccumulator,
)
from virtual_run import make_model  # noqa: E402

from gradientmail import DiLoCo, Session, log_events, mailbox_from_url  # noqa: E402
from gradientmail.integrations.tensorboard import TensorBoardEvents  # noqa: E402

STEPS = 24


def test_rounds_bytes_stalls_and_staleness_become_scalars(tmp_path: Path) -> None:
    events = TensorBoardEvents(tmp_path / "tb")
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    # Synchronous DiLoCo: every round's step() waits for its commit, so stalls are certain.
    algorithm = DiLoCo(inner_steps=4, fragments=2, overlap_steps=0)
    with Session(
        model,
        algorithm=algorithm,
        mailbox=mailbox_from_url((tmp_path / "run").as_uri()),
        poll_interval=0.02,
        lease_every=0.2,
        lease_timeout=1.0,
        callbacks=(log_events, events),
    ) as session:
        for _ in range(STEPS):
            x = torch.randn(8, 4)
            model(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            session.step(samples=8)
    events.close()
    found = EventAccumulator(str(tmp_path / "tb")).Reload()
    tags = set(found.Tags()["scalars"])
    want = {"round", "staleness_steps", "stall_seconds", "stall_seconds_total"}
    want |= {"published_bytes_total", "published_steps", "commit_seconds", "commit_included"}
    assert {f"gradientmail/{t}" for t in want} <= tags, tags
    rounds = found.Scalars("gradientmail/round")
    # Every round merged, in order, at inner steps of the node's own count.
    assert [int(s.value) for s in rounds] == list(range(len(rounds))) and len(rounds) >= 10
    assert all(0 < s.step <= STEPS for s in rounds)
    assert [s.step for s in rounds] == sorted(s.step for s in rounds)
    stalls = found.Scalars("gradientmail/stall_seconds")
    assert stalls and all(s.value > 0 for s in stalls)
    total = found.Scalars("gradientmail/stall_seconds_total")[-1].value
    assert total == pytest.approx(sum(s.value for s in stalls), rel=1e-5)
    # A synchronous merge comes at the step it was captured at: no staleness.
    assert {s.value for s in found.Scalars("gradientmail/staleness_steps")} == {0.0}
    published = [s.value for s in found.Scalars("gradientmail/published_bytes_total")]
    assert published == sorted(published) and published[0] > 0
    assert {s.value for s in found.Scalars("gradientmail/commit_included")} == {1.0}
