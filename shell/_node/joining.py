"""The join's executor (``core.join`` decides), and the readers' shared reads: the manifest as
a reader is admitted to it, and a fragment's newest commit by the one chain walk."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from gradientmail._clock import Clock
from gradientmail._node.drive import Executor, Inbox, drive
from gradientmail._node.exchange import Exchange, new_nonce
from gradientmail._node.learner import UNTRUSTED, read_commit, read_params
from gradientmail.adapters.base import Adapter
from gradientmail.core import chain, join, keys
from gradientmail.core.codecs import Compression
from gradientmail.core.effects import (
    CreateManifest,
    Delete,
    HeadRead,
    InitWritten,
    LeaseRead,
    ManifestRead,
    ReadCommit,
    ReadHead,
    ReadLease,
    ReadManifest,
    ReadParams,
    Rejected,
    Result,
    WriteInit,
)
from gradientmail.core.records import Commit, Manifest
from gradientmail.core.rules import RULES, Rules
from gradientmail.core.tensors import TensorBytes

__all__ = ["Joiner", "newest", "read_manifest", "resign_manifest"]


class Joiner(Executor):
    """Carries out a join: reads and writes for ``core.join.step``. ``adapter`` gives the
    initial parameters of a run this node creates; ``loaded`` holds each fragment's newest
    parameters read, by fragment."""

    def __init__(
        self,
        *,
        exchange: Exchange,
        adapter: Adapter | None,
        compression: Compression = "off",
        nonces: Callable[[], str] = new_nonce,
    ) -> None:
        self._exchange = exchange
        self._adapter = adapter
        self._compression = compression
        self._nonces = nonces
        self.loaded: dict[int, dict[str, TensorBytes]] = {}
        self._manifest: Manifest | None = None
        self._handlers: dict[type, Callable[[Any], Awaitable[Result | None]]] = {
            ReadManifest: self._read_manifest,
            WriteInit: self._write_init,
            CreateManifest: self._create_manifest,
            Delete: self._delete,
            ReadLease: self._read_lease,
            ReadHead: self._read_head,
            ReadCommit: self._read_commit,
            ReadParams: self._read_params,
            Rejected: self._reject,
        }

    async def run(self, settings: join.Settings, clock: Clock) -> join.JoinState:
        """Join as ``settings`` say; the state holds the manifest and newest commits."""
        return await drive(
            "join",
            join.step,
            join.JoinState(),
            self.execute,
            clock=clock,
            inbox=Inbox(clock.bell()),
            settings=settings,
            keep=self._keep,
        )

    def _keep(self, state: join.JoinState) -> None:
        self._manifest = state.manifest

    async def _read_manifest(self, read: ReadManifest) -> Result:
        try:
            walk = await self._exchange.manifest_walk(verify=read.verify)
            return ManifestRead(manifest=walk.manifest, unverified=walk.unverified)
        except UNTRUSTED as exc:
            return ManifestRead(manifest=None, rejected=str(exc))

    async def _write_init(self, write: WriteInit) -> Result:
        assert self._adapter is not None
        tensors = self._adapter.read(write.names)
        key = keys.init(write.fragment, self._nonces())
        # Not remembered: a fragment's first close reads it once, and until then its bytes
        # would be held beside the model (up to the exchange's whole budget).
        ref = await self._exchange.write_payload(key, tensors, self._compression, remember=False)
        return InitWritten(fragment=write.fragment, ref=ref)

    async def _create_manifest(self, create: CreateManifest) -> Result:
        return await self._exchange.create_manifest(create.manifest)

    async def _delete(self, delete: Delete) -> None:
        for key in delete.keys:
            await self._exchange.delete(key)

    async def _read_lease(self, read: ReadLease) -> Result:
        try:
            return LeaseRead(node=read.node, lease=await self._exchange.lease(read.node))
        except UNTRUSTED as exc:
            return LeaseRead(node=read.node, lease=None, rejected=str(exc))

    async def _read_head(self, read: ReadHead) -> Result:
        return HeadRead(fragment=read.fragment, round=await self._exchange.head(read.fragment))

    async def _read_commit(self, read: ReadCommit) -> Result:
        return await read_commit(self._exchange, read.round, verify=read.verify)

    async def _read_params(self, read: ReadParams) -> Result:
        assert self._manifest is not None
        result, found = await read_params(
            self._exchange, self._manifest, read.fragment, read.commit
        )
        if found is not None:
            self.loaded[read.fragment] = found
        return result

    async def _reject(self, reject: Rejected) -> None:
        self._exchange.reject(reject.key, reject.reason)


async def read_manifest(
    exchange: Exchange,
    *,
    sources: join.SecretSources | None = None,
    clock: Clock | None = None,
) -> Manifest:
    """The run's manifest as a reader is admitted to it (``core.join``: ``ProtocolError`` when
    there is none, or this reader's secret does not fit the run)."""
    settings = join.Settings(
        node="reader",
        process="0" * 16,
        schema=None,
        algorithm=None,
        signed=exchange.keyring is not None,
        newest=False,
        sources=sources or join.SecretSources(),
        where=exchange.mailbox.url,
    )
    state = await Joiner(exchange=exchange, adapter=None).run(settings, clock or exchange.clock)
    assert state.manifest is not None
    return state.manifest


async def newest(
    exchange: Exchange, manifest: Manifest, fragment: int, *, rules: Rules = RULES
) -> Commit | None:
    """The newest commit of ``fragment`` a node would accept (None: only the initial
    parameters), by the chain walk (``core.chain``); what it passes over is reported."""
    walk, effects = chain.begin(manifest.algorithm, fragment, signed=manifest.signed)
    while not walk.done:
        result: HeadRead | Any = None
        for effect in effects:
            if isinstance(effect, Rejected):
                exchange.reject(effect.key, effect.reason)
            elif isinstance(effect, ReadHead):
                result = HeadRead(fragment=fragment, round=await exchange.head(fragment))
            elif isinstance(effect, ReadCommit):
                result = await read_commit(exchange, effect.round, verify=effect.verify)
        walk, effects = rules.walk(walk, result)
    for effect in effects:
        if isinstance(effect, Rejected):
            exchange.reject(effect.key, effect.reason)
    return walk.newest


async def resign_manifest(exchange: Exchange, *, clock: Clock | None = None) -> Manifest:
    """Rewrite the manifest signed with the first secret of ``exchange.keyring`` (the last step
    of a key rotation, docs/security.md): it must verify under one of the keyring's secrets.
    The content is unchanged, so readers racing the rewrite see a valid manifest either way."""
    if exchange.keyring is None:
        raise ValueError("resign_manifest needs an exchange with a keyring")
    manifest = await read_manifest(exchange, clock=clock or exchange.clock)
    await exchange.put_manifest(manifest)
    return manifest
