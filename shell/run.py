"""Creating, joining and reading a run: the steps ``Session`` and ``align`` share.

Join (design brief, "Rules"): read the manifest, or create the run (init payloads first, then
the create-only manifest, so a crash leaves either no run or a whole one, Decision 4); refuse a
model or algorithm that differs from the run's, naming what differs; then find the newest commit
of every fragment (the advisory ``heads/`` hint, then forward GETs: never a listing of all
rounds, Decision 8) and load it into the model.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs

from gradientmail.adapters.base import Adapter, Backend, Tensors
from gradientmail.core import keys
from gradientmail.core.algorithm import DiLoCo
from gradientmail.core.codecs import Compression
from gradientmail.core.errors import FormatError, ProtocolError
from gradientmail.core.fragments import partition
from gradientmail.core.records import Commit, Manifest, PayloadRef
from gradientmail.core.signing import Keyring
from gradientmail.core.syncer import previous_round
from gradientmail.core.tensors import Schema, SchemaMismatch, TensorBytes, validate
from gradientmail.exchange import Exchange, new_nonce

__all__ = [
    "SECRET_ENV",
    "SECRET_FILE_ENV",
    "SecretSources",
    "check_signing",
    "create_or_join",
    "keyring_from",
    "load_newest",
    "newest_commit",
    "outer_state",
    "outer_state_schema",
    "payload_limit",
    "read_fragment",
    "read_manifest",
    "read_outer_state",
    "resign_manifest",
]

SECRET_ENV = "GRADIENTMAIL_SECRET"
"""The environment variable holding the run secret (two, comma-separated, during a rotation)."""

SECRET_FILE_ENV = "GRADIENTMAIL_SECRET_FILE"
"""The environment variable naming a file that holds the run secret(s), one a line."""

Secret = bytes | str | Keyring | Sequence[bytes | str]


def keyring_from(
    secret: Secret | None = None,
    secret_file: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> Keyring | None:
    """The node's run secrets: ``secret`` (one, or a sequence of two: the signing one first),
    else the file ``secret_file``, else ``$GRADIENTMAIL_SECRET``, else the file named by
    ``$GRADIENTMAIL_SECRET_FILE``; None when there is none (an unsigned run). Text secrets are
    UTF-8; a file or variable holds one secret, or two separated by a comma or a newline.
    Raises ``ValueError`` for both arguments at once, or a secret under 16 bytes."""
    if secret is not None and secret_file is not None:
        raise ValueError("pass secret= or secret_file=, not both")
    if isinstance(secret, Keyring):
        return secret
    if isinstance(secret, bytes | str):
        return Keyring.of(secret)
    if secret is not None:
        return Keyring.of(*secret)
    environ = os.environ if environ is None else environ
    if secret_file is None and environ.get(SECRET_ENV):
        return Keyring.parse(environ[SECRET_ENV])
    path = secret_file if secret_file is not None else environ.get(SECRET_FILE_ENV)
    if not path:
        return None
    try:
        return Keyring.parse(Path(path).read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"secret file {os.fspath(path)!r}: {exc}") from None


@attrs.frozen(kw_only=True)
class SecretSources:
    """How a reader of a run is given its secret, for the errors that say what to set.

    ``reader`` names it ("this node", "audit"); ``how`` says how to give it a secret; ``origins``
    lists where a secret it holds came from. The defaults are ``Session``'s and ``align``'s."""

    reader: str = "this node"
    how: str = (
        f"set {SECRET_ENV} (or {SECRET_FILE_ENV}), or pass secret= or secret_file= to Session "
        "or align"
    )
    origins: str = f"secret=, secret_file=, {SECRET_ENV} or {SECRET_FILE_ENV}"


def check_signing(
    manifest: Manifest, keyring: Keyring | None, *, sources: SecretSources = SecretSources()
) -> None:
    """Refuse, with what to set, a reader whose secret does not fit the run: none for a signed
    run, or one for an unsigned run (a run's signing is fixed when it is created)."""
    if manifest.signed and keyring is None:
        raise ProtocolError(f"the run is signed and {sources.reader} has no secret: {sources.how}")
    if not manifest.signed and keyring is not None:
        raise ProtocolError(
            f"the run is not signed but {sources.reader} has a secret (from {sources.origins}): "
            "remove it; whether a run is signed is fixed by the node that creates it"
        )


async def read_manifest(
    exchange: Exchange, *, sources: SecretSources = SecretSources()
) -> Manifest | None:
    """The run's manifest, None when there is no run; ``ProtocolError`` when this reader's
    secret does not fit the run (``check_signing``) or the manifest does not verify."""
    manifest = await exchange.manifest(verify=False)
    if manifest is None:
        return None
    return await _verified(exchange, manifest, sources)


async def _verified(exchange: Exchange, manifest: Manifest, sources: SecretSources) -> Manifest:
    check_signing(manifest, exchange.keyring, sources=sources)
    if exchange.keyring is None:
        return manifest
    try:
        verified = await exchange.manifest()
    except FormatError as exc:
        raise ProtocolError(
            f"the run's manifest does not verify with {sources.reader}'s secret (a wrong "
            f"secret, or a forged manifest): {exc}"
        ) from None
    if verified is None:
        raise ProtocolError(f"the manifest vanished from {exchange.mailbox.url}")
    return verified


async def resign_manifest(exchange: Exchange) -> Manifest:
    """Rewrite the manifest signed with the first secret of ``exchange.keyring`` (the last step
    of a key rotation, docs/security.md): it must verify under one of the keyring's secrets.
    The content is unchanged, so readers racing the rewrite see a valid manifest either way."""
    if exchange.keyring is None:
        raise ValueError("resign_manifest needs an exchange with a keyring")
    manifest = await read_manifest(exchange)
    if manifest is None:
        raise ProtocolError(f"{exchange.mailbox.url} holds no run (no manifest)")
    await exchange.put_manifest(manifest)
    return manifest


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
    manifest = await read_manifest(exchange)
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
            signed=exchange.keyring is not None,
        )
        manifest = await exchange.create_manifest(ours)
        created = manifest is ours
        if not created:
            for ref in refs:
                await exchange.delete(ref.key)
            manifest = await _verified(exchange, manifest, SecretSources())
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


@functools.lru_cache(maxsize=64)
def outer_state_schema(schema: Schema, *, master: bool | None = None) -> Schema:
    """What a commit's ``state`` payload holds for a fragment of ``schema``: the F32 outer
    momentum of each parameter (``momentum.<name>``) and the F32 master parameters
    (``master.<name>``), except where every parameter is F32 (the default of ``master``): the
    master is then the commit's ``params`` themselves, stored once (docs/protocol.md)."""
    if master is None:
        master = not _all_f32(schema)
    parts = ("master", "momentum") if master else ("momentum",)
    return Schema.of(
        attrs.evolve(p, name=f"{part}.{p.name}", dtype="F32")
        for part in parts
        for p in schema.parameters
    )


def outer_state(
    backend: Backend, schema: Schema, master: Tensors, momentum: Tensors
) -> dict[str, TensorBytes]:
    """The ``state`` payload of a commit whose outer step left ``master`` and ``momentum``."""
    state = {f"momentum.{n}": t for n, t in backend.dump(momentum).items()}
    if not _all_f32(schema):
        state |= {f"master.{n}": t for n, t in backend.dump(master).items()}
    return state


def _all_f32(schema: Schema) -> bool:
    return all(p.dtype == "F32" for p in schema.parameters)


async def read_outer_state(
    exchange: Exchange, backend: Backend, commit: Commit, schema: Schema
) -> tuple[Tensors, Tensors] | None:
    """The F32 master parameters and momentum that ``commit`` left for the fragment of
    ``schema``; None when a payload is gone (collected). A state that also holds the master of
    F32 parameters (as written before it was stored once) is read as well. ``FormatError``
    names the payload that is corrupt or holds other tensors."""
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
    loaded = backend.load(state)
    if layout is layouts[0]:  # the master is in the state
        master = {n: loaded[f"master.{n}"] for n in schema.names}
    else:
        params = await read_fragment(exchange, commit.params, schema)
        if params is None:
            return None
        master = backend.load(params)
    return master, {n: loaded[f"momentum.{n}"] for n in schema.names}


async def read_base(
    exchange: Exchange, backend: Backend, manifest: Manifest, fragment: int, before: Commit | None
) -> tuple[Tensors, Tensors | None] | None:
    """The F32 master parameters and momentum an outer step of ``fragment`` starts from: those
    ``before``, the fragment's previous commit, left (``read_outer_state``), or for the
    fragment's first round (``before`` None) its initial parameters cast to F32 and no momentum.
    None when a payload is gone (collected)."""
    schema = manifest.fragment_schema(fragment)
    if before is not None:
        return await read_outer_state(exchange, backend, before, schema)
    init = await read_fragment(exchange, manifest.init[fragment], schema)
    if init is None:
        return None
    return backend.cast(backend.load(init), schema.f32), None


async def newest_commit(exchange: Exchange, manifest: Manifest, fragment: int) -> Commit | None:
    """The newest commit of ``fragment`` (None: only the initial parameters), found from the
    ``heads/`` hint and forward GETs.

    The commits walked past are read without their signatures checked (only their chain is
    used; after a key rotation the old ones verify under no secret held); the one returned is
    verified in a signed run, so a forged newest commit raises ``FormatError``."""
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
        commit = await exchange.commit(r, verify=False)
        if commit is None:
            break
        if commit.fragment != fragment or commit.base_round != previous_round(
            manifest.algorithm, r
        ):
            raise ProtocolError(f"commit of round {r} does not continue fragment {fragment}")
        newest, r = commit, r + K
    if newest is None or newest is start or exchange.keyring is None:
        return newest
    return await exchange.commit(newest.round)


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
