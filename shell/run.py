"""Creating, joining and reading a run: the steps ``Session`` and ``align`` share.

Join (design brief, "Rules"): read the manifest, or create the run (init payloads first, then
the create-only manifest, so a crash leaves either no run or a whole one, Decision 4); refuse a
model or algorithm that differs from the run's, naming what differs; then find the newest commit
of every fragment (the advisory ``heads/`` hint, then forward GETs: never a listing of all
rounds, Decision 8) and load it into the model.
"""

from __future__ import annotations

from collections.abc import Mapping

from gradientmail.adapters.base import Adapter
from gradientmail.core import keys
from gradientmail.core.algorithm import DiLoCo
from gradientmail.core.codecs import Compression
from gradientmail.core.errors import FormatError, ProtocolError
from gradientmail.core.fragments import partition
from gradientmail.core.records import Commit, Manifest, PayloadRef
from gradientmail.core.syncer import previous_round
from gradientmail.core.tensors import Schema, SchemaMismatch, TensorBytes, validate
from gradientmail.exchange import Exchange, new_nonce

__all__ = ["create_or_join", "load_newest", "newest_commit", "payload_limit", "read_fragment"]


def payload_limit(schema: Schema) -> int:
    """Bytes a decompressed payload of ``schema`` may reach: F32 master parameters and
    momentum (the largest payload, 8 bytes an element) plus header room."""
    return 8 * sum(p.numel for p in schema.parameters) + 64 * 1024 + 256 * len(schema.parameters)


def check_schema(run: Schema, ours: Schema) -> None:
    """Raise ``SchemaMismatch`` naming every parameter that differs in name, dtype or shape."""
    theirs, mine = {p.name: p for p in run.parameters}, {p.name: p for p in ours.parameters}
    differing = sorted(n for n in set(theirs) | set(mine) if theirs.get(n) != mine.get(n))
    if differing:
        raise SchemaMismatch(differing, "the model does not match the run's schema")


async def create_or_join(
    exchange: Exchange,
    adapter: Adapter,
    algorithm: DiLoCo,
    *,
    node: str,
    compression: Compression,
    mapping: Mapping[str, int] | None = None,
) -> tuple[Manifest, bool]:
    """The run's manifest, creating the run from ``adapter``'s parameters if there is none.
    Returns the manifest and whether this node created it."""
    manifest = await exchange.manifest()
    created = False
    if manifest is None:
        schema = adapter.schema
        groups = partition(schema, algorithm.fragments, mapping)
        refs = []
        for k, names in enumerate(groups):
            tensors = adapter.read(names)
            key = keys.init(k, new_nonce())
            refs.append(await exchange.write_payload(key, tensors, compression))
        ours = Manifest(
            nonce=new_nonce(),
            creator=node,
            schema=schema,
            algorithm=algorithm,
            fragments=groups,
            init=tuple(refs),
        )
        manifest = await exchange.create_manifest(ours)
        created = manifest is ours
        if not created:
            for ref in refs:
                await exchange.delete(ref.key)
    check_schema(manifest.schema, adapter.schema)
    algorithm.require_same(manifest.algorithm)
    return manifest, created


async def read_fragment(
    exchange: Exchange, ref: PayloadRef, schema: Schema
) -> dict[str, TensorBytes] | None:
    """A fragment's parameters from ``ref``, checked against ``schema``; None when gone."""
    tensors = await exchange.read_payload(ref, limit=payload_limit(schema))
    if tensors is None:
        return None
    if sorted(tensors) != list(schema.names):
        raise FormatError(
            f"holds {sorted(set(tensors) ^ set(schema.names))} unlike the fragment", key=ref.key
        )
    validate(schema, tensors, schema.names)
    return tensors


async def newest_commit(exchange: Exchange, manifest: Manifest, fragment: int) -> Commit | None:
    """The newest commit of ``fragment`` (None: only the initial parameters), found from the
    ``heads/`` hint and forward GETs."""
    K = manifest.algorithm.fragments
    hint = await exchange.head(fragment)
    start: Commit | None = None
    if hint is not None and hint % K == fragment:
        try:
            start = await exchange.commit(hint)
        except FormatError:
            start = None
    r = start.round + K if start is not None else fragment
    newest = start
    while True:
        commit = await exchange.commit(r)
        if commit is None:
            return newest
        if commit.fragment != fragment or commit.base_round != previous_round(
            manifest.algorithm, r
        ):
            raise ProtocolError(f"commit of round {r} does not continue fragment {fragment}")
        newest, r = commit, r + K


async def load_newest(
    exchange: Exchange, manifest: Manifest
) -> list[tuple[Commit | None, dict[str, TensorBytes]]]:
    """For every fragment, its newest commit (None: the initial parameters) and their tensors.

    A commit whose parameters were collected between the two reads is retried from the hint.
    """
    found = []
    for k in range(manifest.algorithm.fragments):
        schema = manifest.fragment_schema(k)
        for _ in range(8):
            commit = await newest_commit(exchange, manifest, k)
            ref = commit.params if commit is not None else manifest.init[k]
            tensors = await read_fragment(exchange, ref, schema)
            if tensors is not None:
                found.append((commit, tensors))
                break
        else:
            raise ProtocolError(f"fragment {k}: its newest parameters keep disappearing")
    return found
