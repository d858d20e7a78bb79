"""How a model's parameters are split into fragments that sync at staggered times.

Streaming DiLoCo (arXiv:2501.18512, section 2.2) strides fragments over layers: layer ``i`` goes
to fragment ``i mod K``, so each fragment spans the depth of the network and no fragment is
all embeddings. A parameter's layer is its first numeric path segment (``layers.10.mlp.weight``
is layer 10, compared as a number so it follows ``layers.9``). Parameters outside any layer
(embeddings, final norms) are then placed, largest first, on the fragment with the fewest bytes,
which keeps fragments balanced. The result is deterministic and stored in the manifest.
"""

from __future__ import annotations

from collections.abc import Mapping

from gradientmail.core.tensors import Schema

__all__ = ["layer_of", "partition"]

Partition = tuple[tuple[str, ...], ...]


def layer_of(name: str) -> int | None:
    """The first numeric segment of a dotted parameter name, or None."""
    for segment in name.split("."):
        if segment.isascii() and segment.isdigit():
            return int(segment)
    return None


def partition(
    schema: Schema, fragments: int, mapping: Mapping[str, int] | None = None
) -> Partition:
    """Split ``schema``'s parameters into ``fragments`` groups of sorted names.

    ``mapping`` (parameter name to fragment index) overrides the strided default; it must name
    every parameter. Raises ``ValueError`` when a fragment would be empty or the mapping is
    incomplete or out of range.
    """
    if fragments < 1:
        raise ValueError(f"fragments must be >= 1, got {fragments}")
    assignment = dict(mapping) if mapping is not None else _strided(schema, fragments)
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
    groups = tuple(
        tuple(sorted(n for n, k in assignment.items() if k == index)) for index in range(fragments)
    )
    empty = [i for i, g in enumerate(groups) if not g]
    if empty:
        raise ValueError(
            f"fragments {empty} would hold no parameters: the model has "
            f"{len(schema.parameters)} parameters for {fragments} fragments"
        )
    return groups


def _strided(schema: Schema, fragments: int) -> dict[str, int]:
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
    for spec in sorted(rest, key=lambda p: (-p.nbytes, p.name)):
        index = min(range(fragments), key=lambda i: (load[i], i))
        assignment[spec.name] = index
        load[index] += spec.nbytes
    return assignment


def check(schema: Schema, groups: Partition) -> None:
    """Raise ``ValueError`` unless ``groups`` split exactly ``schema``'s parameters."""
    names = [n for g in groups for n in g]
    if sorted(names) != list(schema.names) or any(not g for g in groups):
        raise ValueError("fragment partition does not split the schema's parameters exactly")
