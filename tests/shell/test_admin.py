"""status and gc on a finished run."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("torch")

from virtual_run import committed_rounds, make_model, run_nodes

from gradientmail import DiLoCo, ProtocolError, align
from gradientmail.admin import collect, status
from gradientmail.core import keys
from gradientmail.memory import MemoryMailbox
from gradientmail.testing.audit import audit

ALGORITHM = DiLoCo(inner_steps=10, fragments=2, overlap_steps=1, grace=5.0)


def test_status_reports_fragments_nodes_and_bytes() -> None:
    mailbox, events, _, _ = run_nodes(ALGORITHM)
    rounds = committed_rounds(events)
    report = asyncio.run(status(mailbox))
    assert report["manifest"]["parameters"] == 4
    assert report["manifest"]["algorithm"]["inner_steps"] == 10
    newest = [f["newest_round"] for f in report["fragments"]]
    assert max(newest) == max(rounds) and {r % 2 for r in newest} == {0, 1}
    assert {n["node"] for n in report["nodes"]} == {"node-0", "node-1", "node-2"}
    assert all(n["state"] == "released" for n in report["nodes"])
    assert report["bytes_stored"] > 0 and report["objects"] > len(rounds)


def test_gc_keeps_what_the_run_needs_and_align_still_works() -> None:
    mailbox, events, _, _ = run_nodes(ALGORITHM)
    rounds = committed_rounds(events)
    reference = make_model(seed=4)
    align(reference, mailbox=mailbox)
    before = asyncio.run(mailbox.list(""))
    dry = asyncio.run(collect(mailbox, keep=1, dry_run=True))
    assert asyncio.run(mailbox.list("")) == before, "a dry run deletes nothing"
    done = asyncio.run(collect(mailbox, keep=1))
    assert done["deleted"] == dry["deleted"] and done["bytes_freed"] > 0
    remaining = {info.key for info in asyncio.run(mailbox.list(""))}
    assert all(keys.commit(r) in remaining for r in rounds), "commit records are never deleted"
    assert keys.MANIFEST in remaining
    report = audit(mailbox)
    assert report.rounds == tuple(rounds)
    fresh = make_model(seed=5)
    assert align(fresh, mailbox=mailbox) == max(rounds)
    assert [p.tolist() for p in fresh.parameters()] == [
        p.tolist() for p in reference.parameters()
    ], "gc removed nothing that align needs"


def test_status_of_an_empty_mailbox_is_a_clear_error() -> None:
    with pytest.raises(ProtocolError, match="holds no run"):
        asyncio.run(status(MemoryMailbox()))


def test_the_cli_reports_status_and_collects(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import json

    from gradientmail import Session, mailbox_from_url
    from gradientmail.cli import main

    url = f"file://{tmp_path / 'run'}"
    quick = {"poll_interval": 0.05, "lease_every": 0.2, "lease_timeout": 1.0}
    with Session(make_model(), algorithm=ALGORITHM, mailbox=mailbox_from_url(url), **quick) as s:
        for _ in range(25):
            s.step(samples=4)
    assert main(["status", url, "--json", "--watch", "0"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["manifest"]["algorithm"]["fragments"] == 2
    assert [n["state"] for n in report["nodes"]] == ["released"]
    assert main(["status", url, "--watch", "0"]) == 0
    assert "fragment 1: newest round" in capsys.readouterr().out
    assert main(["gc", url, "--keep", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["deleted"]
    assert main(["status", str(tmp_path / "nothing-here")]) == 1
    assert capsys.readouterr().err.startswith("gradientmail: error: ")
