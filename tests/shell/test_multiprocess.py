"""Real processes, real models, real stores: the shell end to end (issue 6)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

pytest.importorskip("torch")

from cluster import Cluster, WORKER  # noqa: E402

from gradientmail import mailbox_from_url  # noqa: E402
from gradientmail.adapters import TorchBackend  # noqa: E402
from gradientmail.testing.audit import audit  # noqa: E402

ALGORITHM = {"inner_steps": 20, "fragments": 2, "overlap_steps": 1, "grace": 3.0}


def aligned(url: str, framework: str = "torch") -> tuple[int, str, float]:
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("worker", WORKER)
    assert spec is not None and spec.loader is not None
    worker = importlib.util.module_from_spec(spec)
    sys.modules["worker"] = worker
    spec.loader.exec_module(worker)
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
    initial = min(r["initial_loss"] for r in results.values())
    assert loss < 0.5 * initial, (loss, initial)
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
