"""Mailbox throughput: requests per second and MB/s, directory against a local moto S3.

Run:  python bench/mailbox.py [--ops 200] [--large-mib 64] [--repeats 3] [--concurrency 16]

Every row runs the same requests on each mailbox in one process; the ratio column is
moto / directory, so the table reads as "how much slower an S3-like HTTP store is than a
local disk" for each request the protocol makes (moto is a Python server: real S3 has more
latency per request but far more throughput under concurrency).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any

from gradientmail.mailboxes._directory import DirectoryMailbox
from gradientmail.mailboxes._memory import MemoryMailbox
from gradientmail.mailboxes._objectstore import ObjectStoreMailbox
from gradientmail.mailboxes._protocol import Mailbox
from gradientmail.testing._s3 import moto_s3

Row = tuple[str, str, Callable[[Mailbox], Coroutine[Any, Any, float]]]


def rows(ops: int, large: int, repeats: int, concurrency: int) -> list[Row]:
    """(name, unit, measure): each measure returns its figure for one mailbox."""
    small = b"s" * 1024
    payload = bytes(range(256)) * (large // 256)

    async def timed(count: int, make: Callable[[int], Awaitable[object]]) -> float:
        start = time.perf_counter()
        for i in range(count):
            await make(i)
        return count / (time.perf_counter() - start)

    async def create(m: Mailbox) -> float:
        return await timed(ops, lambda i: m.create(f"bench/small/{i:06d}", small))

    async def get(m: Mailbox) -> float:
        return await timed(ops, lambda i: m.get(f"bench/small/{i:06d}"))

    async def put(m: Mailbox) -> float:
        return await timed(ops, lambda i: m.put(f"bench/small/{i:06d}", small))

    async def listing(m: Mailbox) -> float:
        return await timed(max(ops // 10, 1), lambda i: m.list("bench/small/"))

    async def get_concurrent(m: Mailbox) -> float:
        start = time.perf_counter()
        for first in range(0, ops, concurrency):
            batch = range(first, min(first + concurrency, ops))
            await asyncio.gather(*(m.get(f"bench/small/{i:06d}") for i in batch))
        return ops / (time.perf_counter() - start)

    async def put_large(m: Mailbox) -> float:
        start = time.perf_counter()
        for i in range(repeats):
            await m.put(f"bench/large/{i}", payload)
        return repeats * len(payload) / 1e6 / (time.perf_counter() - start)

    async def get_large(m: Mailbox) -> float:
        start = time.perf_counter()
        for i in range(repeats):
            assert len(await m.get(f"bench/large/{i}") or b"") == len(payload)
        return repeats * len(payload) / 1e6 / (time.perf_counter() - start)

    return [
        ("create 1 KiB", "req/s", create),
        ("get 1 KiB", "req/s", get),
        (f"get 1 KiB x{concurrency} in flight", "req/s", get_concurrent),
        ("put 1 KiB (overwrite)", "req/s", put),
        (f"list {ops} keys", "req/s", listing),
        (f"put {large >> 20} MiB", "MB/s", put_large),
        (f"get {large >> 20} MiB", "MB/s", get_large),
    ]


@contextlib.contextmanager
def mailboxes() -> Iterator[dict[str, Mailbox]]:
    with tempfile.TemporaryDirectory(prefix="gm-bench-") as root, moto_s3() as url:
        yield {
            "memory": MemoryMailbox(),
            "directory": DirectoryMailbox(root),
            "moto": ObjectStoreMailbox(url),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", type=int, default=200, help="small requests per row")
    parser.add_argument("--large-mib", type=int, default=64, help="large object size, MiB")
    parser.add_argument("--repeats", type=int, default=3, help="large objects per row")
    parser.add_argument("--concurrency", type=int, default=16, help="gets in flight at once")
    args = parser.parse_args()
    table = rows(args.ops, args.large_mib << 20, args.repeats, args.concurrency)
    with mailboxes() as boxes:
        figures: dict[str, list[float]] = {
            name: [asyncio.run(measure(box)) for _, _, measure in table]
            for name, box in boxes.items()
        }
        requests = {name: box.stats.snapshot() for name, box in boxes.items()}
    print(f"{'request':<28} {'unit':<6} {'memory':>10} {'directory':>10} {'moto':>10} "
          f"{'moto/dir':>9}")  # fmt: skip
    for index, (name, unit, _) in enumerate(table):
        memory, directory, moto = (figures[box][index] for box in ("memory", "directory", "moto"))
        print(f"{name:<28} {unit:<6} {memory:>10.1f} {directory:>10.1f} {moto:>10.1f} "
              f"{moto / directory:>9.3f}")  # fmt: skip
    print()
    for name, counts in requests.items():
        print(f"{name:<10} requests sent: {counts}")


if __name__ == "__main__":
    main()
