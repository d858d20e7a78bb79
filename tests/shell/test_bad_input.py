"""Bad input at join and garbage in the mailbox: clear errors, nothing used, nothing lost."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from virtual_run import assert_chains, committed_rounds, make_model, run_nodes  # noqa: E402

from gradientmail import (  # noqa: E402
    ConfigMismatch,
    DiLoCo,
    ProtocolError,
    SchemaMismatch,
    Session,
    align,
    mailbox_from_url,
)
from gradientmail._events import Excluded, Rejected  # noqa: E402
from gradientmail.adapters.torch import TorchBackend  # noqa: E402
from gradientmail.core import keys  # noqa: E402
from gradientmail.core.envelope import seal  # noqa: E402
from gradientmail.core.records import Snapshot, to_bytes  # noqa: E402
from gradientmail.mailboxes._memory import Faults, MemoryMailbox  # noqa: E402
from gradientmail.testing._audit import audit  # noqa: E402

ALGORITHM = DiLoCo(inner_steps=10, fragments=2, overlap_steps=1, grace=5.0)
QUICK = {"poll_interval": 0.05, "lease_every": 0.2, "lease_timeout": 1.0}


def created_run(tmp_path: Path) -> str:
    url = f"file://{tmp_path / 'run'}"
    with Session(make_model(), algorithm=ALGORITHM, mailbox=mailbox_from_url(url), **QUICK):
        pass
    return url


def test_a_mismatched_model_is_refused_naming_the_parameters(tmp_path: Path) -> None:
    url = created_run(tmp_path)
    wider = torch.nn.Sequential(torch.nn.Linear(4, 9), torch.nn.Tanh(), torch.nn.Linear(9, 1))
    with pytest.raises(SchemaMismatch) as caught:
        Session(wider, algorithm=ALGORITHM, mailbox=mailbox_from_url(url), **QUICK)
    assert set(caught.value.names) == {"0.bias", "0.weight", "2.weight"}
    with pytest.raises(SchemaMismatch):
        align(wider, mailbox=mailbox_from_url(url))


def test_a_mismatched_algorithm_is_refused_naming_the_fields(tmp_path: Path) -> None:
    url = created_run(tmp_path)
    other = DiLoCo(inner_steps=20, fragments=2, overlap_steps=1, grace=5.0, outer_lr=0.5)
    with pytest.raises(ConfigMismatch) as caught:
        Session(make_model(), algorithm=other, mailbox=mailbox_from_url(url), **QUICK)
    assert {name for name, _, _ in caught.value.fields} == {"inner_steps", "outer_lr"}
    assert "inner_steps: run has 10, this node 20" in str(caught.value)


def test_a_node_with_another_norm_clip_is_refused_naming_clip(tmp_path: Path) -> None:
    """The clip changes what a commit computes, so it is part of the run's configuration:
    every closer and ``audit`` must apply the same one."""
    url = created_run(tmp_path)
    clipped = DiLoCo(inner_steps=10, fragments=2, overlap_steps=1, grace=5.0, clip=3.0)
    with pytest.raises(ConfigMismatch) as caught:
        Session(make_model(), algorithm=clipped, mailbox=mailbox_from_url(url), **QUICK)
    assert caught.value.fields == (("clip", None, 3.0),)
    assert "clip: run has None, this node 3.0" in str(caught.value)


def test_align_on_an_empty_mailbox_says_there_is_no_run(tmp_path: Path) -> None:
    with pytest.raises(ProtocolError, match="holds no run"):
        align(make_model(), mailbox=mailbox_from_url(f"file://{tmp_path / 'empty'}"))


def test_bad_settings_are_refused_at_once(tmp_path: Path) -> None:
    mailbox = mailbox_from_url(f"file://{tmp_path / 'run'}")
    with pytest.raises(ValueError, match="lease_timeout"):
        Session(make_model(), algorithm=ALGORITHM, mailbox=mailbox, lease_every=10, lease_timeout=5)
    with pytest.raises(ValueError, match="node id"):
        Session(make_model(), algorithm=ALGORITHM, mailbox=mailbox, learner_id="Bad Id!")
    with pytest.raises(ValueError, match="compression"):
        Session(make_model(), algorithm=ALGORITHM, mailbox=mailbox, compression="gzip")  # type: ignore[arg-type]


async def plant_garbage(mailbox: MemoryMailbox) -> None:
    digest = "0" * 64
    forged = Snapshot(
        node="eve",
        nonce="0123456789abcdef",
        round=1,
        base_round=-1,
        samples=10**6,
        steps=1,
        digest=digest,
    )
    await mailbox.create(keys.snapshot(0, "mallory"), b"\x00garbage" * 100)
    await mailbox.create(keys.snapshot(1, "eve"), seal(to_bytes(forged), b"not a payload"))
    await mailbox.create(keys.snapshot(2, "trent"), seal(to_bytes(forged), b""))  # wrong node
    await mailbox.put(keys.lease("mallory"), b"\xff\xfe not a lease")
    await mailbox.put(keys.head(0), b"not a number")
    await mailbox.put("rounds/00000000000000000003/README", b"foreign object")


def test_garbage_under_the_runs_keys_is_reported_and_skipped() -> None:
    mailbox, events, models, _ = run_nodes(ALGORITHM, before=plant_garbage)
    rounds = committed_rounds(events)
    assert_chains(rounds, ALGORITHM.fragments)
    assert len(rounds) >= 8
    excluded = {(e.round, e.key) for e in events if isinstance(e, Excluded)}
    assert (0, keys.snapshot(0, "mallory")) in excluded
    assert (1, keys.snapshot(1, "eve")) in excluded
    rejected = {e.key for e in events if isinstance(e, Rejected)}
    assert keys.lease("mallory") in rejected and keys.head(0) in rejected
    report = audit(mailbox, backend=TorchBackend())
    assert report.recomputed == len(rounds), "every commit derives from its listed snapshots"
    assert report.foreign == ("rounds/00000000000000000003/README",)
    # The garbage changed nothing: the same run without it ends with the same parameters.
    _, clean_events, clean_models, _ = run_nodes(ALGORITHM)
    assert committed_rounds(clean_events) == rounds
    for dirty, clean in zip(models, clean_models, strict=True):
        assert [p.tolist() for p in dirty.parameters()] == [p.tolist() for p in clean.parameters()]


def test_transient_faults_lost_responses_and_conflicts_are_survived() -> None:
    faults = Faults(seed=7, fail_before=0.05, fail_after=0.05, conflict=0.05, delay=(0.0, 0.05))
    mailbox, events, _, _ = run_nodes(ALGORITHM, faults=faults)
    rounds = committed_rounds(events)
    assert_chains(rounds, ALGORITHM.fragments)
    assert len(rounds) >= 8
    assert audit(mailbox, backend=TorchBackend()).recomputed == len(rounds)


def test_wait_for_nodes_returns_the_active_nodes_and_names_them_on_timeout(
    tmp_path: Path,
) -> None:
    url = f"file://{tmp_path / 'run'}"

    def joined(name: str) -> Session:
        mailbox = mailbox_from_url(url)
        return Session(make_model(), algorithm=ALGORITHM, mailbox=mailbox, learner_id=name, **QUICK)

    with joined("a") as a, joined("b") as b:
        both = sorted([a.learner_id, b.learner_id])
        assert a.wait_for_nodes(2, timeout=30) == both
        assert b.wait_for_nodes(2, timeout=30) == both
        with pytest.raises(ProtocolError, match=r"2 of 3 nodes active after 0.3 s") as caught:
            a.wait_for_nodes(3, timeout=0.3)
        assert a.learner_id in str(caught.value) and b.learner_id in str(caught.value)
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ValueError, match="count must be a positive integer"):
                a.wait_for_nodes(bad)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match=r"after close"):
        a.wait_for_nodes(1)
