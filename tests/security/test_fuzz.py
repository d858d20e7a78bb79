"""A fuzz campaign against every parser that reads from the mailbox.

Targets: ``read_record`` for every kind (signed and unsigned readers), ``unseal``,
``decompress`` (both codecs), ``unpack`` (safetensors headers), ``keys.parse`` (listed keys),
and the ``Exchange`` reads a node makes (manifest, lease, claims, snapshot + backend decode,
commit, fragment parameters, head hint) on whatever bytes lie under the key. Inputs: random
bytes, valid objects with random mutations (bit flips, byte sets, cuts, insertions), and valid
records with fields replaced by random JSON. Only the documented errors may come out.

The test every run makes (CI included) draws 10,000 inputs; the ``slow`` one draws 1,000,000
(``pytest --runslow -k thorough``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from examples import OLD, RECORDS, schema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradientmail._clock import MonotonicClock
from gradientmail._node.exchange import Exchange
from gradientmail._node.payloads import read_fragment
from gradientmail.core import keys
from gradientmail.core.codecs import compress, decompress, max_packed_size
from gradientmail.core.envelope import payload_digest, seal, unseal
from gradientmail.core.errors import FormatError, NonFinite, RejectedObject, SchemaMismatch
from gradientmail.core.records import (
    Claim,
    Commit,
    Lease,
    Manifest,
    PayloadRef,
    Snapshot,
    canonical,
    read_record,
    to_bytes,
)
from gradientmail.core.signing import Keyring
from gradientmail.core.tensors import TensorBytes, unpack
from gradientmail.mailboxes._memory import MemoryMailbox

torch = pytest.importorskip("torch")
from gradientmail.adapters.torch import TorchBackend  # noqa: E402

KEYRING = Keyring.of(OLD)
SCHEMA = schema()
LIMIT = max_packed_size(SCHEMA) * 2
BACKEND = TorchBackend()
KINDS: list[type[Any]] = [Manifest, Lease, Snapshot, Claim, Commit]
Expected = type[BaseException] | tuple[type[BaseException], ...]
Case = tuple[str, Callable[[], object], Expected]


def _names(expected: Expected) -> str:
    kinds = expected if isinstance(expected, tuple) else (expected,)
    return " or ".join(kind.__name__ for kind in kinds)


def run_now(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Drive ``coroutine`` to its end: a fault-free MemoryMailbox never suspends."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    raise AssertionError("the exchange suspended on a fault-free memory mailbox")


def _payloads() -> list[bytes]:
    generator = torch.Generator().manual_seed(0)
    delta = {p.name: torch.randn(p.shape, generator=generator) for p in SCHEMA.parameters}
    found = []
    for quantization in (None, "F8_E4M3"):
        payload, _ = BACKEND.encode(delta, quantization)  # type: ignore[arg-type]
        found += [compress(payload, "off"), compress(payload, "zstd")]
    return found


PAYLOADS = _payloads()


def _valid_objects() -> list[bytes]:
    """Genuine objects of every kind, signed and not, with and without payloads."""
    found = []
    for record in RECORDS:
        for signer in (None, KEYRING):
            found.append(seal(to_bytes(record, signer)))
    for payload, compression in zip(PAYLOADS, ("off", "zstd") * 2, strict=True):
        record = Snapshot(
            node="a",
            nonce="0" * 16,
            round=5,
            base_round=3,
            samples=8,
            steps=10,
            digest=payload_digest(payload),
        )
        found.append(seal(to_bytes(record, KEYRING), payload, compression=compression))  # type: ignore[arg-type]
    return found


OBJECTS = _valid_objects()
RECORD_JSON = [json.loads(to_bytes(r, KEYRING)) for r in RECORDS]


def _mutate(base: bytes, seed: int) -> bytes:
    """1 to 4 random edits of ``base``, chosen by ``seed`` (one Hypothesis draw, not dozens:
    the campaign spends its time on inputs, not on drawing them)."""
    rng = random.Random(seed)
    blob = bytearray(base)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(max(1, len(blob)))
        op = rng.choice(["flip", "flip", "set", "cut", "insert", "delete"])
        if op == "flip" and blob:
            blob[i] ^= 1 << rng.randrange(8)
        elif op == "set" and blob:
            blob[i] = rng.randrange(256)
        elif op == "cut":
            del blob[i:]
        elif op == "insert":
            blob[i:i] = rng.randbytes(rng.randint(1, 16))
        elif op == "delete":
            del blob[i : i + rng.randint(1, 16)]
    return bytes(blob)


def mutated(bases: list[bytes]) -> st.SearchStrategy[bytes]:
    return st.tuples(st.sampled_from(bases), st.integers(0, 2**32 - 1)).map(
        lambda pair: _mutate(*pair)
    )


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def altered_records(draw: st.DrawFn) -> bytes:
    value = dict(draw(st.sampled_from(RECORD_JSON)))
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from([*sorted(value), "signature", "extra"]))
        if draw(st.booleans()) and name in value:
            del value[name]
        else:
            value[name] = draw(json_values)
    return canonical(value) if draw(st.booleans()) else json.dumps(value).encode()


blobs = st.one_of(st.binary(max_size=300), mutated(OBJECTS), mutated(PAYLOADS))
record_bytes = st.one_of(
    st.binary(max_size=200), altered_records(), mutated([canonical(v) for v in RECORD_JSON])
)


def _record_case(data: bytes, kind: type[Any], signed: bool) -> Case:
    verifier = KEYRING if signed else None
    return ("read_record", lambda: read_record(data, kind, key="k", verifier=verifier), FormatError)


def _exchange_case(blob: bytes, target: str) -> Case:
    mailbox = MemoryMailbox()
    exchange = Exchange(mailbox, MonotonicClock(), keyring=KEYRING, retries=1)
    key = {
        "manifest": keys.MANIFEST,
        "lease": keys.lease("a"),
        "claims": keys.claim(5, 0),
        "snapshot": keys.snapshot(5, "a"),
        "commit": keys.commit(5),
        "params": keys.params(5, "0" * 16),
        "head": keys.head(1),
    }[target]
    run_now(mailbox.put(key, blob))

    def call() -> object:
        if target == "manifest":
            return run_now(exchange.manifest())
        if target == "lease":
            return run_now(exchange.lease("a"))
        if target == "claims":
            return run_now(exchange.claims(5))
        if target == "commit":
            return run_now(exchange.commit(5))
        if target == "head":
            return run_now(exchange.head(1))
        if target == "params":
            ref = PayloadRef(key=key, digest=payload_digest(unseal(blob).payload), size=len(blob))
            return run_now(read_fragment(exchange, ref, SCHEMA))
        found = run_now(exchange.snapshot(5, "a", limit=LIMIT))
        return None if found is None else BACKEND.decode(found[1], SCHEMA)

    # Claims and heads are skipped with an event, never raised; the rest raise FormatError,
    # or (a well-formed payload of the wrong tensors) SchemaMismatch and NonFinite: never a
    # bare ValueError, which would be a bug of ours looking like garbage.
    expected: Expected = (
        FormatError
        if target in ("manifest", "lease", "commit")
        else (RejectedObject, SchemaMismatch, NonFinite)
    )
    return (f"exchange.{target}", call, expected)


TARGETS = st.sampled_from(["record", "unseal", "decompress", "unpack", "key", "exchange"])
EXCHANGE_TARGETS = st.sampled_from(
    ["manifest", "lease", "claims", "snapshot", "commit", "params", "head"]
)
KIND = st.sampled_from(KINDS)
CODEC = st.sampled_from(["off", "zstd"])
SAFETENSORS = st.one_of(
    mutated(
        [compress({"w": TensorBytes(dtype="F32", shape=(2,), data=bytes(8))}, "off"), PAYLOADS[0]]
    ),
    st.binary(max_size=100),
)
KEY_TEXT = st.one_of(
    st.text(max_size=80),
    st.tuples(
        st.sampled_from(["rounds/", "leases/", "rounds/00000000000000000005/"]),
        st.text(max_size=40),
    ).map("".join),
)
STORED = st.one_of(mutated(OBJECTS), st.sampled_from(OBJECTS), st.binary(max_size=100))


@st.composite
def cases(draw: st.DrawFn) -> Case:
    target = draw(TARGETS)
    if target == "record":
        return _record_case(draw(record_bytes), draw(KIND), draw(st.booleans()))
    if target == "unseal":
        blob = draw(blobs)
        return ("unseal", lambda: unseal(blob, key="k"), FormatError)
    if target == "decompress":
        data, codec = draw(blobs), draw(CODEC)
        return ("decompress", lambda: decompress(data, codec, limit=LIMIT), FormatError)
    if target == "unpack":
        data = draw(SAFETENSORS)
        return ("unpack", lambda: unpack(data), FormatError)
    if target == "key":
        text = draw(KEY_TEXT)
        return ("keys.parse", lambda: keys.parse(text), FormatError)
    return _exchange_case(draw(STORED), draw(EXCHANGE_TARGETS))


def check(case: Case) -> None:
    name, call, expected = case
    try:
        call()
    except expected:
        pass
    except Exception as exc:  # pragma: no cover - what the campaign hunts for
        raise AssertionError(
            f"{name} raised {type(exc).__name__}, not {_names(expected)}: {exc}"
        ) from exc


@settings(
    max_examples=10_000,  # about 10 s on two shared cores
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
@given(cases())
def test_fuzz_campaign(case: Case) -> None:
    check(case)


@pytest.mark.slow
@pytest.mark.timeout(4 * 3600)
@settings(
    max_examples=1_000_000,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
)
@given(cases())
def test_fuzz_campaign_thorough(case: Case) -> None:
    check(case)


@pytest.mark.parametrize("obj", OBJECTS, ids=range(len(OBJECTS)))
def test_every_base_object_is_genuine(obj: bytes) -> None:
    """The mutations start from objects every reader accepts, so they probe deep paths."""
    sealed = unseal(obj)
    value = json.loads(sealed.record)
    kind = {k.KIND: k for k in KINDS}[value["kind"]]
    read_record(sealed.record, kind, verifier=KEYRING if "signature" in value else None)
    if sealed.payload:
        BACKEND.decode(decompress(sealed.payload, sealed.compression, limit=LIMIT), SCHEMA)
