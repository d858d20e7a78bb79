"""The pure rules against hostile payloads (outlier norms, size bounds, quorum membership), the
backends' norm, a validly signed but outsized delta excluded from a real run, and the norm clip
(``DiLoCo.clip``) in a real run, recomputed by ``audit``."""

from __future__ import annotations

import asyncio
import math

import attrs
import pytest
from examples import DIGEST, KEYRING, NONCE, schema

torch = pytest.importorskip("torch")

from tamper import TamperingMailbox  # noqa: E402
from virtual_run import ALGORITHM, committed_rounds, run_nodes  # noqa: E402

from gradientmail._clock import MonotonicClock  # noqa: E402
from gradientmail._events import Clipped, Excluded  # noqa: E402
from gradientmail._node.exchange import Exchange  # noqa: E402
from gradientmail.adapters.torch import TorchBackend  # noqa: E402
from gradientmail.core import keys  # noqa: E402
from gradientmail.core.codecs import compress, decompress  # noqa: E402
from gradientmail.core.envelope import payload_digest, seal, unseal  # noqa: E402
from gradientmail.core.records import (  # noqa: E402
    Commit,
    Included,
    Snapshot,
    read_record,
    to_bytes,
)
from gradientmail.core.robust import (  # noqa: E402
    RECORD_BOUND,
    members,
    outliers,
    oversized,
    snapshot_bound,
)
from gradientmail.mailboxes._memory import MemoryMailbox  # noqa: E402
from gradientmail.mailboxes._protocol import Mailbox  # noqa: E402
from gradientmail.testing._audit import audit  # noqa: E402


def included(node: str, steps: int = 10) -> Included:
    return Included(node=node, nonce=NONCE, samples=8, steps=steps, base_round=1, digest=DIGEST)


def test_a_norm_far_beyond_the_median_is_excluded_with_the_numbers() -> None:
    chosen = [included(n) for n in "abcd"]
    norms = {"a": 1.0, "b": 1.2, "c": 0.9, "d": 50.0}
    [(node, reason)] = outliers(chosen, norms, inner_steps=10, factor=10.0)
    assert node == "d" and "exceeds 10 x the round's median 1.1" in reason
    assert outliers(chosen, {**norms, "d": 10.9}, inner_steps=10, factor=10.0) == []
    assert outliers(chosen, norms, inner_steps=10, factor=None) == []


def test_norms_are_normalized_to_h_steps_before_they_are_compared() -> None:
    # d trained 40 steps (a rebased node): 4x the steps, 4x the norm, and it is no outlier.
    chosen = [included("a"), included("b"), included("c"), included("d", steps=40)]
    norms = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 4.0}
    assert outliers(chosen, norms, inner_steps=10, factor=2.0) == []
    # e trained 1 step with a norm of 1.0: as if 10 at H steps.
    chosen[3] = included("e", steps=1)
    assert [n for n, _ in outliers(chosen, {**norms, "e": 1.0}, inner_steps=10, factor=2.0)] == [
        "e"
    ]


def test_with_fewer_than_three_deltas_none_is_an_outlier_but_non_finite_always_is() -> None:
    two = [included("a"), included("b")]
    assert outliers(two, {"a": 1.0, "b": 1e9}, inner_steps=10, factor=10.0) == []
    found = outliers(two, {"a": math.nan, "b": math.inf}, inner_steps=10, factor=None)
    assert [n for n, _ in found] == ["a", "b"]
    zero = [included(n) for n in "abc"]
    assert outliers(zero, {"a": 0.0, "b": 0.0, "c": 1.0}, inner_steps=10, factor=10.0) == []
    with pytest.raises(ValueError, match="above 1"):
        outliers(zero, {}, inner_steps=10, factor=0.5)


def test_only_reporters_with_a_lease_count_in_a_signed_round() -> None:
    assert members(["a", "eve", "b"], {"a": 1, "b": 2}) == ("a", "b")
    assert oversized(RECORD_BOUND, RECORD_BOUND) is None
    assert "not downloaded" in (oversized(RECORD_BOUND + 1, RECORD_BOUND) or "")


@pytest.mark.parametrize("compression", ["off", "zstd"])
def test_the_snapshot_bound_holds_every_genuine_snapshot(compression: str) -> None:
    """The largest genuine snapshot (F32, incompressible random bits, signed) fits the bound,
    and the bound is not loose: under twice the raw F32 size plus the fixed room."""
    s = schema()
    backend = TorchBackend()
    generator = torch.Generator().manual_seed(0)
    delta = {p.name: torch.randn(p.shape, generator=generator) * 1e-3 for p in s.parameters}
    for quantization in (None, "F8_E4M3", "F4"):
        if quantization == "F4" and any(p.shape[-1] % 2 for p in s.parameters):
            continue
        payload, _ = backend.encode(delta, quantization)  # type: ignore[arg-type]
        data = compress(payload, compression)  # type: ignore[arg-type]
        record = Snapshot(
            node="n" * 64,
            nonce=NONCE,
            round=10**19,
            base_round=10**19 - 1,
            samples=2**62,
            steps=2**62,
            digest=payload_digest(data),
        )
        blob = seal(to_bytes(record, KEYRING), data, compression=compression)  # type: ignore[arg-type]
        assert len(blob) <= snapshot_bound(s)
    assert snapshot_bound(s) < 2 * 4 * sum(p.numel for p in s.parameters) + 64 * 1024


@pytest.mark.parametrize("backend_name", ["torch", "mlx"])
def test_backend_norm_is_the_l2_norm_without_overflow(backend_name: str) -> None:
    if backend_name == "mlx":
        mx = pytest.importorskip("mlx.core")
        from gradientmail.adapters.mlx import MLXBackend

        backend: object = MLXBackend()
        make = mx.array
    else:
        backend = TorchBackend()
        make = torch.tensor
    norm = backend.norm  # type: ignore[attr-defined]
    assert norm({"a": make([3.0, 4.0]), "b": make([[12.0]])}) == pytest.approx(13.0)
    assert norm({"a": make([3e30, 4e30])}) == pytest.approx(5e30, rel=1e-6)
    assert norm({"a": make([1.0, math.inf])}) == math.inf
    assert math.isnan(norm({"a": make([math.nan, 1.0])}))
    assert norm({}) == 0.0 and norm({"a": make([0.0, 0.0])}) == 0.0


def scaled_by(factor: float):  # type: ignore[no-untyped-def]
    """A transform that re-signs a snapshot with its delta scaled: what a node holding the
    secret but publishing garbage (diverged, or compromised) would write."""
    backend = TorchBackend()

    def apply(blob: bytes) -> bytes:
        sealed = unseal(blob)
        record = read_record(sealed.record, Snapshot, verifier=KEYRING)
        tensors = decompress(sealed.payload, sealed.compression, limit=1 << 30)
        bigger = {n: t * factor for n, t in backend.load(tensors).items()}
        payload = compress(backend.dump(bigger), sealed.compression)
        forged = Snapshot(**{**record.to_json(), "digest": payload_digest(payload)})
        return seal(to_bytes(forged, KEYRING), payload, compression=sealed.compression)

    return apply


def test_a_validly_signed_delta_a_thousand_times_too_large_is_excluded() -> None:
    def wrap(store: MemoryMailbox) -> Mailbox:
        tamper = TamperingMailbox(store)
        tamper.on_create[keys.snapshot(4, "node-1")] = scaled_by(1000.0)
        return tamper

    store, events, _, _ = run_nodes(wrap=wrap, keyring=KEYRING)
    key = keys.snapshot(4, "node-1")
    reasons = [e.reason for e in events if isinstance(e, Excluded) and e.key == key]
    assert reasons and "x the round's median" in reasons[0]
    assert 4 in committed_rounds(events)

    async def commit_4() -> list[str]:
        commit = await Exchange(store, MonotonicClock(), keyring=KEYRING).commit(4)
        assert commit is not None
        return [i.node for i in commit.included]

    assert asyncio.run(commit_4()) == ["node-0", "node-2"]


def test_a_clip_scales_a_fast_nodes_delta_and_audit_recomputes_every_commit() -> None:
    """node-1 trains with 4x the others' learning rate: its deltas are about 2 to 4x theirs,
    under the outlier factor of 10, so it is included either way. With ``clip=2.0`` its
    deltas beyond 2x the median are scaled down (a ``Clipped`` event each), the commits
    differ from the unclipped run's from the same snapshots, and ``audit`` recomputes every
    commit of both runs bit for bit."""
    lrs = [0.05, 0.2, 0.05]
    plain = run_nodes(ALGORITHM, lrs=lrs)
    clipped = run_nodes(attrs.evolve(ALGORITHM, clip=2.0), lrs=lrs)
    assert not [e for e in plain.events if isinstance(e, Clipped)]
    clips = [e for e in clipped.events if isinstance(e, Clipped)]
    assert clips and {e.key.rsplit("/", 1)[1] for e in clips} == {"node-1"}
    assert all(0.0 < e.factor < 1.0 for e in clips)
    for run in (plain, clipped):
        rounds = committed_rounds(run.events)
        report = audit(run.store, backend=TorchBackend())
        assert report.rounds == tuple(rounds) and report.recomputed == len(rounds)
    # Round 0 of both runs averages the very same snapshots (same initial parameters and
    # data, nothing merged yet); only the clip makes the committed params differ.
    first = clips[0].round
    assert first == 0
    before, after = commit_of(plain.store, first), commit_of(clipped.store, first)
    assert [i.digest for i in before.included] == [i.digest for i in after.included]
    assert len(after.included) == 3
    assert before.params.digest != after.params.digest


def commit_of(store: MemoryMailbox, r: int) -> Commit:
    commit = asyncio.run(Exchange(store, MonotonicClock()).commit(r))
    assert commit is not None
    return commit
