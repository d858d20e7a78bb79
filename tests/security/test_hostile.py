"""A hostile writer in a signed run changes nothing: same commits, same final parameters."""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")

from examples import KEYRING  # noqa: E402
from hostile import HostileMailbox  # noqa: E402
from virtual_run import committed_rounds, make_model, parameters, run_nodes  # noqa: E402

from gradientmail.adapters.torch import (  # noqa: E402
    TorchAdapter,
    TorchBackend,
)
from gradientmail.clock import MonotonicClock  # noqa: E402
from gradientmail.core import keys  # noqa: E402
from gradientmail.core.robust import snapshot_bound  # noqa: E402
from gradientmail.events import Excluded, Rejected  # noqa: E402
from gradientmail.exchange import Exchange  # noqa: E402
from gradientmail.mailbox import Mailbox  # noqa: E402
from gradientmail.memory import MemoryMailbox  # noqa: E402
from gradientmail.testing.audit import audit  # noqa: E402

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
        assert len(planted) >= 5 + (r >= 2), f"the writer was busy in round {r}"
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

    async def included() -> set[str]:
        exchange = Exchange(store, MonotonicClock())
        found: set[str] = set()
        for r in rounds:
            commit = await exchange.commit(r)
            assert commit is not None
            found |= {i.node for i in commit.included}
        return found

    assert asyncio.run(included()) == HONEST
    # The audit reads the store as the hostile writer left it: everything it planted is
    # reported (rejected, or foreign to the key layout), and nothing counts as a violation.
    report = audit(store, backend=TorchBackend(), keyring=KEYRING)
    assert report.recomputed == report.commits == len(rounds)
    rejected = dict(report.rejected)
    assert writer.planted <= set(rejected) | set(report.foreign)
    assert "bad signature" in rejected[keys.claim(rounds[0], 0)]
    assert "bad signature" in rejected[keys.snapshot(rounds[0], "eve")]
    assert all(key in writer.planted for key in rejected), "no honest object is reported"
