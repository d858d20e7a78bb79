"""status and gc on a finished run."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from virtual_run import committed_rounds, make_model, run_nodes

from gradientmail import DiLoCo, ProtocolError, align
from gradientmail._secrets import SECRET_ENV, SECRET_FILE_ENV
from gradientmail.adapters.torch import TorchBackend
from gradientmail.core import keys
from gradientmail.core.envelope import seal
from gradientmail.core.records import Claim, Commit, Included, Lease, PayloadRef, to_bytes
from gradientmail.core.signing import Keyring
from gradientmail.mailboxes._memory import MemoryMailbox
from gradientmail.mailboxes._protocol import Mailbox
from gradientmail.ops._admin import collect, status
from gradientmail.testing._audit import audit

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
    from gradientmail.ops._cli import main

    url = f"file://{tmp_path / 'run'}"
    quick = {"poll_interval": 0.05, "lease_every": 0.2, "lease_timeout": 1.0}
    with Session(make_model(), algorithm=ALGORITHM, mailbox=mailbox_from_url(url), **quick) as s:
        for _ in range(25):
            s.step(samples=4)
    assert main(["status", url, "--json", "--watch", "0"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["manifest"]["algorithm"]["fragments"] == 2
    assert [n["state"] for n in report["nodes"]] == ["released"]
    assert 0 <= report["nodes"][0]["age_s"] < 60, "the lease was written seconds ago"
    assert main(["status", url, "--watch", "0"]) == 0
    text = capsys.readouterr().out
    assert "fragment 1: newest round" in text
    assert re.search(r"node \S+: released \(lease counter \d+, written \d+\.\d s ago\)", text)
    # The run just ended: with an hour's horizon nothing is old enough yet, and without one
    # the same rule deletes.
    assert main(["gc", url, "--keep", "1", "--horizon", "3600", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["deleted"] == []
    assert main(["gc", url, "--keep", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["deleted"]
    with pytest.raises(SystemExit):
        main(["gc", url, "--horizon", "-1"])
    assert "seconds must be finite and >= 0, got '-1'" in capsys.readouterr().err
    assert main(["status", str(tmp_path / "nothing-here")]) == 1
    assert capsys.readouterr().err.startswith("gradientmail: error: ")
    assert main(["gc", str(tmp_path / "nothing-here")]) == 1
    assert not (tmp_path / "nothing-here").exists(), "status and gc create nothing"


SECRET = b"the admin tests' run secret: 32b"
WRONG = Keyring.of(b"a forger's guess at the secret..")
NONCE = "e" * 16


def forged_commit(r: int) -> bytes:
    """A well-formed commit of round ``r`` continuing its fragment's chain, wrongly signed."""
    base = r - ALGORITHM.fragments
    digest = "ab" * 32
    commit = Commit(
        round=r,
        fragment=r % ALGORITHM.fragments,
        base_round=base,
        closer="eve",
        attempt=0,
        nonce=NONCE,
        included=(
            Included(
                node="eve", nonce=NONCE, samples=10**9, steps=1, base_round=base, digest=digest
            ),
        ),
        params=PayloadRef(key=keys.params(r, NONCE), digest=digest, size=100),
        state=PayloadRef(key=keys.state(r, NONCE), digest=digest, size=200),
    )
    return seal(to_bytes(commit, WRONG))


async def plant_forgeries(mailbox: Mailbox, newest: int) -> dict[str, str]:
    """Forged objects a bucket writer without the secret can create after a fragment's newest
    round: two commits continuing its chain, a claim and a snapshot name in the open round, a
    lease. Returns each key and what a reader must say about it."""
    K = ALGORITHM.fragments
    planted = {
        keys.commit(newest + K): forged_commit(newest + K),
        keys.commit(newest + 2 * K): forged_commit(newest + 2 * K),
        keys.claim(newest + K, 0): seal(
            to_bytes(Claim(node="eve", nonce=NONCE, round=newest + K, attempt=0), WRONG)
        ),
        keys.snapshot(newest + K, "eve"): b"\x00 garbage",
    }
    for key, data in planted.items():
        assert await mailbox.create(key, data)
    lease = Lease(node="eve", nonce=NONCE, counter=1)
    await mailbox.put(keys.lease("eve"), seal(to_bytes(lease, WRONG)))
    return {
        keys.commit(newest + K): "bad signature",
        keys.commit(newest + 2 * K): "bad signature",
        keys.claim(newest + K, 0): "bad signature",
        keys.lease("eve"): "bad signature",
    }


def copy_of(store: MemoryMailbox) -> MemoryMailbox:
    async def copy() -> MemoryMailbox:
        out = MemoryMailbox()
        for info in await store.list(""):
            data = await store.get(info.key)
            assert data is not None
            await out.put(info.key, data)
        return out

    return asyncio.run(copy())


def test_status_and_gc_of_a_signed_run_need_its_keyring_and_are_not_fooled_by_forgeries() -> None:
    keyring = Keyring.of(SECRET)
    clean, events, _, _ = run_nodes(ALGORITHM, keyring=keyring)
    rounds = committed_rounds(events)
    newest = [max(r for r in rounds if r % 2 == k) for k in range(2)]
    store = copy_of(clean)
    expected = asyncio.run(plant_forgeries(store, newest[0]))
    for call in (status(store), collect(store, keep=1)):
        with pytest.raises(
            ProtocolError, match=r"run is signed and \w+ has no secret: pass keyring="
        ):
            asyncio.run(call)
    with pytest.raises(ProtocolError, match="run is not signed but status has a secret"):
        asyncio.run(status(run_nodes(ALGORITHM, steps=10).store, keyring=keyring))

    report = asyncio.run(status(store, keyring=keyring))
    assert [f["newest_round"] for f in report["fragments"]] == newest, "forged commits skipped"
    rejected = {r["key"]: r["reason"] for r in report["rejected"]}
    assert set(rejected) == set(expected)
    assert all(why in rejected[key] for key, why in expected.items()), rejected
    opened = report["fragments"][0]
    assert opened["open_round"] == newest[0] + 2 and opened["claims"] == []
    assert opened["reporters"] == [] and opened["unverified_reporters"] == ["eve"]
    assert "eve" not in {n["node"] for n in report["nodes"]}

    # gc counts its horizon from the newest commit that verifies: it deletes exactly what it
    # deletes without the forgeries, and never a commit record.
    done = asyncio.run(collect(store, keep=1, keyring=keyring))
    assert done["newest_rounds"] == newest
    assert done["deleted"] == asyncio.run(collect(clean, keep=1, keyring=keyring))["deleted"]
    assert done["deleted"] and not [k for k in done["deleted"] if k.endswith("/commit")]
    assert {r["key"] for r in done["rejected"]} >= {keys.commit(newest[0] + 2)}
    remaining = {info.key for info in asyncio.run(store.list(""))}
    assert {keys.commit(r) for r in rounds} <= remaining
    assert audit(store, backend=TorchBackend(), keyring=keyring).rounds == tuple(rounds)


def test_the_cli_reads_a_signed_run_with_its_secret(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    from gradientmail import Session, mailbox_from_url
    from gradientmail.ops._cli import main

    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    url = f"file://{tmp_path / 'run'}"
    quick = {"poll_interval": 0.05, "lease_every": 0.2, "lease_timeout": 1.0, "callbacks": ()}
    mailbox = mailbox_from_url(url)
    with Session(make_model(), algorithm=ALGORITHM, mailbox=mailbox, secret=SECRET, **quick) as s:  # type: ignore[arg-type]
        for _ in range(25):
            s.step(samples=4)
    before = asyncio.run(status(mailbox, keyring=Keyring.of(SECRET)))
    newest = before["fragments"][0]["newest_round"]
    asyncio.run(plant_forgeries(mailbox, newest))
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET.decode() + "\n")

    for command, count in ((["status", url, "--watch", "0"], 4), (["gc", url, "--dry-run"], 2)):
        assert main(command) == 1
        err = capsys.readouterr().err.splitlines()
        assert err == [
            f"gradientmail: error: the run is signed and gradientmail {command[0]} has no "
            f"secret: set {SECRET_ENV} (or {SECRET_FILE_ENV}), or pass --secret-file PATH"
        ]
        assert main([*command, "--secret-file", str(secret_file)]) == 0
        out = capsys.readouterr().out
        assert f"{count} objects rejected (no node uses them):" in out
        assert f"  {keys.commit(newest + 2)}: bad signature: not signed with this run's" in out

    monkeypatch.setenv(SECRET_ENV, SECRET.decode())
    assert main(["status", url, "--json", "--watch", "0"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["manifest"]["signed"] is True
    assert keys.lease("eve") in {r["key"] for r in report["rejected"]}
    assert main(["gc", url, "--keep", "1", "--json"]) == 0
    done = json.loads(capsys.readouterr().out)
    assert not [k for k in done["deleted"] if k.endswith("/commit")]

    monkeypatch.setenv(SECRET_ENV, WRONG.secrets[0].decode())
    assert main(["status", url]) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert "manifest does not verify with gradientmail status's secret" in line
    monkeypatch.delenv(SECRET_ENV)
    unsigned = f"file://{tmp_path / 'unsigned'}"
    with Session(make_model(), algorithm=ALGORITHM, mailbox=mailbox_from_url(unsigned), **quick):  # type: ignore[arg-type]
        pass
    assert main(["gc", unsigned, "--secret-file", str(secret_file)]) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert "the run is not signed but gradientmail gc has a secret (from --secret-file" in line


def test_status_follow_rereads_the_run_and_counts_its_rounds(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import json
    import threading

    from gradientmail import Session, mailbox_from_url
    from gradientmail.ops._cli import main

    url = f"file://{tmp_path / 'run'}"
    quick = {"poll_interval": 0.05, "lease_every": 0.2, "lease_timeout": 1.0}
    done = threading.Event()

    def train() -> None:
        with Session(
            make_model(), algorithm=ALGORITHM, mailbox=mailbox_from_url(url), **quick
        ) as s:
            while not done.is_set():
                s.step(samples=4)
                time.sleep(0.01)

    trainer = threading.Thread(target=train)
    trainer.start()
    try:
        while not (tmp_path / "run" / "manifest").exists():
            time.sleep(0.05)
        assert main(["status", url, "--follow", "--json", "--watch", "1", "--count", "3"]) == 0
        reads = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert main(["status", url, "--follow", "--watch", "1", "--count", "2"]) == 0
        text = capsys.readouterr().out
    finally:
        done.set()
        trainer.join()
    assert len(reads) == 3
    newest = [[f["newest_round"] for f in r["fragments"]] for r in reads]
    assert newest[-1] > newest[0], "the node committed rounds between the reads"
    assert reads[0]["fragments"][0]["rounds_per_minute"] is None
    assert all(f["rounds_per_minute"] > 0 for f in reads[-1]["fragments"])
    assert [n["state"] for n in reads[-1]["nodes"]] == ["live"]
    # Piped, each read prints a block of its own, headed by its time and number.
    assert re.findall(r"\(read (\d), every 1 s\)", text) == ["1", "2"]
    assert re.search(r"fragment 0: newest round \d+ \(\d+(\.\d+)? rounds/min\)", text)
