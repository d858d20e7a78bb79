"""One valid record of every kind, and the run's secrets, for the signing and fuzz tests."""

from __future__ import annotations

from gradientmail import DiLoCo
from gradientmail.core import keys
from gradientmail.core.fragments import partition
from gradientmail.core.records import (
    Claim,
    Commit,
    Included,
    Lease,
    Manifest,
    PayloadRef,
    Record,
    Snapshot,
)
from gradientmail.core.signing import Keyring
from gradientmail.core.tensors import ParameterSpec, Schema

NONCE = "0123456789abcdef"
DIGEST = "ab" * 32
OLD = b"the secret the run started with."
NEW = b"the secret the run moves to: 32b"
THIRD = b"a secret that this run never had"
SECRET = b"the run secret: 32 bytes long..."
KEYRING = Keyring.of(SECRET)


def schema() -> Schema:
    specs = [ParameterSpec(name=f"layers.{i}.w", dtype="F32", shape=(2, 3)) for i in range(4)]
    return Schema.of([*specs, ParameterSpec(name="embed", dtype="BF16", shape=(8,))])


def manifest(*, signed: bool = True) -> Manifest:
    s = schema()
    return Manifest(
        nonce=NONCE,
        creator="node-a",
        schema=s,
        algorithm=DiLoCo(inner_steps=10, fragments=2),
        fragments=partition(s, 2),
        init=tuple(PayloadRef(key=keys.init(i, NONCE), digest=DIGEST, size=24) for i in range(2)),
        signed=signed,
    )


def commit(r: int = 5) -> Commit:
    return Commit(
        round=r,
        fragment=r % 2,
        base_round=r - 2,
        closer="a",
        attempt=0,
        nonce=NONCE,
        included=tuple(
            Included(node=n, nonce=NONCE, samples=32, steps=10, base_round=r - 2, digest=DIGEST)
            for n in ("a", "b")
        ),
        params=PayloadRef(key=keys.params(r, NONCE), digest=DIGEST, size=100),
        state=PayloadRef(key=keys.state(r, NONCE), digest=DIGEST, size=200),
    )


RECORDS: list[Record] = [
    manifest(),
    Lease(node="a", nonce=NONCE, counter=3),
    Snapshot(node="a", nonce=NONCE, round=5, base_round=3, samples=64, steps=10, digest=DIGEST),
    Claim(node="a", nonce=NONCE, round=5, attempt=1),
    commit(),
]
