"""A hostile writer in a signed run changes nothing: on virtual time the same commits and the
same final parameters as without it; beside real node processes, a run that audits clean,
ends with every node and ``align`` on the same parameters and learns as well as without it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import worker  # noqa: E402
from cluster import Cluster  # noqa: E402
from examples import KEYRING, SECRET  # noqa: E402
from hostile import HostileMailbox  # noqa: E402
from virtual_run import committed_rounds, make_model, parameters, run_nodes  # noqa: E402

from gradientmail import align, mailbox_from_url  # noqa: E402
from gradientmail._clock import MonotonicClock  # noqa: E402
from gradientmail._events import Excluded, Rejected  # noqa: E402
from gradientmail._node.exchange import Exchange  # noqa: E402
from gradientmail._secrets import SECRET_ENV, SECRET_FILE_ENV  # noqa: E402
from gradientmail.adapters.torch import (  # noqa: E402
    TorchAdapter,
    TorchBackend,
)
from gradientmail.core import keys  # noqa: E402
from gradientmail.core.robust import snapshot_bound  # noqa: E402
from gradientmail.core.signing import Keyring  # noqa: E402
from gradientmail.mailboxes._memory import MemoryMailbox  # noqa: E402
from gradientmail.mailboxes._protocol import Mailbox  # noqa: E402
from gradientmail.testing._audit import audit  # noqa: E402

HONEST = {"node-0", "node-1", "node-2"}


def oversized_bytes() -> int:
    schema = TorchAdapter(make_model()).schema
    return max(snapshot_bound(schema.subset(schema.names[k::2])) for k in range(2)) + 1


def test_a_hostile_writer_changes_nothing_in_a_signed_run() -> None:
    hostile: list[HostileMailbox] = []

    def wrap(store: MemoryMailbox) -> Mailbox:
        hostile.append(HostileMailbox(store, fragments=2, oversized=oversized_bytes()))
        return hostile[0]

    store, events, models, _ = run_nodes(wrap=wrap, keyring=KEYRING)
    _, clean_events, clean_models, _ = run_nodes(keyring=KEYRING)
    rounds = committed_rounds(events)
    assert rounds == committed_rounds(clean_events) and len(rounds) >= 8
    assert parameters(models) == parameters(clean_models)

    writer = hostile[0]
    for r in rounds:
        planted = [k for k in writer.planted if k.startswith(keys.round_prefix(r))]
        assert len(planted) >= 7 + (r >= 2), f"the writer was busy in round {r}"
    excluded = {(e.key.rsplit("/", 1)[1], e.reason) for e in events if isinstance(e, Excluded)}
    reasons = {who: {r for w, r in excluded if w == who} for who in ("eve", "mallory", "trent")}
    assert any("bad signature" in r for r in reasons["eve"])
    assert any("magic" in r for r in reasons["mallory"])
    assert any("record names node-" in r for r in reasons["trent"]), "replays are rejected"
    assert any(w == "oscar" and "not downloaded" in r for w, r in excluded)
    assert not [k for k in writer.fetched if k.endswith("/snapshots/oscar")], "never downloaded"
    rejected = {e.key: e.reason for e in events if isinstance(e, Rejected)}
    assert "bad signature" in rejected[keys.lease("eve")]
    assert "not downloaded" in rejected[keys.lease("oscar")]
    assert keys.lease("mallory") in rejected
    assert any("claims" in k and "bad signature" in reason for k, reason in rejected.items())
    # Every round's first two commit keys were squatted before its close: passed, reported,
    # and each round committed once, at its third key (core.slots).
    for r in rounds:
        assert "bad signature" in rejected[keys.commit(r, 0)], r
        assert "magic" in rejected[keys.commit(r, 1)], r
        assert asyncio.run(store.get(keys.commit(r, 2))) is not None, r
        assert asyncio.run(store.get(keys.commit(r, 3))) is None, r

    # Every honest node's first two snapshot keys of every round were squatted before it
    # published (a forgery naming it, then an object too large to be a snapshot): it
    # published at its third, which its round's commit includes (core.slots).
    for r in rounds:
        for node in sorted(HONEST):
            assert "bad signature" in rejected[keys.snapshot(r, node)], (r, node)
            assert "not downloaded" in rejected[keys.snapshot(r, node, 1)], (r, node)
            assert asyncio.run(store.get(keys.snapshot(r, node, 2))) is not None, (r, node)
    # The run was created at its third manifest key, past garbage and an oversized object.
    assert "magic" in rejected[keys.manifest(0)]
    assert "not downloaded" in rejected[keys.manifest(1)]
    assert asyncio.run(store.get(keys.manifest(2))) is not None
    assert included(store, rounds, KEYRING) == HONEST
    # The audit reads the store as the hostile writer left it: everything it planted is
    # reported (rejected, or foreign to the key layout), and nothing counts as a violation.
    report = audit(store, backend=TorchBackend(), keyring=KEYRING)
    assert report.recomputed == report.commits == len(rounds)
    rejected = dict(report.rejected)
    assert writer.planted <= set(rejected) | set(report.foreign)
    assert "bad signature" in rejected[keys.claim(rounds[0], 0)]
    assert "bad signature" in rejected[keys.snapshot(rounds[0], "eve")]
    assert all(key in writer.planted for key in rejected), "no honest object is reported"


WRITER = Path(__file__).with_name("hostile_writer.py")
# Every round waits for all three nodes (quorum 3; a node's lateness is forgiven for up to 10 s),
# nodes start together (worker --wait-for), and a node merges each commit before its next step
# (overlap 0): so every merge happens at the same step in every run, and a run's parameters do
# not depend on the scheduler.
PROCESS_ALGORITHM = {
    "inner_steps": 10,
    "fragments": 2,
    "overlap_steps": 0,
    "quorum_size": 3,
    "grace": 10.0,
}
PROCESS_STEPS = 40


def start_writer(url: str, tmp: Path) -> subprocess.Popen[bytes]:
    """The writer process, once it has squatted the run's first manifest keys."""
    log = open(tmp / "writer.log", "wb")  # noqa: SIM115 - closed with the process
    args = [sys.executable, str(WRITER), "--mailbox", url, "--stop", str(tmp / "stop")]
    args += ["--out", str(tmp / "writer.json"), "--ready", str(tmp / "ready")]
    args += ["--nodes", ",".join(sorted(HONEST))]
    writer = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    deadline = time.monotonic() + 60
    while not (tmp / "ready").exists():
        assert writer.poll() is None, (tmp / "writer.log").read_text()
        assert time.monotonic() < deadline, "the writer did not start"
        time.sleep(0.05)
    return writer


def included(mailbox: Mailbox, rounds: Iterable[int], keyring: Keyring | None = None) -> set[str]:
    """The nodes whose snapshots the commits of ``rounds`` include."""

    async def read() -> set[str]:
        exchange = Exchange(mailbox, MonotonicClock(), keyring=keyring)
        found: set[str] = set()
        for r in rounds:
            commit = await exchange.commit(r)
            assert commit is not None
            found |= {i.node for i in commit.included}
        return found

    return asyncio.run(read())


def summary(url: str) -> list[tuple[int, str, list[str]]]:
    """Every commit of the signed run at ``url``: round, closer, included nodes."""

    rounds = audit(mailbox_from_url(url), keyring=KEYRING).rounds

    async def read() -> list[tuple[int, str, list[str]]]:
        exchange = Exchange(mailbox_from_url(url), MonotonicClock(), keyring=KEYRING)
        found = []
        for r in rounds:
            commit = await exchange.commit(r)
            assert commit is not None
            found.append((r, commit.closer, [i.node for i in commit.included]))
        return found

    return asyncio.run(read())


def aligned(url: str) -> tuple[int, str, float]:
    trainer = worker.Trainer("torch", seed=7)  # another init: align must overwrite it
    rounds = align(trainer.model, mailbox=mailbox_from_url(url), secret=SECRET)
    x, y = worker.data(999, 512)
    return rounds, worker.params_digest(trainer.model, "torch"), trainer.evaluate(x, y)


def test_a_hostile_writer_process_beside_three_node_processes_changes_no_outcome(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three honest node processes train through a directory mailbox of a signed run while a
    fourth process without the secret (``hostile_writer.py``) writes garbage, forgeries,
    replays and oversized objects under the run's keys, squats the run's first manifest keys
    before it exists and every honest node's first snapshot keys of every round before it
    publishes; a second, clean run of three nodes trains at the same time for comparison.

    Every node of both runs ends with the same parameters, bit for bit, which are ``align``'s:
    with ``overlap_steps=0`` and every round waiting for all three nodes, a run's parameters do
    not depend on the scheduler, so the writer changed nothing. The audit, with the run's
    keyring, recomputes every commit from exactly the snapshots it lists and finds no
    violation, and everything the writer wrote is reported.
    """
    monkeypatch.setenv(SECRET_ENV, SECRET.decode())
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    runs = {}
    for name in ("hostile", "clean"):
        (tmp_path / name).mkdir()
        url = f"file://{tmp_path / name / 'run'}"
        runs[name] = Cluster(url, tmp_path / name, PROCESS_ALGORITHM)
    hostile = runs["hostile"]
    writer = start_writer(hostile.url, tmp_path / "hostile")
    try:
        for cluster in runs.values():
            for i in range(3):
                cluster.start(f"node-{i}", i, steps=PROCESS_STEPS, wait_for=",".join(HONEST))
        results = {name: cluster.wait() for name, cluster in runs.items()}
        (tmp_path / "hostile" / "stop").touch()
        assert writer.wait(timeout=60) == 0, (tmp_path / "hostile" / "writer.log").read_text()
    finally:
        writer.kill()
        for cluster in runs.values():
            cluster.kill_all()
    wrote = json.loads((tmp_path / "hostile" / "writer.json").read_text())
    assert wrote["replaced"] == [], "create-only keys held"
    # It wrote while the nodes ran (a pass before the stop, and one after) and tried to replace
    # honest records; how many passes fit in the run depends on the machine's load (6 under a
    # loaded CI run, 10 or more here), so the squatted commits below show it kept ahead.
    assert wrote["refused"] and wrote["passes"] >= 2

    report = audit(mailbox_from_url(hostile.url), backend=TorchBackend(), keyring=KEYRING)
    assert report.commits >= 8 and report.recomputed == report.commits
    rejected = dict(report.rejected)
    planted = set(wrote["planted"])
    assert planted <= set(rejected) | set(report.foreign), "every object it wrote is reported"
    assert set(rejected) <= planted, "no honest object is rejected"
    assert included(mailbox_from_url(hostile.url), report.rounds, KEYRING) == HONEST
    squatted = [r for r in report.rounds if keys.commit(r, 0) in planted]
    assert squatted, "the writer squatted commit keys before the rounds closed"
    assert all("bad signature" in rejected[keys.commit(r, 0)] for r in squatted)
    # The run was created behind the squatted manifest keys; the forgery after it is unread.
    assert {keys.manifest(0), keys.manifest(1), keys.manifest(3)} <= planted
    assert "magic" in rejected[keys.manifest(0)]
    assert "not downloaded" in rejected[keys.manifest(1)]
    # Snapshot keys squatted before their node published: the node published behind them.
    ahead = [
        (r, node)
        for r in report.rounds
        for node in HONEST
        if {keys.snapshot(r, node), keys.snapshot(r, node, 1)} <= planted
        and (tmp_path / "hostile" / "run" / keys.snapshot(r, node, 2)).exists()
    ]
    assert len(ahead) >= len(report.rounds), "most honest snapshots were published behind squats"
    assert all("bad signature" in rejected[keys.snapshot(r, node)] for r, node in ahead)

    finals = {}
    for name, cluster in runs.items():
        rounds, digest, _ = aligned(cluster.url)
        finals[name] = (rounds, digest)
        ran = {n: (r["rounds_seen"], r["params"][:8]) for n, r in results[name].items()}
        said = f"{name}: align {rounds} {digest[:8]}, nodes {ran}, commits {summary(cluster.url)}"
        assert rounds == max(audit(mailbox_from_url(cluster.url), keyring=KEYRING).rounds), said
        assert {r["params"] for r in results[name].values()} == {digest}, said
        assert all(r["rounds_seen"] == rounds for r in results[name].values()), said
        assert all(r["final_loss"] < 0.5 * r["initial_loss"] for r in results[name].values())
    assert finals["hostile"] == finals["clean"], "bit for bit the clean run's parameters"

    events = [e for node in results["hostile"] for e in hostile.events(node)]
    excluded = {
        (e["key"].rsplit("/", 1)[1], e["reason"]) for e in events if e["event"] == "Excluded"
    }
    assert any(who == "eve" and "bad signature" in why for who, why in excluded)
    assert any(who == "oscar" and "not downloaded" in why for who, why in excluded)
    assert any(who == "trent" and "record names node-" in why for who, why in excluded)
    rejected_events = {e["key"] for e in events if e["event"] == "Rejected"}
    assert keys.lease("eve") in rejected_events and keys.lease("oscar") in rejected_events
