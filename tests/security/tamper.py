"""A mailbox wrapper that tampers with chosen objects as they are written or read."""

from __future__ import annotations

import re
from collections.abc import Callable

from gradientmail.mailboxes._protocol import Mailbox, ObjectInfo, RequestStats

Transform = Callable[[bytes], bytes]


def flip(position: int) -> Transform:
    """Flip one bit of the byte ``position`` from the end (a payload byte, not the header)."""

    def apply(data: bytes) -> bytes:
        out = bytearray(data)
        out[len(out) - position] ^= 0x10
        return bytes(out)

    return apply


def truncate(count: int) -> Transform:
    return lambda data: data[:-count]


class TamperingMailbox:
    """Forwards to ``inner``. ``on_create`` maps a key to a transform of what an honest node
    creates there; ``on_get`` maps a key pattern to a transform applied to the first ``times``
    reads of matching keys (bit rot or a bad proxy, healed after); ``before_create`` maps a key
    to a callback run with the data just before an honest node creates it."""

    def __init__(self, inner: Mailbox) -> None:
        self.inner = inner
        self.url = inner.url
        self.stats: RequestStats = inner.stats
        self.on_create: dict[str, Transform] = {}
        self.on_get: list[tuple[re.Pattern[str], Transform, list[int]]] = []
        self.after_create: dict[str, Callable[[bytes], dict[str, bytes]]] = {}
        self.tampered: list[str] = []

    def corrupt_reads(self, pattern: str, transform: Transform, *, times: int) -> None:
        self.on_get.append((re.compile(pattern), transform, [times]))

    async def get(self, key: str, *, limit: int | None = None) -> bytes | None:
        data = await self.inner.get(key, limit=limit)
        for pattern, transform, left in self.on_get:
            if data is not None and left[0] > 0 and pattern.fullmatch(key):
                left[0] -= 1
                self.tampered.append(key)
                return transform(data)
        return data

    async def put(self, key: str, data: bytes, *, durable: bool = True) -> None:
        await self.inner.put(key, data, durable=durable)

    async def create(self, key: str, data: bytes, *, durable: bool = True) -> bool:
        transform = self.on_create.pop(key, None)
        if transform is not None:
            self.tampered.append(key)
            data = transform(data)
        created = await self.inner.create(key, data, durable=durable)
        plant = self.after_create.pop(key, None)
        if created and plant is not None:
            for other, blob in plant(data).items():
                await self.inner.create(other, blob)
                self.tampered.append(other)
        return created

    async def list(self, prefix: str, *, after: str | None = None) -> list[ObjectInfo]:
        return await self.inner.list(prefix, after=after)

    async def delete(self, key: str) -> None:
        await self.inner.delete(key)

    async def close(self) -> None:
        await self.inner.close()
