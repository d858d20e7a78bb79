"""Joining a signed run: a missing or wrong secret fails at once, naming what to set; a key
rotation with two accepted secrets keeps the run going and ends on the new secret alone."""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")

from examples import KEYRING, NEW, OLD, THIRD  # noqa: E402
from virtual_run import ALGORITHM, committed_rounds, make_model, run_nodes  # noqa: E402

from gradientmail import ProtocolError, Session, align  # noqa: E402
from gradientmail._clock import MonotonicClock  # noqa: E402
from gradientmail._node import Node  # noqa: E402
from gradientmail._node.exchange import Exchange  # noqa: E402
from gradientmail._node.joining import resign_manifest  # noqa: E402
from gradientmail._secrets import SECRET_ENV, SECRET_FILE_ENV  # noqa: E402
from gradientmail.adapters.torch import TorchAdapter  # noqa: E402
from gradientmail.core import keys  # noqa: E402
from gradientmail.core.errors import FormatError  # noqa: E402
from gradientmail.core.signing import Keyring  # noqa: E402
from gradientmail.mailboxes._memory import MemoryMailbox  # noqa: E402

QUICK = {"poll_interval": 0.05, "lease_every": 0.2, "lease_timeout": 1.0, "callbacks": ()}


@pytest.fixture(autouse=True)
def no_secret_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)


def created(keyring: Keyring | None, mailbox: MemoryMailbox | None = None) -> MemoryMailbox:
    """``mailbox`` (a new one by default) holding a run created by a node with ``keyring``."""
    mailbox = mailbox or MemoryMailbox()
    creator = Node(
        TorchAdapter(make_model()),
        algorithm=ALGORITHM,
        mailbox=mailbox,
        clock=MonotonicClock(),
        learner_id="creator",
        keyring=keyring,
    )
    asyncio.run(creator.join())  # creates the run; it starts no loop, so it writes no lease
    return mailbox


def test_a_node_without_the_secret_cannot_join_a_signed_run() -> None:
    mailbox = created(Keyring.of(OLD))
    with pytest.raises(ProtocolError, match=f"run is signed .*set {SECRET_ENV}"):
        Session(make_model(), algorithm=ALGORITHM, mailbox=mailbox, **QUICK)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="secret="):
        align(make_model(), mailbox=mailbox)
    assert [i.key for i in asyncio.run(mailbox.list("leases/"))] == [], "it wrote nothing"


def test_a_node_with_the_wrong_secret_cannot_join_a_signed_run() -> None:
    mailbox = created(Keyring.of(OLD))
    with pytest.raises(ProtocolError, match="does not verify with this node's secret"):
        Session(make_model(), algorithm=ALGORITHM, mailbox=mailbox, secret=THIRD, **QUICK)  # type: ignore[arg-type]


def test_garbage_at_the_manifest_keys_is_passed_and_the_run_created_behind_it() -> None:
    """A writer without the secret created garbage at ``manifest`` and an object too large for
    a record at ``manifest-0001`` before the run existed: the creator passes both (read twice
    each, ``core.slots``) and creates the run at ``manifest-0002``, where every node and reader
    finds it; a node with a wrong secret still fails with the clear line, creating nothing."""
    from gradientmail._node.exchange import RECORD_OBJECT_BOUND

    mailbox = MemoryMailbox()
    asyncio.run(mailbox.create(keys.manifest(0), b"\x00garbage" * 8))
    asyncio.run(mailbox.create(keys.manifest(1), b"\x03" * (RECORD_OBJECT_BOUND + 1)))
    created(Keyring.of(OLD), mailbox)
    assert asyncio.run(mailbox.get(keys.manifest(2))) is not None
    with Session(make_model(), algorithm=ALGORITHM, mailbox=mailbox, secret=OLD, **QUICK) as s:  # type: ignore[arg-type]
        assert s.rounds_seen == -1
    assert align(make_model(), mailbox=mailbox, secret=OLD) == -1
    with pytest.raises(ProtocolError, match="does not verify with this node's secret"):
        Session(make_model(), algorithm=ALGORITHM, mailbox=mailbox, secret=THIRD, **QUICK)  # type: ignore[arg-type]
    assert asyncio.run(mailbox.get(keys.manifest(3))) is None, "no second run"


def test_a_forged_manifest_before_the_run_stops_its_creation_with_one_clear_line() -> None:
    """A well-formed manifest signed under another secret, created at ``manifest`` before the
    run: no node can tell it from a run signed under a secret it does not hold (its own secret
    wrong), so a node with a secret refuses to create a run past it, with one line that says
    both and how to recover (docs/security.md, "Known limits"). It wrote nothing; once an
    operator deletes the forgery, the run is created at ``manifest``."""
    genuine = created(Keyring.of(THIRD))  # a manifest in every way valid but its secret
    forged = asyncio.run(genuine.get(keys.manifest(0)))
    assert forged is not None
    mailbox = MemoryMailbox()
    asyncio.run(mailbox.create(keys.manifest(0), forged))
    with pytest.raises(
        ProtocolError, match=r"does not verify .*a wrong secret, or a forged manifest: delete"
    ):
        Session(make_model(), algorithm=ALGORITHM, mailbox=mailbox, secret=OLD, **QUICK)  # type: ignore[arg-type]
    assert [i.key for i in asyncio.run(mailbox.list(""))] == [keys.manifest(0)], "wrote nothing"
    asyncio.run(mailbox.delete(keys.manifest(0)))
    with Session(make_model(), algorithm=ALGORITHM, mailbox=mailbox, secret=OLD, **QUICK) as s:  # type: ignore[arg-type]
        assert s.rounds_seen == -1
    assert asyncio.run(mailbox.get(keys.manifest(1))) is None


def test_a_node_with_a_secret_cannot_join_an_unsigned_run() -> None:
    mailbox = created(None)
    with pytest.raises(ProtocolError, match="run is not signed but this node has a secret"):
        Session(make_model(), algorithm=ALGORITHM, mailbox=mailbox, secret=OLD, **QUICK)  # type: ignore[arg-type]


def test_the_secret_from_the_environment_joins_and_align_verifies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mailbox = created(Keyring.of(OLD))
    monkeypatch.setenv(SECRET_ENV, OLD.decode())
    with Session(make_model(), algorithm=ALGORITHM, mailbox=mailbox, **QUICK) as session:  # type: ignore[arg-type]
        assert session.rounds_seen == -1
    assert align(make_model(), mailbox=mailbox) == -1
    monkeypatch.delenv(SECRET_ENV)
    assert align(make_model(), mailbox=mailbox, secret=OLD) == -1


def test_a_key_rotation_with_two_secrets_keeps_the_run_going() -> None:
    rotating = [Keyring.of(OLD, NEW), Keyring.of(NEW, OLD), Keyring.of(OLD, NEW)]
    # Step 1 (everyone accepts both) and 2 (some already sign with NEW), in one run.
    store, events, _, _ = run_nodes(keyrings=rotating)
    first = committed_rounds(events)
    assert len(first) >= 8
    signers = asyncio.run(_signers(store, first))
    assert signers == {"old", "new"}, "commits under both secrets, all accepted"
    # Step 3: everyone signs with NEW; every fragment commits under it.
    store, events, _, _ = run_nodes(keyrings=[Keyring.of(NEW, OLD)] * 3, store=store)
    second = committed_rounds(events)
    assert second and min(second) > max(first)
    # Step 4: re-sign the manifest, then drop OLD: NEW alone reads the run.
    asyncio.run(resign_manifest(Exchange(store, MonotonicClock(), keyring=Keyring.of(NEW, OLD))))
    model = make_model()
    assert align(model, mailbox=store, secret=NEW) == max(second)
    with pytest.raises(ProtocolError, match="does not verify"):
        align(make_model(), mailbox=store, secret=OLD)


async def _signers(store: MemoryMailbox, rounds: list[int]) -> set[str]:
    found = set()
    for name, secret in (("old", OLD), ("new", NEW)):
        exchange = Exchange(store, MonotonicClock(), keyring=Keyring.of(secret))
        for r in rounds:
            try:
                await exchange.commit(r)
            except FormatError:
                continue
            found.add(name)
    assert await store.get(keys.manifest(0)) is not None
    return found


def test_a_forged_lease_under_a_nodes_id_does_not_keep_it_out() -> None:
    from gradientmail._events import Joined, Rejected
    from gradientmail.core.envelope import seal
    from gradientmail.core.records import Lease, to_bytes

    forged = Lease(node="node-1", nonce="e" * 16, counter=7)

    async def before(store: MemoryMailbox) -> None:
        await store.put(keys.lease("node-1"), seal(to_bytes(forged, Keyring.of(THIRD))))

    _, events, _, _ = run_nodes(before=before, keyring=KEYRING)
    assert {e.node for e in events if isinstance(e, Joined)} == {"node-0", "node-1", "node-2"}
    assert any(
        isinstance(e, Rejected) and e.key == keys.lease("node-1") and "bad signature" in e.reason
        for e in events
    )
    assert len(committed_rounds(events)) >= 8
