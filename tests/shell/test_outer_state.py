"""A commit's outer state: with F32 parameters the master is the params payload, stored once;
a state written the older way (master and momentum) and a BF16 run's state (which must keep its
F32 master) read back as they were written; anything else is a clear error naming the key."""

from __future__ import annotations

import asyncio

import pytest
import torch

from gradientmail._clock import MonotonicClock
from gradientmail._node.exchange import Exchange
from gradientmail._node.payloads import outer_state, read_outer_state
from gradientmail.adapters.base import Tensors
from gradientmail.adapters.torch import TorchBackend
from gradientmail.core import keys
from gradientmail.core.errors import FormatError
from gradientmail.core.payloads import outer_state_schema
from gradientmail.core.records import Commit, Included, PayloadRef
from gradientmail.core.tensors import DType, ParameterSpec, Schema, TensorBytes
from gradientmail.mailboxes._memory import MemoryMailbox

BACKEND = TorchBackend()
NONCE = "ab" * 8


def schema_of(dtype: DType) -> Schema:
    return Schema.of(
        [
            ParameterSpec(name="w", dtype=dtype, shape=(3, 2)),
            ParameterSpec(name="b", dtype=dtype, shape=(2,)),
        ]
    )


def tensors(seed: int) -> Tensors:
    generator = torch.Generator().manual_seed(seed)
    return {
        "b": torch.randn(2, generator=generator),
        "w": torch.randn(3, 2, generator=generator),
    }


def commit(params: PayloadRef, state: PayloadRef) -> Commit:
    included = Included(node="n0", nonce=NONCE, samples=8, steps=1, base_round=-1, digest="0" * 64)
    return Commit(
        round=4,
        fragment=0,
        base_round=0,
        closer="n0",
        attempt=0,
        nonce=NONCE,
        included=(included,),
        params=params,
        state=state,
    )


def write_and_read(
    schema: Schema, state: dict[str, TensorBytes], master: Tensors
) -> tuple[Tensors, Tensors] | None:
    mailbox = MemoryMailbox().handle()
    writer = Exchange(mailbox, MonotonicClock(), node="n0")
    reader = Exchange(mailbox, MonotonicClock(), node="n1")  # reads the store, not memory

    async def main() -> tuple[Tensors, Tensors] | None:
        params = BACKEND.dump(BACKEND.cast(master, schema))
        params_ref = await writer.write_payload(keys.params(4, NONCE), params, "off")
        state_ref = await writer.write_payload(keys.state(4, NONCE), state, "off")
        return await read_outer_state(reader, BACKEND, commit(params_ref, state_ref), schema)

    return asyncio.run(main())


def assert_read(read: tuple[Tensors, Tensors] | None, master: Tensors, momentum: Tensors) -> None:
    assert read is not None
    assert_equal(read[0], master)
    assert_equal(read[1], momentum)


def assert_equal(a: Tensors, b: Tensors) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_an_f32_state_holds_the_momentum_only_and_the_master_comes_from_the_params() -> None:
    schema = schema_of("F32")
    master, momentum = tensors(1), tensors(2)
    state = outer_state(BACKEND, schema, master, momentum)
    assert sorted(state) == ["momentum.b", "momentum.w"]
    assert outer_state_schema(schema).names == ("momentum.b", "momentum.w")
    read = write_and_read(schema, state, master)
    assert_read(read, master, momentum)


def test_an_f32_state_that_also_holds_the_master_is_read_as_written() -> None:
    schema = schema_of("F32")
    master, momentum = tensors(3), tensors(4)
    state = {f"master.{n}": t for n, t in BACKEND.dump(master).items()}
    state |= {f"momentum.{n}": t for n, t in BACKEND.dump(momentum).items()}
    read = write_and_read(schema, state, tensors(5))  # params differ: the state's master wins
    assert_read(read, master, momentum)


def test_a_bf16_state_keeps_its_f32_master() -> None:
    schema = schema_of("BF16")
    master = {n: t + 1e-3 for n, t in tensors(6).items()}  # not representable in BF16
    momentum = tensors(7)
    state = outer_state(BACKEND, schema, master, momentum)
    assert sorted(state) == ["master.b", "master.w", "momentum.b", "momentum.w"]
    assert all(t.dtype == "F32" for t in state.values())
    read = write_and_read(schema, state, master)
    assert_read(read, master, momentum)


def test_a_state_holding_other_tensors_is_an_error_naming_its_key() -> None:
    schema = schema_of("F32")
    state = {f"velocity.{n}": t for n, t in BACKEND.dump(tensors(8)).items()}
    with pytest.raises(FormatError, match=r"velocity\.b") as error:
        write_and_read(schema, state, tensors(9))
    assert error.value.key == keys.state(4, NONCE)
