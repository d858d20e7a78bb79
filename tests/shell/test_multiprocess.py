"""Real processes, real models, real stores: the shell end to end (issue 6)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

pytest.importorskip("torch")

import worker  # noqa: E402
from cluster import Cluster  # noqa: E402

from gradientmail import mailbox_from_url  # noqa: E402
from gradientmail.adapters import TorchBackend  # noqa: E402
from gradientmail.testing.audit import audit  # noqa: E402

ALGORITHM = {"inner_steps": 20, "fragments": 2, "overlap_steps": 1, "grace": 3.0}


def initial_loss(framework: str = "torch") -> float:
    """Held-out loss of the model every node starts from."""
    x, y = worker.data(999, 512)
    return float(worker.Trainer(framework, seed=0).evaluate(x, y))


def aligned(url: str, framework: str = "torch") -> tuple[int, str, float]:
    from gradientmail import align

    trainer = worker.Trainer(framework, seed=7)  # a different init: align must overwrite it
    rounds = align(trainer.model, mailbox=mailbox_from_url(url))
    x, y = worker.data(999, 512)
    return rounds, worker.params_digest(trainer.model, framework), trainer.evaluate(x, y)


def check_run(cluster: Cluster, results: dict[str, dict], url: str) -> None:
    report = audit(mailbox_from_url(url), backend=TorchBackend())
    assert report.commits >= 10
    rounds, digest, loss = aligned(url)
    assert rounds == max(report.rounds)
    initial = initial_loss()
    assert loss < 0.25 * initial, (loss, initial)
    last = max(results.values(), key=lambda r: r["closed_at"])
    assert last["params"] == digest, "the last node to close must hold the final commits"


def test_four_processes_through_a_directory(tmp_path: Path, cluster_factory: type[Cluster]) -> None:
    url = f"file://{tmp_path / 'run'}"
    cluster = cluster_factory(url, tmp_path, ALGORITHM)
    for i in range(4):
        cluster.start(f"node-{i}", i)
    results = cluster.wait()
    check_run(cluster, results, url)
    report = audit(mailbox_from_url(url), backend=TorchBackend())
    assert report.recomputed == report.commits  # nothing collected: every commit recomputed


def test_through_s3_on_moto(tmp_path: Path, cluster_factory: type[Cluster], s3_url: str) -> None:
    url = s3_url.replace("?", f"/{uuid.uuid4().hex[:8]}?", 1) if "?" in s3_url else s3_url
    cluster = cluster_factory(url, tmp_path, ALGORITHM)
    for i in range(3):
        cluster.start(f"node-{i}", i, steps=120)
    results = cluster.wait()
    check_run(cluster, results, url)
