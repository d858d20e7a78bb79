"""What a commit's payloads hold, and how large a payload may be: the layout every writer and
reader of ``params`` and ``state`` shares.

``params`` holds the fragment's parameters in their schema dtypes. ``state`` holds the F32
outer momentum of each parameter (``momentum.<name>``) and the F32 master parameters
(``master.<name>``), except where every parameter is F32: the master is then the commit's
``params`` themselves, stored once (docs/protocol.md).
"""

from __future__ import annotations

import functools

import attrs

from gradientmail.core.tensors import Schema

__all__ = ["all_f32", "outer_state_schema", "payload_limit"]


def payload_limit(schema: Schema) -> int:
    """Bytes a decompressed payload of ``schema`` may reach: F32 master parameters and
    momentum (the largest payload, 8 bytes an element) plus header room."""
    return 8 * sum(p.numel for p in schema.parameters) + 64 * 1024 + 256 * len(schema.parameters)


def all_f32(schema: Schema) -> bool:
    """Whether every parameter of ``schema`` is F32 (its master is its params)."""
    return all(p.dtype == "F32" for p in schema.parameters)


@functools.lru_cache(maxsize=64)
def outer_state_schema(schema: Schema, *, master: bool | None = None) -> Schema:
    """What a commit's ``state`` payload holds for a fragment of ``schema``: the momentum, and
    the master unless every parameter is F32 (the default of ``master``)."""
    if master is None:
        master = not all_f32(schema)
    parts = ("master", "momentum") if master else ("momentum",)
    return Schema.of(
        attrs.evolve(p, name=f"{part}.{p.name}", dtype="F32")
        for part in parts
        for p in schema.parameters
    )
