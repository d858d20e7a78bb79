"""The mailbox conformance suite: what every :class:`~gradientmail.mailboxes.Mailbox` must do.

Run it on your own mailbox the way ``trio.testing.check_two_way_stream`` is run on a stream::

    from gradientmail.testing._conformance import check_mailbox
    check_mailbox(lambda: MyMailbox("..."))
"""

from __future__ import annotations

import array
import asyncio
import hashlib
import itertools
import multiprocessing
import random
import secrets
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import attrs

from gradientmail.mailboxes._protocol import (
    BadKey,
    Mailbox,
    ObjectInfo,
    RequestStats,
    TooLarge,
    takes_parts,
)

__all__ = ["BAD_KEYS", "BAD_PREFIXES", "check_mailbox"]

Factory = Callable[[], Mailbox]
_T = TypeVar("_T")

BAD_KEYS = (
    "", "/a", "a/", "a//b", ".", "..", "./a", "a/..", "a/../b", "a b", "a\\b", "a?b", "a#b",
    "a~", "a*b", "é", "a\x00b", "a\nb", "x" * 256, "/".join(["x" * 200] * 6),
)  # fmt: skip
"""Keys every mailbox must reject with BadKey before sending anything."""

BAD_PREFIXES = ("/", "/a", "a//", "a//b", "../", "a/../", "a b/", "a/~")
"""List prefixes every mailbox must reject with BadKey."""


@attrs.frozen(kw_only=True)
class _Context:
    factory: Factory
    namespace: str
    large_size: int
    racers: int
    url: str | None

    def key(self, name: str) -> str:
        return f"{self.namespace}/{name}"


def check_mailbox(
    factory: Factory,
    *,
    large_size: int = 64 * 2**20,
    racers: int = 16,
    url: str | None = None,
    processes: int = 4,
) -> None:
    """Check that the mailboxes ``factory`` makes behave as the protocol needs.

    Args:
        factory: returns a new handle on one and the same store on every call (each racing
            thread gets its own). The store need not be empty: every check writes under a fresh
            random prefix, and lists only there.
        large_size: bytes of the large-object check (64 MiB matches a real snapshot).
        racers: threads racing to create one key.
        url: the store's URL, as ``mailbox_from_url`` takes it; with it, ``processes``
            processes (started fresh, so they share nothing with this one) also race to
            create keys, each through its own ``mailbox_from_url(url)``.
        processes: how many racing processes (at least 2) when ``url`` is given.

    Raises:
        AssertionError: naming the check and what differed.
    """
    if large_size < 1 or racers < 2 or processes < 2:
        raise ValueError(
            "need large_size >= 1, racers >= 2 and processes >= 2, "
            f"got {large_size}, {racers}, {processes}"
        )
    namespace = f"conformance-{secrets.token_hex(6)}"
    for check in _CHECKS:
        context = _Context(
            factory=factory,
            namespace=f"{namespace}/{check.__name__.strip('_')}",
            large_size=large_size,
            racers=processes if check is _check_process_race else racers,
            url=url,
        )
        try:
            check(context)
        except AssertionError as error:
            raise AssertionError(f"{check.__name__.strip('_')}: {error}") from error


def _run(context: _Context, body: Callable[[Mailbox], Awaitable[_T]]) -> _T:
    """Run ``body`` on a fresh handle in a new event loop, closing the handle after."""

    async def main() -> _T:
        mailbox = context.factory()
        try:
            return await body(mailbox)
        finally:
            await mailbox.close()

    return asyncio.run(main())


def _check_protocol(context: _Context) -> None:
    async def body(mailbox: Mailbox) -> None:
        assert isinstance(mailbox, Mailbox), f"{mailbox!r} lacks Mailbox methods"
        assert isinstance(mailbox.url, str) and mailbox.url, "url must be a non-empty str"
        assert isinstance(mailbox.stats, RequestStats), "stats must be a RequestStats"

    _run(context, body)


def _check_missing(context: _Context) -> None:
    async def body(mailbox: Mailbox) -> None:
        assert await mailbox.get(context.key("absent")) is None, "get of a missing key is None"
        await mailbox.delete(context.key("absent"))
        await mailbox.delete(context.key("absent/deeper"))
        assert await mailbox.list(context.key("")) == [], "a fresh prefix lists nothing"
        assert await mailbox.list(context.key("nothing/")) == []

    _run(context, body)


def _check_create(context: _Context) -> None:
    key = context.key("once")

    async def first(mailbox: Mailbox) -> None:
        assert await mailbox.create(key, b"first") is True, "create of a new key returns True"
        assert await mailbox.create(key, b"second") is False, "create of a taken key is False"
        assert await mailbox.get(key) == b"first", "a losing create must not change the object"
        assert await mailbox.create(context.key("empty"), b"") is True
        assert await mailbox.get(context.key("empty")) == b"", "an empty object is not missing"

    async def other_handle(mailbox: Mailbox) -> None:
        assert await mailbox.create(key, b"third") is False, "another handle sees the key taken"
        assert await mailbox.get(key) == b"first"
        infos = await mailbox.list(context.key(""))
        assert [(i.key, i.size) for i in infos] == [(context.key("empty"), 0), (key, 5)], infos

    _run(context, first)
    _run(context, other_handle)


def _check_not_durable(context: _Context) -> None:
    # ``durable=False`` relaxes only what survives a crash of the store's machine: while it
    # runs, such writes are atomic, create-only and overwritten exactly like the others.
    key, hint = context.key("volatile/claim"), context.key("volatile/hint")

    async def first(mailbox: Mailbox) -> None:
        assert await mailbox.create(key, b"mine", durable=False) is True
        assert await mailbox.create(key, b"theirs", durable=False) is False
        assert await mailbox.create(key, b"durable", durable=True) is False
        await mailbox.put(hint, b"1", durable=False)
        await mailbox.put(hint, b"22", durable=False)

    async def other_handle(mailbox: Mailbox) -> None:
        assert await mailbox.get(key) == b"mine", "a non-durable create is read like any"
        assert await mailbox.get(hint) == b"22", "a non-durable put overwrites like any"
        infos = await mailbox.list(context.key("volatile/"))
        assert [(i.key, i.size) for i in infos] == [(key, 4), (hint, 2)], infos

    _run(context, first)
    _run(context, other_handle)


def _check_put(context: _Context) -> None:
    key, owned = context.key("lease"), context.key("owned")

    async def body(mailbox: Mailbox) -> None:
        await mailbox.put(key, b"one")
        assert await mailbox.get(key) == b"one"
        [before] = await mailbox.list(key)
        await mailbox.put(key, b"two!")
        assert await mailbox.get(key) == b"two!", "put overwrites"
        [after] = await mailbox.list(key)
        assert after.size == 4 and after.version != before.version, (before, after)
        # An MD5 a listing gives is the bytes' (observers trust it to recognize a renewal).
        for info, data in ((before, b"one"), (after, b"two!")):
            if info.md5 is not None:
                assert info.md5 == hashlib.md5(data, usedforsecurity=False).hexdigest(), info
        assert await mailbox.create(owned, b"created") is True
        [made] = await mailbox.list(owned)
        if made.md5 is not None:
            assert made.md5 == hashlib.md5(b"created", usedforsecurity=False).hexdigest(), made
        await mailbox.put(owned, b"overwritten by its owner")
        assert await mailbox.get(owned) == b"overwritten by its owner"
        await mailbox.delete(owned)
        assert await mailbox.get(owned) is None, "a deleted key reads as missing"
        assert await mailbox.create(owned, b"again") is True, "a deleted key can be created"

    _run(context, body)


def _check_list(context: _Context) -> None:
    names = ["a", "b/1", "b/2", "b2", "b/deep/er/x", "c.d-e_f", "snapshots/x", "snapx", "z"]
    keys = sorted(context.key(name) for name in names)

    async def body(mailbox: Mailbox) -> None:
        for name in random.Random(7).sample(names, len(names)):
            assert await mailbox.create(context.key(name), name.encode()) is True

        async def listed(prefix: str, after: str | None = None) -> list[str]:
            infos = await mailbox.list(context.key(prefix), after=after and context.key(after))
            assert all(isinstance(info, ObjectInfo) for info in infos), infos
            return [info.key[len(context.namespace) + 1 :] for info in infos]

        assert await listed("") == [k[len(context.namespace) + 1 :] for k in keys], "sorted"
        assert await listed("b") == ["b/1", "b/2", "b/deep/er/x", "b2"], "plain string prefix"
        assert await listed("b/") == ["b/1", "b/2", "b/deep/er/x"], "recursive under b/"
        assert await listed("snap") == ["snapshots/x", "snapx"]
        assert await listed("b/", after="b/1") == ["b/2", "b/deep/er/x"], "after is exclusive"
        assert await listed("", after="snapx") == ["z"]
        assert await listed("", after="z") == []
        assert await listed("b/0") == [] and await listed("q") == []
        sizes = {info.key: info.size for info in await mailbox.list(context.namespace + "/")}
        assert sizes == {context.key(name): len(name) for name in names}, sizes
        assert [i.key for i in await mailbox.list(context.namespace)] == keys, "no slash"
        await mailbox.delete(context.key("b/2"))
        assert await listed("b/") == ["b/1", "b/deep/er/x"], "a deleted key is not listed"

    _run(context, body)


def _check_create_race(context: _Context) -> None:
    for round_number in range(3):
        key = context.key(f"contended-{round_number}")
        payloads = [f"racer {i} {secrets.token_hex(8)}".encode() for i in range(context.racers)]
        results = _race([_creator(context.factory, key, data) for data in payloads])
        winners = [i for i, won in enumerate(results) if won]
        assert len(winners) == 1, f"{key}: {len(winners)} creates won, exactly one must"
        stored = _read(context, key)
        assert stored == payloads[winners[0]], f"{key} holds {stored!r}, not the winner's data"


def _check_limit(context: _Context) -> None:
    """``get(key, limit=n)``: the object if it has at most n bytes, else ``TooLarge`` having
    counted no more than n bytes in; None for a missing key; an empty object is no error."""
    small, empty, missing = context.key("small"), context.key("empty"), context.key("missing")
    data = secrets.token_bytes(100)

    async def body(mailbox: Mailbox) -> None:
        await mailbox.put(small, data)
        await mailbox.put(empty, b"")
        assert await mailbox.get(small, limit=100) == data
        assert await mailbox.get(small, limit=10_000) == data
        assert await mailbox.get(empty, limit=10) == b""
        assert await mailbox.get(missing, limit=10) is None
        received = mailbox.stats.snapshot()["bytes_in"]
        try:
            await mailbox.get(small, limit=40)
        except TooLarge as error:
            assert (error.key, error.limit) == (small, 40), (error.key, error.limit)
            assert error.size > 40, f"TooLarge names size {error.size}"
        else:
            raise AssertionError("get(limit=40) of a 100-byte object raised no TooLarge")
        read = mailbox.stats.snapshot()["bytes_in"] - received
        assert read <= 40, f"get(limit=40) counted {read} bytes in"

    _run(context, body)


def _check_process_race(context: _Context) -> None:
    """Processes racing to create each of three keys: exactly one wins each."""
    if context.url is None:
        return
    keys = [context.key(f"contended-{n}") for n in range(3)]
    spawn = multiprocessing.get_context("spawn")  # nothing inherited but the environment
    barrier, results = spawn.Barrier(context.racers), spawn.Queue()
    racers = [
        spawn.Process(target=_create_in_process, args=(context.url, keys, i, barrier, results))
        for i in range(context.racers)
    ]
    for racer in racers:
        racer.start()
    try:
        reported = dict(results.get(timeout=120) for _ in racers)
    finally:
        for racer in racers:
            racer.join(timeout=30)
    failed = {i: r for i, r in reported.items() if isinstance(r, str)}
    assert not failed, f"racing processes failed: {failed}"
    outcomes = [reported[i] for i in range(context.racers)]
    for n, key in enumerate(keys):
        winners = [(i, data) for i, (won, data) in enumerate(o[n] for o in outcomes) if won]
        assert len(winners) == 1, f"{key}: {len(winners)} processes' creates won, exactly one must"
        stored = _read(context, key)
        assert stored == winners[0][1], f"{key} holds {stored!r}, not the winning process's data"


def _create_in_process(url: str, keys: list[str], racer: int, barrier: Any, results: Any) -> None:
    """A racing process: creates each key at the barrier; reports (racer, outcomes or error)."""
    from gradientmail.mailboxes._urls import mailbox_from_url

    async def race() -> list[tuple[bool, bytes]]:
        mailbox = mailbox_from_url(url)
        outcomes = []
        try:
            for key in keys:
                data = f"process {racer} {secrets.token_hex(8)}".encode()
                barrier.wait(timeout=60)
                outcomes.append((await mailbox.create(key, data), data))
        finally:
            await mailbox.close()
        return outcomes

    try:
        results.put((racer, asyncio.run(race())))
    except BaseException as error:
        results.put((racer, f"{type(error).__name__}: {error}"))
        barrier.abort()


def _read(context: _Context, key: str) -> bytes | None:
    async def body(mailbox: Mailbox) -> bytes | None:
        return await mailbox.get(key)

    return _run(context, body)


def _check_large(context: _Context) -> None:
    size = context.large_size
    generator = random.Random(size)  # randbytes takes at most 2**28 bytes at once
    data = b"".join(generator.randbytes(min(2**20, size - at)) for at in range(0, size, 2**20))
    key = context.key("large")

    async def body(mailbox: Mailbox) -> None:
        assert await mailbox.create(key, data) is True
        assert await mailbox.get(key) == data, f"a {size}-byte object did not round-trip"
        assert [info.size for info in await mailbox.list(key)] == [size]
        rotated = data[1:] + data[:1]
        await mailbox.put(key, rotated)
        assert await mailbox.get(key) == rotated, f"a {size}-byte overwrite did not round-trip"
        await mailbox.delete(key)

    _run(context, body)


def _check_parts(context: _Context) -> None:
    """A mailbox that says it takes parts (``takes_parts``) writes their concatenation:
    ``put`` and ``create``, a few small parts and, for ``put``, the large object in parts of
    uneven sizes (memoryviews of a float array among them, as tensors are handed over)."""
    key = context.key("parts")
    small = [b"head", memoryview(array.array("f", [1.5, -2.0, 3.25])), b"", bytearray(b"tail")]
    size = context.large_size
    generator = random.Random(size + 1)
    whole = b"".join(generator.randbytes(min(2**20, size - at)) for at in range(0, size, 2**20))
    cuts = sorted({0, len(whole), *(generator.randrange(len(whole) + 1) for _ in range(5))})
    large = [memoryview(whole)[a:b] for a, b in itertools.pairwise(cuts)]

    async def body(mailbox: Mailbox) -> None:
        if not takes_parts(mailbox):
            return
        parts_mailbox: Any = mailbox
        assert await parts_mailbox.create(key, small) is True
        expected = b"".join(bytes(p) for p in small)
        assert await mailbox.get(key) == expected, "parts created did not read back joined"
        assert await parts_mailbox.create(key, [b"other"]) is False, "a taken key was created"
        await parts_mailbox.put(key, large)
        assert await mailbox.get(key) == whole, f"{len(large)} parts put did not read back"
        assert [info.size for info in await mailbox.list(key)] == [len(whole)]
        await mailbox.delete(key)

    _run(context, body)


def _check_concurrent_readers(context: _Context) -> None:
    """Readers racing a writer see the old object, the new one or none; never a mixture."""
    size = max(2**16, min(context.large_size, 2**21))
    versions = [bytes([i]) * size for i in range(1, 5)]
    key, created = context.key("contended"), context.key("created")
    done = threading.Event()
    seen: list[bytes | None] = []

    async def write(mailbox: Mailbox) -> None:
        try:
            assert await mailbox.create(created, versions[0]) is True
            for round_number in range(12):
                await mailbox.put(key, versions[round_number % len(versions)])
        finally:
            done.set()

    async def read(mailbox: Mailbox) -> None:
        finished = False
        while not finished:
            finished = done.is_set()  # one more pass after the writer ends sees its last object
            for k in (key, created):
                data = await mailbox.get(k)
                seen.append(data if data is None or data in versions else data[:32])

    def worker(body: Callable[[Mailbox], Awaitable[None]]) -> Callable[[threading.Barrier], None]:
        def start(barrier: threading.Barrier) -> None:
            barrier.wait()
            _run(context, body)

        return start

    _race([worker(write)] + [worker(read)] * 3)
    partial = [data for data in seen if data is not None and data not in versions]
    assert not partial, f"readers saw {len(partial)} partial objects, e.g. {partial[0]!r}"
    assert any(data is not None for data in seen), "readers never saw an object"


def _check_bad_keys(context: _Context) -> None:
    # Stores prepend their own prefix to keys, and S3 limits the whole name to 1024 bytes.
    room = 900 - len(context.key(""))
    full, last = (room - 1) // 201, room - (room - 1) // 201 * 201
    good = context.key(("k" * 200 + "/") * full + "k" * last)

    async def body(mailbox: Mailbox) -> None:
        for key in BAD_KEYS:
            for operation in _operations(mailbox, key):
                try:
                    await operation
                except BadKey as error:
                    assert isinstance(error, ValueError) and error.key == key, error
                else:
                    raise AssertionError(f"{key!r} was accepted")
        for prefix in BAD_PREFIXES:
            try:
                await mailbox.list(prefix)
            except BadKey:
                continue
            raise AssertionError(f"list prefix {prefix!r} was accepted")
        assert await mailbox.create(good, b"long key") is True, "a 900-byte key is valid"
        assert await mailbox.get(good) == b"long key"

    _run(context, body)


def _operations(mailbox: Mailbox, key: str) -> list[Coroutine[Any, Any, object]]:
    return [
        mailbox.get(key),
        mailbox.put(key, b"x"),
        mailbox.create(key, b"x"),
        mailbox.delete(key),
    ]


def _check_stats(context: _Context) -> None:
    key = context.key("counted")

    async def body(mailbox: Mailbox) -> None:
        before = mailbox.stats.snapshot()
        assert await mailbox.create(key, b"x" * 100) is True
        assert await mailbox.get(key) == b"x" * 100
        await mailbox.put(key, b"y" * 50)
        await mailbox.list(key)
        await mailbox.delete(key)
        assert await mailbox.get(key) is None
        after = mailbox.stats.snapshot()
        delta = {name: after[name] - before.get(name, 0) for name in after}
        expected = {"get": 2, "put": 1, "create": 1, "list": 1, "delete": 1}
        expected |= {"bytes_in": 100, "bytes_out": 150}
        assert delta == expected, f"counted {delta}, expected {expected}"

    _run(context, body)


def _creator(factory: Factory, key: str, data: bytes) -> Callable[[threading.Barrier], bool]:
    def create(barrier: threading.Barrier) -> bool:
        with asyncio.Runner() as runner:
            mailbox = factory()
            barrier.wait()
            try:
                return runner.run(mailbox.create(key, data))
            finally:
                runner.run(mailbox.close())

    return create


def _race(workers: list[Callable[[threading.Barrier], _T]]) -> list[_T]:
    """Run each worker on its own thread; each waits on the shared barrier when it is ready.

    Re-raises the first failure.
    """
    barrier = threading.Barrier(len(workers))
    results: list[Any] = [None] * len(workers)
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            results[index] = workers[index](barrier)
        except BaseException as error:
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(workers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


_CHECKS: tuple[Callable[[_Context], None], ...] = (
    _check_protocol,
    _check_missing,
    _check_create,
    _check_not_durable,
    _check_put,
    _check_list,
    _check_create_race,
    _check_process_race,
    _check_large,
    _check_parts,
    _check_limit,
    _check_concurrent_readers,
    _check_bad_keys,
    _check_stats,
)
