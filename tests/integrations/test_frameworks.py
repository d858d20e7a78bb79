"""Frameworks' own loops on a run: the Hugging Face ``Trainer`` and PyTorch Lightning, each
as two node processes through a directory mailbox, audited."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import frameworks_worker

sys.path.insert(0, str(Path(__file__).parents[1] / "shell"))

from test_multiprocess import commits  # every commit record of a run

from gradientmail import align, mailbox_from_url
from gradientmail.adapters import TorchBackend
from gradientmail.testing._audit import audit

WORKER = Path(__file__).with_name("frameworks_worker.py")
NODES = ("node-a", "node-b")
STEPS = 40


def included(url: str) -> list[set[str]]:
    return [{i.node for i in commit.included} for commit in commits(url)]


def run_two_nodes(framework: str, tmp_path: Path) -> tuple[str, list[dict]]:
    url = f"file://{tmp_path / 'run'}"
    together = ",".join(NODES)
    processes = [
        subprocess.Popen(
            [
                *(sys.executable, str(WORKER), framework, url, node),
                *(str(tmp_path / f"{node}.json"), "--seed", str(i), "--steps", str(STEPS)),
                *("--wait-for", together),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i, node in enumerate(NODES)
    ]
    try:
        outputs = [p.communicate(timeout=300)[0] for p in processes]
    finally:
        for p in processes:
            p.kill()
    for p, out in zip(processes, outputs, strict=True):
        assert p.returncode == 0, out[-4000:]
    return url, [json.loads((tmp_path / f"{node}.json").read_text()) for node in NODES]


def check(framework: str, url: str, results: list[dict], per_step: int) -> None:
    report = audit(mailbox_from_url(url), backend=TorchBackend())
    assert report.commits >= 6, report
    # Every step's samples (tokens for the Trainer) reach the commits: each fragment's rounds
    # count each node's steps once, and close() publishes what trained since the last rounds.
    fragments = frameworks_worker.ALGORITHM.fragments
    assert report.samples == fragments * len(NODES) * STEPS * per_step, report
    rounds = included(url)
    assert any(r == set(NODES) for r in rounds), "both nodes' deltas were averaged"
    for result in results:
        assert result["after"] < 0.8 * result["before"], result
    assert report.recomputed == report.commits
    # The node that closed last holds the run's final parameters, as align loads them.
    fresh = frameworks_worker.make_model(framework, seed=99)
    assert align(fresh, mailbox=mailbox_from_url(url)) == max(report.rounds)
    last = max(results, key=lambda r: r["closed_at"])
    assert last["params"] == frameworks_worker.digest(fresh)


def test_hugging_face_trainer_nodes(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    url, results = run_two_nodes("transformers", tmp_path)
    check("transformers", url, results, per_step=4 * 16)  # 4 sequences of 16 tokens


def test_lightning_trainer_nodes(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    url, results = run_two_nodes("lightning", tmp_path)
    check("lightning", url, results, per_step=2 * 16)  # 2 batches of 16 samples
