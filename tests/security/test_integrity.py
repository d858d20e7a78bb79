"""Forged, replayed, bit-flipped and truncated objects in a signed run on virtual time: each is
detected, reported with its key and reason, and excluded; the run goes on and commits."""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")

from examples import KEYRING  # noqa: E402
from tamper import TamperingMailbox, flip, truncate  # noqa: E402
from virtual_run import ALGORITHM, committed_rounds, make_model, run_nodes  # noqa: E402

from gradientmail._clock import MonotonicClock  # noqa: E402
from gradientmail._events import Event, Excluded, Rebased, Rejected  # noqa: E402
from gradientmail._node.exchange import Exchange  # noqa: E402
from gradientmail.adapters.torch import TorchAdapter, TorchBackend  # noqa: E402
from gradientmail.core import keys  # noqa: E402
from gradientmail.core.codecs import compress  # noqa: E402
from gradientmail.core.envelope import payload_digest, seal, unseal  # noqa: E402
from gradientmail.core.errors import FormatError  # noqa: E402
from gradientmail.core.fragments import partition  # noqa: E402
from gradientmail.core.records import Commit, Snapshot, to_bytes  # noqa: E402
from gradientmail.core.signing import Keyring  # noqa: E402
from gradientmail.core.tensors import TensorBytes  # noqa: E402
from gradientmail.mailboxes._memory import MemoryMailbox  # noqa: E402
from gradientmail.mailboxes._protocol import Mailbox  # noqa: E402

WRONG = Keyring.of(b"a forger's guess at the secret..")
PARAMS = r"rounds/{:020d}/params-[0-9a-f]{{16}}"
STATE = r"rounds/{:020d}/state-[0-9a-f]{{16}}"
TAMPERED_STATES = range(2, 8)


def forged_snapshot(node: str, r: int) -> bytes:
    """A snapshot in every way valid but its signature: the right schema, a plausible delta."""
    schema = TorchAdapter(make_model()).schema
    names = partition(schema, ALGORITHM.fragments)[r % ALGORITHM.fragments]
    delta = {
        n: TensorBytes(
            dtype="F32", shape=schema[n].shape, data=b"\x00\x00\x80\x3f" * schema[n].numel
        )
        for n in names
    }
    payload = compress(delta, "off")
    record = Snapshot(
        node=node,
        nonce="f" * 16,
        round=r,
        base_round=-1,
        samples=80,
        steps=5,
        digest=payload_digest(payload),
    )
    return seal(to_bytes(record, WRONG), payload)


def replay_under(r: int, node: str) -> object:
    return lambda data: {keys.snapshot(r, node): data}


class Run:
    def __init__(self) -> None:
        self.tamper: TamperingMailbox | None = None

        def wrap(store: MemoryMailbox) -> Mailbox:
            t = TamperingMailbox(store)
            # node-0's genuine round-0 snapshot, replayed under its own key of round 2.
            t.after_create[keys.snapshot(0, "node-0")] = lambda data: {
                keys.snapshot(2, "node-0"): data
            }
            t.on_create[keys.snapshot(1, "node-1")] = flip(3)
            t.on_create[keys.snapshot(3, "node-2")] = truncate(7)
            t.corrupt_reads(PARAMS.format(1), flip(5), times=3)
            t.corrupt_reads(PARAMS.format(4), truncate(1), times=2)
            # A closer reads the previous commit's outer state from the store only when another
            # node wrote it (its own is in its exchange's cache): which rounds those are follows
            # the closers' order (closing.rank), so every state of rounds 2-7 is corrupted once.
            for r in TAMPERED_STATES:
                t.corrupt_reads(STATE.format(r), flip(9), times=1)
            self.tamper = t
            return t

        async def before(store: MemoryMailbox) -> None:
            await store.create(keys.snapshot(0, "node-2"), forged_snapshot("node-2", 0))

        # Polls off node-2's step times: its fifth step (1.7 s) publishes into round 0, whose
        # key the forgery squats, before a poll finds round 0's commit (closed at 1.35 s); a
        # poll at exactly 1.7 s would race the step and merge the commit first.
        self.store, self.events, self.models, _ = run_nodes(
            wrap=wrap, before=before, keyring=KEYRING, poll_interval=0.55
        )
        self.commits = asyncio.run(self._commits())

    async def _commits(self) -> dict[int, Commit]:
        exchange = Exchange(self.store, MonotonicClock(), keyring=KEYRING)
        found = {}
        for r in committed_rounds(self.events):
            commit = await exchange.commit(r)
            assert commit is not None
            found[r] = commit
        return found

    def excluded(self, r: int, node: str) -> list[str]:
        key = keys.snapshot(r, node)
        return [e.reason for e in self.events if isinstance(e, Excluded) and e.key == key]

    def rejected(self, pattern: str) -> list[Event]:
        import re

        return [e for e in self.events if isinstance(e, Rejected) and re.fullmatch(pattern, e.key)]


@pytest.fixture(scope="module")
def run() -> Run:
    return Run()


def test_the_run_goes_on_and_commits_every_round(run: Run) -> None:
    rounds = committed_rounds(run.events)
    assert len(rounds) >= 8 and rounds[:8] == list(range(8))
    for k in range(ALGORITHM.fragments):
        chain = [r for r in rounds if r % ALGORITHM.fragments == k]
        assert chain == list(range(k, chain[-1] + 1, ALGORITHM.fragments))


def test_a_forged_snapshot_is_never_included_and_squats_nothing(run: Run) -> None:
    """A forgery created at node-2's snapshot key of round 0 before node-2 got there is
    excluded; node-2's genuine snapshot went to its next snapshot key (``core.slots``) and round
    0 includes it, so node-2 missed nothing."""
    assert any("bad signature" in reason for reason in run.excluded(0, "node-2"))
    included = [i for i in run.commits[0].included if i.node == "node-2"]
    assert included and included[0].nonce != "f" * 16
    genuine = asyncio.run(run.store.get(keys.snapshot(0, "node-2", 1)))
    assert genuine is not None and included[0].nonce in unseal(genuine).record.decode()
    assert not any(
        isinstance(e, Rebased) and e.node == "node-2" and e.missed == 0 for e in run.events
    )


def test_a_replayed_snapshot_under_a_new_round_key_is_rejected(run: Run) -> None:
    assert any("names node-0 round 0" in reason for reason in run.excluded(2, "node-0"))
    replayed = run.commits[0].included[0]
    assert replayed.node == "node-0"
    assert not run.commits[2].includes("node-0", replayed.nonce)


def test_bit_flipped_and_truncated_snapshots_are_excluded(run: Run) -> None:
    assert any("digest" in reason for reason in run.excluded(1, "node-1"))
    assert not run.commits[1].includes("node-1")
    assert any("truncated" in reason for reason in run.excluded(3, "node-2"))
    assert not run.commits[3].includes("node-2")


def test_corrupt_params_are_reported_and_read_again_later(run: Run) -> None:
    flipped = run.rejected(PARAMS.format(1))
    assert flipped and all("digest" in e.reason for e in flipped)  # type: ignore[attr-defined]
    short = run.rejected(PARAMS.format(4))
    assert short and all("its record says" in e.reason for e in short)  # type: ignore[attr-defined]
    assert run.tamper is not None and len(run.tamper.tampered) >= 3 + 3 + 2 + 1
    merged = {(e.node, e.round) for e in run.events if type(e).__name__ == "Merged"}  # type: ignore[attr-defined]
    assert {("node-0", 1), ("node-1", 1), ("node-2", 1)} <= merged


def test_a_corrupt_outer_state_delays_the_round_but_never_breaks_it(run: Run) -> None:
    hit = [r for r in TAMPERED_STATES if run.rejected(STATE.format(r))]
    assert hit, "a closer that read another's outer state reported the corrupt one"
    K = ALGORITHM.fragments
    for r in hit:  # read again, and the round it is the base of still committed on it
        assert r + K in run.commits and run.commits[r + K].base_round == r


def test_every_commit_verifies_and_params_derive_from_the_listed_snapshots(run: Run) -> None:
    from gradientmail.testing._audit import audit

    # run.commits were read with the run's keyring: every commit record verified.
    assert sorted(run.commits) == committed_rounds(run.events)
    report = audit(run.store, backend=TorchBackend(), keyring=KEYRING)
    assert report.recomputed == len(run.commits)
    assert keys.snapshot(0, "node-2") in dict(report.rejected), "the forged snapshot is reported"


def test_a_commit_record_replayed_under_a_new_round_is_rejected(run: Run) -> None:
    async def replay() -> None:
        events: list[Event] = []
        exchange = Exchange(run.store, MonotonicClock(), keyring=KEYRING, on_event=events.append)
        genuine = await run.store.get(keys.commit(0))
        assert genuine is not None
        await run.store.create(keys.commit(99), genuine)
        with pytest.raises(FormatError, match="commit record names round 0"):
            await exchange.commit_at(99, 0)
        # Readers pass it (core.slots): round 99 has no commit, and the replay is reported.
        assert await exchange.commit(99) is None
        assert [(e.key, "names round 0" in e.reason) for e in events] == [(keys.commit(99), True)]

    asyncio.run(replay())


def test_only_valid_claims_are_listed_and_the_rest_is_reported_without_a_crash() -> None:
    from gradientmail.core.records import Claim
    from gradientmail.core.robust import RECORD_BOUND

    events: list[Event] = []
    store = MemoryMailbox()
    exchange = Exchange(store, MonotonicClock(), keyring=KEYRING, on_event=events.append)
    genuine = seal(to_bytes(Claim(node="a", nonce="a" * 16, round=7, attempt=0), KEYRING))
    forged = seal(to_bytes(Claim(node="e", nonce="e" * 16, round=7, attempt=2), WRONG))
    planted = {
        keys.claim(7, 0): genuine,
        keys.claim(7, 1): genuine,  # a genuine claim replayed under another attempt
        keys.claim(7, 2): forged,
        keys.claim(7, 3): b"\x00" * (RECORD_BOUND + 1),
        f"{keys.claims(7)}bogus": genuine,  # a genuine claim under a foreign key
    }

    async def list_claims() -> list[Claim]:
        for key, data in planted.items():
            await store.create(key, data)
        return await exchange.claims(7)

    [claim] = asyncio.run(list_claims())
    assert (claim.node, claim.attempt) == ("a", 0)
    reasons = {e.key: e.reason for e in events if isinstance(e, Rejected)}
    assert "names round 7 attempt 0" in reasons[keys.claim(7, 1)]
    assert "bad signature" in reasons[keys.claim(7, 2)]
    assert "not downloaded" in reasons[keys.claim(7, 3)]
    assert reasons[f"{keys.claims(7)}bogus"] == "not a claim key"
