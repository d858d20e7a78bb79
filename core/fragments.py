"""How a model's parameters are split into fragments that sync at staggered times.

Streaming DiLoCo (arXiv:2501.18512, section 2.2) strides fragments over layers: layer ``i`` goes
to fragment ``i mod K``, so each fragment spans the depth of the network and no fragment is
all embeddings. A parameter's layer is its first numeric path segment (``layers.10.mlp.weight``
is layer 10, compared as a number so it follows ``layers.9``). Parameters outside any layer
(embeddings, final norms) are then placed, largest first, on the fragment with the fewest bytes,
which keeps fragments balanced. The result is deterministic and stored in the manifest.

Row blocks (``split=True``, what a Session asks for when its adapter serves them). A parameter
outside the layers that is larger than an even share of the model cannot be balanced whole: a
GPT-2's tied token embedding is 31% of its parameters, so at K=4 the fragment holding it had
twice the bytes of the others, and every per-fragment buffer (a delta, the outer state, an
upload) was sized by it. Such a parameter (at least 2-D) is cut along its first dimension into
*row blocks*, named ``name[start:stop]`` (rows ``start`` to ``stop - 1``): the lightest fragment
takes the rows that fill it up to an even share (``ceil(total / K)`` bytes), then the next,
until the rows are placed. A block is a parameter in its own right everywhere a fragment is
(its spec is the parent's with ``stop - start`` rows: ``fragment_schema``); the manifest's
schema keeps the model's own parameters, so a run's schema does not depend on the split.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import attrs

from gradientmail.core.tensors import ParameterSpec, Schema

__all__ = ["block", "block_name", "fragment_schema", "layer_of", "partition"]

_BLOCK = re.compile(r"(?P<parent>.+)\[(?P<start>0|[1-9][0-9]*):(?P<stop>[1-9][0-9]*)\]")
SPLIT_SHARE = 8
"""A parameter outside the layers is cut into row blocks only when it is larger than
``1 / SPLIT_SHARE`` of an even share: smaller ones are placed whole (a block costs a name, a
payload entry and a slice in each adapter)."""

Partition = tuple[tuple[str, ...], ...]


def layer_of(name: str) -> int | None:
    """The first numeric segment of a dotted parameter name, or None."""
    for segment in name.split("."):
        if segment.isascii() and segment.isdigit():
            return int(segment)
    return None


def block_name(parent: str, start: int, stop: int) -> str:
    """The name of rows ``start`` to ``stop - 1`` of parameter ``parent``."""
    return f"{parent}[{start}:{stop}]"


def block(name: str, schema: Schema) -> tuple[str, int, int] | None:
    """``(parent, start, stop)`` when ``name`` is a row block of a parameter of ``schema``;
    None for a parameter of the schema itself (a schema name always means the whole
    parameter) or a name that is neither."""
    if name in schema:
        return None
    match = _BLOCK.fullmatch(name)
    if match is None or match["parent"] not in schema:
        return None
    return match["parent"], int(match["start"]), int(match["stop"])


def fragment_schema(schema: Schema, names: Iterable[str]) -> Schema:
    """The specs of a fragment's ``names``: parameters of ``schema`` and row blocks of them.
    ``KeyError`` for a name that is neither, ``ValueError`` for a block out of its rows."""
    specs = []
    for name in names:
        found = block(name, schema)
        if found is None:
            specs.append(schema[name])
            continue
        parent, start, stop = found
        spec = schema[parent]
        if not (spec.shape and 0 <= start < stop <= spec.shape[0]):
            raise ValueError(f"row block {name!r} is outside {parent!r}'s shape {spec.shape}")
        specs.append(attrs.evolve(spec, name=name, shape=(stop - start, *spec.shape[1:])))
    return Schema.of(specs)


def partition(
    schema: Schema,
    fragments: int,
    mapping: Mapping[str, int] | None = None,
    *,
    split: bool = False,
) -> Partition:
    """Split ``schema``'s parameters into ``fragments`` groups of sorted names.

    ``mapping`` (parameter name to fragment index) overrides the strided default; it must name
    every parameter. ``split`` lets the strided default cut a large parameter outside the
    layers into row blocks (module docstring); a mapping is used as given. Raises
    ``ValueError`` when a fragment would be empty or the mapping is incomplete or out of range.
    """
    if fragments < 1:
        raise ValueError(f"fragments must be >= 1, got {fragments}")
    assignment = dict(mapping) if mapping is not None else _strided(schema, fragments, split=split)
    if mapping is None:
        groups = _groups(assignment, fragments)
        check(schema, groups)
        return groups
    missing = [n for n in schema.names if n not in assignment]
    extra = sorted(set(assignment) - set(schema.names))
    if missing or extra:
        raise ValueError(
            f"fragment mapping must name exactly the schema's parameters; "
            f"missing {missing}, unknown {extra}"
        )
    bad = sorted(n for n, k in assignment.items() if not 0 <= k < fragments)
    if bad:
        raise ValueError(f"fragment index out of 0..{fragments - 1} for {bad}")
    return _groups(assignment, fragments)


def _groups(assignment: Mapping[str, int], fragments: int) -> Partition:
    groups = tuple(
        tuple(sorted(n for n, k in assignment.items() if k == index)) for index in range(fragments)
    )
    empty = [i for i, g in enumerate(groups) if not g]
    if empty:
        raise ValueError(
            f"fragments {empty} would hold no parameters: the model has "
            f"{len(assignment)} parameters for {fragments} fragments"
        )
    return groups


def _strided(schema: Schema, fragments: int, *, split: bool) -> dict[str, int]:
    layers = sorted({layer for n in schema.names if (layer := layer_of(n)) is not None})
    rank = {layer: i for i, layer in enumerate(layers)}
    assignment: dict[str, int] = {}
    load = [0] * fragments
    for spec in schema.parameters:
        layer = layer_of(spec.name)
        if layer is not None and len(layers) >= fragments:
            index = rank[layer] % fragments
            assignment[spec.name] = index
            load[index] += spec.nbytes
    rest = [p for p in schema.parameters if p.name not in assignment]
    share = -(-schema.nbytes() // fragments)
    for spec in sorted(rest, key=lambda p: (-p.nbytes, p.name)):
        if split and fragments > 1 and _splits(spec, share):
            _place_rows(spec, share, load, assignment)
            continue
        index = min(range(fragments), key=lambda i: (load[i], i))
        assignment[spec.name] = index
        load[index] += spec.nbytes
    return assignment


def _splits(spec: ParameterSpec, share: int) -> bool:
    return len(spec.shape) >= 2 and spec.shape[0] >= 2 and spec.nbytes * SPLIT_SHARE > share


def _place_rows(
    spec: ParameterSpec, share: int, load: list[int], assignment: dict[str, int]
) -> None:
    """Fill the lightest fragments up to ``share`` bytes with row blocks of ``spec``; rows left
    when every fragment is full go to the lightest as one block."""
    rows = spec.shape[0]
    row_bytes = spec.nbytes // rows
    start = 0
    while start < rows:
        index = min(range(len(load)), key=lambda i: (load[i], i))
        room = (share - load[index]) // row_bytes if row_bytes else rows
        stop = rows if room <= 0 else min(rows, start + max(1, room))
        name = block_name(spec.name, start, stop) if (start, stop) != (0, rows) else spec.name
        assignment[name] = index
        load[index] += (stop - start) * row_bytes
        start = stop


def check(schema: Schema, groups: Partition) -> None:
    """Raise ``ValueError`` unless ``groups`` split exactly ``schema``'s parameters: each
    parameter whole in one group, or as row blocks that cover its rows once, in any groups."""
    if any(not g for g in groups):
        raise ValueError("fragment partition does not split the schema: a fragment is empty")
    whole: list[str] = []
    rows: dict[str, list[tuple[int, int]]] = {}
    for name in (n for g in groups for n in g):
        found = block(name, schema)
        if found is None:
            whole.append(name)
        else:
            rows.setdefault(found[0], []).append(found[1:])
    covered = sorted(whole + list(rows))
    if covered != list(schema.names) or len(set(whole)) != len(whole):
        raise ValueError("fragment partition does not split the schema's parameters exactly")
    for parent, spans in rows.items():
        if not schema[parent].shape:
            raise ValueError(f"fragment partition: {parent!r} has no rows to split")
        edges = [0]
        for start, stop in sorted(spans):
            if start != edges[-1] or stop <= start:
                break
            edges.append(stop)
        if edges[-1] != schema[parent].shape[0] or len(edges) != len(spans) + 1:
            raise ValueError(
                f"fragment partition: the row blocks of {parent!r} do not cover its "
                f"{schema[parent].shape[0]} rows exactly once"
            )
