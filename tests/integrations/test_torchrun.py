"""Nodes made of ``torchrun`` groups: two nodes of two gloo ranks each (DDP inside the group,
DiLoCo between groups) through a directory mailbox, audited; and a rank that dies takes its
group out of the run, not the run down."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.parametrize("sharding", ["ddp", "fsdp2"])
def test_a_rank_that_dies_takes_its_group_out_not_the_run(tmp_path: Path, sharding: str) -> None:
    from gradientmail.integrations.torchrun import shard_url

    url = f"file://{tmp_path / 'run'}"
    extra = ("--fsdp",) if sharding == "fsdp2" else ()
    steady = torchrun(url, "a", tmp_path, "--steps", str(STEPS), *extra)
    dying = torchrun(url, "b", tmp_path, "--steps", str(STEPS), "--die-at", "12", *extra)
    code, output = finish(dying)
    assert code != 0, "the group with a dead rank stops"
    code, output = finish(steady)
    assert code == 0, output[-4000:]
    runs = [url] if sharding == "ddp" else [shard_url(url, rank, 2) for rank in (0, 1)]
    for run in runs:
        report = audit(mailbox_from_url(run), backend=TorchBackend())
        assert report.recomputed == report.commits >= 6, (run, report)
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


def test_two_nodes_of_two_fsdp2_ranks_end_on_the_same_parameters(tmp_path: Path) -> None:
    """FSDP2 (``fully_shard``): rank i of each group runs shard i's run; no rank gathers the
    model. Each shard's run is audited, same-rank shards of both nodes end equal and equal to
    what ``align`` loads from their shard's run, and the whole model assembled from the shards
    is the same on every rank of every node."""
    import torch

    from gradientmail.integrations.torchrun import shard_module, shard_url

    url = f"file://{tmp_path / 'run'}"
    groups = [torchrun(url, node, tmp_path, "--steps", str(STEPS), "--fsdp") for node in "ab"]
    for code, output in map(finish, groups):
        assert code == 0, output[-4000:]
    files = sorted(tmp_path.glob("*-rank*.json"))
    results = {(r["node"], r["rank"]): r for r in (json.loads(f.read_text()) for f in files)}
    assert sorted(results) == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    assembled: dict[str, list[torch.Tensor]] = {}
    for rank in (0, 1):
        shard_run = mailbox_from_url(shard_url(url, rank, 2))
        report = audit(shard_run, backend=TorchBackend())
        assert report.commits >= 6 and report.recomputed == report.commits, (rank, report)
        # The group's samples (2 ranks x 8) counted once per step and fragment, in each shard.
        assert report.samples == 2 * 2 * STEPS * 2 * torchrun_worker.BATCH, (rank, report)
        assert results["a", rank]["params"] == results["b", rank]["params"], f"shard {rank}"
        saved = torch.load(tmp_path / f"a-rank{rank}.pt")
        # Rank 1 holds no row of the last layer (a 1-row weight): its shard's run lacks it.
        fresh = shard_module({n: torch.zeros_like(t) for n, t in saved.items() if t.numel()})
        newest = align(fresh, mailbox=shard_run)
        # Both groups merged the shard run's newest commit last.
        assert {results[node, rank]["rounds"] for node in "ab"} == {newest}, (rank, newest)
        loaded = dict(fresh.named_parameters())
        for name, value in saved.items():
            if value.numel():
                assert torch.equal(loaded[name].detach(), value), (rank, name)
            assembled.setdefault(name, []).append(value)
    whole = torchrun_worker.make_model()
    with torch.no_grad():
        for name, p in whole.named_parameters():
            p.copy_(torch.cat(assembled[name]))
    assert {r["full"] for r in results.values()} == {torchrun_worker.digest(whole)}
    assert torchrun_worker.digest(whole) != torchrun_worker.digest(torchrun_worker.make_model())


def test_shard_url_puts_each_shard_under_the_run() -> None:
    from gradientmail.integrations.torchrun import shard_url

    assert shard_url("/runs/a", 1, 4) == "/runs/a/shard-1-of-4"
    assert shard_url("file:///runs/a/", 0, 2) == "file:///runs/a/shard-0-of-2"
    assert (
        shard_url("s3://bucket/runs/a?endpoint=http://127.0.0.1:9000", 1, 2)
        == "s3://bucket/runs/a/shard-1-of-2?endpoint=http://127.0.0.1:9000"
    )
    with pytest.raises(ValueError, match="rank 2 is not one of 2 ranks"):
        shard_url("/runs/a", 2, 2)


SHARDING_ERRORS = """
import sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from gradientmail import DiLoCo, mailbox_from_url
from gradientmail.integrations.torchrun import GroupSession

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
url = sys.argv[1]
half = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
fully_shard(half[0])  # the second layer left whole
whole = fully_shard(torch.nn.Linear(4, 4))
for model, mailbox in ((half, url), (whole, mailbox_from_url(url)), (whole, sys.argv[2])):
    try:
        GroupSession(model, algorithm=DiLoCo(inner_steps=4), mailbox=mailbox)
    except (TypeError, ValueError) as exc:
        print(type(exc).__name__, exc)
dist.destroy_process_group()
"""


def test_a_model_sharded_otherwise_is_refused_by_name(tmp_path: Path) -> None:
    # A run whose shards were made by groups of 2 ranks (its first shard's manifest key).
    manifest = tmp_path / "pairs" / "shard-0-of-2" / "manifest"
    manifest.parent.mkdir(parents=True)
    manifest.write_bytes(b"{}")
    done = subprocess.run(
        [sys.executable, "-c", SHARDING_ERRORS, str(tmp_path / "run"), str(tmp_path / "pairs")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = done.stdout.splitlines()
    assert len(lines) == 3, done.stdout + done.stderr[-3000:]
    assert lines[0].startswith("ValueError parameter '1.weight' is not sharded"), lines[0]
    assert lines[1].startswith("TypeError mailbox: a model sharded by fully_shard"), lines[1]
    assert lines[2].startswith(f"ValueError {tmp_path / 'pairs'} holds the runs of groups of 2 "), (
        lines[2]
    )
    assert "this group has 1" in lines[2]
    assert not (tmp_path / "run").exists(), "nothing is written for a refused model"
    assert [p.name for p in (tmp_path / "pairs").iterdir()] == ["shard-0-of-2"]
