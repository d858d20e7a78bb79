"""Reading and writing a commit's payloads (``core.payloads`` says what they hold)."""

from __future__ import annotations

from typing import Any

from gradientmail._node.exchange import Exchange
from gradientmail._node.spill import Base
from gradientmail.adapters.base import Backend, Tensors
from gradientmail.core.errors import FormatError
from gradientmail.core.payloads import all_f32, outer_state_schema, payload_limit
from gradientmail.core.records import Commit, Manifest, PayloadRef
from gradientmail.core.tensors import Schema, TensorBytes, TensorView, validate

__all__ = [
    "add_to_sum",
    "load_spending",
    "outer_gradient",
    "outer_state",
    "read_base",
    "read_fragment",
    "read_outer_state",
    "scaled",
]


def add_to_sum(
    backend: Backend, total: Tensors | None, delta: Tensors, weight: float, *, owned: bool
) -> Tensors:
    """``total + weight * delta`` in F32, rounded as ``Backend.weighted_sum`` rounds its terms
    in order (``total`` None: the sum begins with this delta). ``owned``: no one else holds
    ``delta``, so a weight of 1 begins the sum with the delta itself, no copy."""
    if total is None:
        if owned and weight == 1.0:
            return delta  # delta * 1.0 is delta, bit for bit
        return backend.weighted_sum([(weight, delta)])
    # total * 1.0 is total: the same two roundings, a product and a sum, as weighted_sum's.
    return backend.weighted_sum([(1.0, total), (weight, delta)])


def load_spending(backend: Backend, tensors: dict[str, TensorBytes]) -> Tensors:
    """``backend.load(tensors)`` a tensor at a time, taking each tensor's bytes out of
    ``tensors`` as it is loaded: a fragment's bytes and its loaded tensors are never held whole
    side by side (``tensors`` is empty afterwards)."""
    loaded: dict[str, Any] = {}
    for name in list(tensors):
        loaded |= backend.load({name: tensors.pop(name)})
    return loaded


def scaled(backend: Backend, total: Tensors, scale: float) -> Tensors:
    """``scale * total`` in F32 (``total`` itself for a scale of 1)."""
    return total if scale == 1.0 else backend.weighted_sum([(scale, total)])


def outer_gradient(
    backend: Backend, deltas: list[Tensors], weights: list[float], scale: float
) -> Tensors:
    """The outer gradient as a closer computes it (``core.closing.outer_sum``): the deltas
    added one at a time with ``weights``, then scaled."""
    total: Tensors | None = None
    for delta, weight in zip(deltas, weights, strict=True):
        total = add_to_sum(backend, total, delta, weight, owned=False)
    assert total is not None
    return scaled(backend, total, scale)


async def read_fragment(
    exchange: Exchange, ref: PayloadRef, schema: Schema
) -> dict[str, TensorBytes] | None:
    """A fragment's parameters from ``ref``, checked against ``schema``; None when gone.
    ``FormatError`` or ``SchemaMismatch`` when the payload is corrupt or holds other tensors."""
    tensors = await exchange.read_payload(ref, limit=payload_limit(schema))
    if tensors is None:
        return None
    if sorted(tensors) != list(schema.names):
        raise FormatError(
            f"holds {sorted(set(tensors) ^ set(schema.names))} unlike the fragment", key=ref.key
        )
    validate(schema, tensors, schema.names)
    return tensors


def outer_state(
    backend: Backend, schema: Schema, master: Tensors, momentum: Tensors
) -> dict[str, TensorView]:
    """The ``state`` payload of a commit whose outer step left ``master`` and ``momentum``,
    lent (``Backend.lend``): the tensors must stay unchanged until it is written."""
    state = {f"momentum.{n}": t for n, t in backend.lend(momentum).items()}
    if not all_f32(schema):
        state |= {f"master.{n}": t for n, t in backend.lend(master).items()}
    return state


async def read_outer_state(
    exchange: Exchange,
    backend: Backend,
    commit: Commit,
    schema: Schema,
    master: Base | None = None,
) -> tuple[Base, Tensors] | None:
    """The F32 master parameters and momentum that ``commit`` left for the fragment of
    ``schema``; None when a payload is gone (collected). A state that also holds the master of
    F32 parameters (as written before it was stored once) is read as well. ``master``, when the
    caller holds the commit's F32 parameters already, spares reading them. ``FormatError``
    names the payload that is corrupt or holds other tensors (``master`` may be a file:
    ``spill.SpilledBase``)."""
    state = await exchange.read_payload(commit.state, limit=payload_limit(schema))
    if state is None:
        return None
    layouts = (outer_state_schema(schema, master=True), outer_state_schema(schema))
    layout = next((s for s in layouts if list(s.names) == sorted(state)), None)
    if layout is None:
        unlike = sorted(set(state) ^ set(layouts[1].names))
        raise FormatError(
            f"holds {unlike[:8]} unlike the fragment's outer state", key=commit.state.key
        )
    validate(layout, state, layout.names)
    loaded = load_spending(backend, state)
    if layout is layouts[0]:  # the master is in the state
        master = {n: loaded[f"master.{n}"] for n in schema.names}
    elif master is None:
        params = await read_fragment(exchange, commit.params, schema)
        if params is None:
            return None
        master = load_spending(backend, params)
    return master, {n: loaded[f"momentum.{n}"] for n in schema.names}


async def read_base(
    exchange: Exchange,
    backend: Backend,
    manifest: Manifest,
    fragment: int,
    before: Commit | None,
    master: Base | None = None,
) -> tuple[Base, Tensors | None] | None:
    """The F32 master parameters and momentum an outer step of ``fragment`` starts from: those
    ``before``, the fragment's previous commit, left (``read_outer_state``), or for the
    fragment's first round (``before`` None) its initial parameters cast to F32 and no momentum.
    None when a payload is gone (collected). ``master``: ``before``'s F32 parameters (the
    initial ones when ``before`` is None), when the caller holds them."""
    schema = manifest.fragment_schema(fragment)
    if before is not None:
        return await read_outer_state(exchange, backend, before, schema, master=master)
    if master is not None:
        return master, None
    init = await read_fragment(exchange, manifest.init[fragment], schema)
    if init is None:
        return None
    return backend.cast(load_spending(backend, init), schema.f32), None
