"""Nodes made of ``torchrun`` groups: two nodes of two gloo ranks each (DDP inside the group,
DiLoCo between groups) through a directory mailbox, audited; and a rank that dies takes its
group out of the run, not the run down."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torchrun_worker

from gradientmail import align, mailbox_from_url
from gradientmail.adapters import TorchBackend
from gradientmail.testing._audit import audit

WORKER = Path(__file__).with_name("torchrun_worker.py")
STEPS = 40


def torchrun(url: str, node: str, out: Path, *extra: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(WORKER), url, node, str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


def finish(process: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        output = process.communicate(timeout=300)[0]
    finally:
        process.kill()
    return process.returncode, output


def test_two_nodes_of_two_ranks_end_on_the_same_parameters(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'run'}"
    groups = [torchrun(url, node, tmp_path, "--steps", str(STEPS)) for node in ("a", "b")]
    for code, output in map(finish, groups):
        assert code == 0, output[-4000:]
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*-rank*.json"))]
    assert sorted((r["node"], r["rank"]) for r in results) == [
        ("a", 0),
        ("a", 1),
        ("b", 0),
        ("b", 1),
    ]
    report = audit(mailbox_from_url(url), backend=TorchBackend())
    assert report.commits >= 6 and report.recomputed == report.commits
    # One node per group: the group's samples (2 ranks x 8) counted once per step and fragment.
    assert report.samples == 2 * 2 * STEPS * 2 * torchrun_worker.BATCH, report
    fresh = torchrun_worker.make_model()
    newest = align(fresh, mailbox=mailbox_from_url(url))
    for node in ("a", "b"):
        ranks = [r for r in results if r["node"] == node]
        assert ranks[0]["params"] == ranks[1]["params"], f"node {node}'s ranks differ"
    # Both groups merged the run's newest commit last: every rank holds what align loads.
    assert {r["rounds"] for r in results} == {newest}
    assert {r["params"] for r in results} == {torchrun_worker.digest(fresh)}


def test_a_rank_that_dies_takes_its_group_out_not_the_run(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'run'}"
    steady = torchrun(url, "a", tmp_path, "--steps", str(STEPS))
    dying = torchrun(url, "b", tmp_path, "--steps", str(STEPS), "--die-at", "12")
    code, output = finish(dying)
    assert code != 0, "the group with a dead rank stops"
    code, output = finish(steady)
    assert code == 0, output[-4000:]
    report = audit(mailbox_from_url(url), backend=TorchBackend())
    assert report.recomputed == report.commits >= 6
    names = {p.name for p in tmp_path.glob("*-rank*.json")}
    assert {"a-rank0.json", "a-rank1.json"} <= names and not any(n.startswith("b-") for n in names)


def test_a_group_joining_a_run_with_commits_starts_from_them(tmp_path: Path) -> None:
    # The second group's leader joins at the first group's newest commit; its other rank
    # must agree on that before the first step (a group that did not hung here).
    url = f"file://{tmp_path / 'run'}"
    for node in ("a", "b"):
        code, output = finish(torchrun(url, node, tmp_path, "--steps", "24", "--nodes", "1"))
        assert code == 0, output[-4000:]
    results = {
        (r["node"], r["rank"]): r
        for r in map(json.loads, map(Path.read_text, sorted(tmp_path.glob("*-rank*.json"))))
    }
    assert results["b", 0]["params"] == results["b", 1]["params"]
    assert results["b", 0]["rounds"] > results["a", 0]["rounds"] >= 0
    report = audit(mailbox_from_url(url), backend=TorchBackend())
    assert report.recomputed == report.commits


def test_a_bad_sample_count_on_one_rank_raises_on_every_rank(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'run'}"
    code, output = finish(
        torchrun(url, "a", tmp_path, "--steps", "20", "--nodes", "1", "--bad-samples-at", "5")
    )
    assert code != 0
    # Both ranks raised the same clear error, neither waited out a collective's timeout.
    assert output.count("samples must be a non-negative integer on every rank") >= 2, output[-4000:]
