"""Real processes, real models, real stores: the shell end to end (issue 6)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

import worker
from cluster import Cluster

from gradientmail import MonotonicClock, mailbox_from_url
from gradientmail._node.exchange import Exchange
from gradientmail.adapters import TorchBackend
from gradientmail.core import keys
from gradientmail.core.records import Commit
from gradientmail.testing._audit import audit

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


def commits(url: str) -> list[Commit]:
    async def read() -> list[Commit]:
        exchange = Exchange(mailbox_from_url(url), MonotonicClock())
        found = []
        for key in await exchange.list_keys("rounds/"):
            if key.endswith("/commit"):
                commit = await exchange.commit(keys.parse(key).round or 0)
                assert commit is not None
                found.append(commit)
        return found

    return asyncio.run(read())


def check_run(cluster: Cluster, results: dict[str, dict], url: str) -> None:
    report = audit(mailbox_from_url(url), backend=TorchBackend())
    assert report.commits >= 10
    rounds, digest, loss = aligned(url)
    assert rounds == max(report.rounds)
    initial = initial_loss()
    assert loss < 0.25 * initial, (loss, initial)
    last = results["last"]
    assert last["closed_at"] == max(r["closed_at"] for r in results.values())
    assert last["params"] == digest, "the last node to close must hold the final commits"


def test_four_processes_through_a_directory(tmp_path: Path, cluster_factory: type[Cluster]) -> None:
    url = f"file://{tmp_path / 'run'}"
    cluster = cluster_factory(url, tmp_path, ALGORITHM)
    # They train from a common start (process start-ups on two cores can lie 80 steps apart),
    # so "last" with its extra steps outlives the others and closes alone, last.
    together = "node-0,node-1,node-2,last"
    for i in range(3):
        cluster.start(f"node-{i}", i, wait_for=together)
    cluster.start("last", 3, steps=240, wait_for=together)
    results = cluster.wait()
    check_run(cluster, results, url)
    report = audit(mailbox_from_url(url), backend=TorchBackend())
    assert report.recomputed == report.commits  # nothing collected: every commit recomputed


def test_through_each_cloud_store(
    tmp_path: Path, cluster_factory: type[Cluster], store_url: str
) -> None:
    # Three processes on moto's S3, the GCS emulator and Azurite in turn (tests/conftest.py).
    url = store_url
    cluster = cluster_factory(url, tmp_path, ALGORITHM)
    together = "node-0,node-1,last"
    for i in range(2):
        cluster.start(f"node-{i}", i, steps=120, wait_for=together)
    cluster.start("last", 2, steps=180, wait_for=together)
    results = cluster.wait()
    check_run(cluster, results, url)


def test_mixed_torch_and_mlx_nodes(tmp_path: Path, cluster_factory: type[Cluster]) -> None:
    pytest.importorskip("mlx.core")
    url = f"file://{tmp_path / 'run'}"
    cluster = cluster_factory(url, tmp_path, ALGORITHM)
    # All three train together from the first round, so torch and MLX deltas meet in rounds.
    together = "torch-0,torch-1,mlx-0"
    cluster.start("torch-0", 0, steps=120, wait_for=together)
    cluster.start("torch-1", 1, steps=120, wait_for=together)
    cluster.start("mlx-0", 2, steps=120, framework="mlx", wait_for=together)
    results = cluster.wait()
    audit(mailbox_from_url(url), backend=TorchBackend(), tolerance=1e-6)
    rounds_torch, digest_torch, loss_torch = aligned(url, "torch")
    rounds_mlx, digest_mlx, loss_mlx = aligned(url, "mlx")
    assert rounds_torch == rounds_mlx
    assert digest_torch == digest_mlx, "torch and MLX must load the same final parameters"
    assert loss_torch == pytest.approx(loss_mlx, rel=1e-4)
    # Training works through both frameworks. The nodes waited for each other through their
    # Sessions' views, so every round averages all three and the run is deterministic up to
    # rounding (0.0548 of the initial loss in every measured run).
    assert loss_torch < 0.07 * initial_loss()
    included = [sorted(i.node for i in c.included) for c in commits(url)]
    assert all(nodes == ["mlx-0", "torch-0", "torch-1"] for nodes in included), included
    rounds = [{i.node for i in c.included} for c in commits(url)]
    assert set().union(*rounds) == set(results), "every framework's deltas went into commits"
    assert any("mlx-0" in r and len(r) > 1 for r in rounds), "torch and MLX deltas averaged"


def claims_without_commit(url: str, node: str) -> list[int]:
    """Rounds where ``node`` holds a claim and no commit exists yet."""

    async def read() -> list[int]:
        exchange = Exchange(mailbox_from_url(url), MonotonicClock())
        found = []
        for key in await exchange.list_keys("rounds/"):
            parsed = keys.parse(key)
            if parsed.kind != "claim" or parsed.round is None:
                continue
            claims = await exchange.claims(parsed.round)
            if any(c.node == node for c in claims) and await exchange.commit(parsed.round) is None:
                found.append(parsed.round)
        return found

    return asyncio.run(read())


def test_closer_killed_between_claim_and_commit(
    tmp_path: Path, cluster_factory: type[Cluster]
) -> None:
    url = f"file://{tmp_path / 'run'}"
    cluster = cluster_factory(url, tmp_path, ALGORITHM)
    for i in range(3):
        cluster.start(f"node-{i}", i, steps=200)
    cluster.start("victim", 3, steps=200, slow_commit=60)
    deadline = time.monotonic() + 180
    while not (stuck := claims_without_commit(url, "victim")):
        assert time.monotonic() < deadline, "the victim never claimed a round"
        time.sleep(0.05)
    cluster.kill("victim")
    results = cluster.wait()
    report = audit(mailbox_from_url(url), backend=TorchBackend())
    taken_over = [c for c in commits(url) if c.round == stuck[0]]
    assert taken_over and taken_over[0].attempt >= 1 and taken_over[0].closer != "victim"
    assert any(
        e["event"] == "TookOver" and e["round"] == stuck[0]
        for node in results
        for e in cluster.events(node)
    )
    assert report.commits >= 10
    loss = aligned(url)[2]
    # A failure here has been seen once in CI and never here: say what the run did.
    ran = {n: (r.get("final_loss"), r.get("rounds_seen")) for n, r in results.items()}
    closed = [
        (c.round, c.attempt, c.closer, sorted(i.node for i in c.included)) for c in commits(url)
    ]
    said = f"loss {loss}, stuck {stuck}, nodes {ran}, commits {closed}"
    assert loss < 0.25 * initial_loss(), said


def test_late_joiner_and_full_restart(tmp_path: Path, cluster_factory: type[Cluster]) -> None:
    url = f"file://{tmp_path / 'run'}"
    first = cluster_factory(url, tmp_path, ALGORITHM)
    first.start("node-0", 0, steps=240, step_time=0.02)
    first.start("node-1", 1, steps=240, step_time=0.02)
    deadline = time.monotonic() + 180
    while len(commits(url)) < 4:
        assert time.monotonic() < deadline, "no commits"
        time.sleep(0.1)
    first.start("late", 2, steps=80)
    results = first.wait()
    assert results["late"]["joined_rounds_seen"] >= 3, "a late joiner starts from the newest commit"
    before = max(c.round for c in commits(url))
    # Everyone stopped; a new generation resumes from the mailbox with nothing lost.
    second = cluster_factory(url, tmp_path / "second", ALGORITHM)
    (tmp_path / "second").mkdir()
    second.start("node-0", 0, steps=60)
    second.start("node-1", 1, steps=60)
    again = second.wait()
    # Each resumes from the newest commit it finds; the first may commit before the second joins.
    assert all(r["joined_rounds_seen"] >= before for r in again.values())
    assert min(r["joined_rounds_seen"] for r in again.values()) == before
    report = audit(mailbox_from_url(url), backend=TorchBackend())
    assert max(report.rounds) > before
    assert set(range(max(report.rounds) + 1)) == set(report.rounds), "no committed round lost"
