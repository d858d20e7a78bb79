"""Payload codec throughput and sizes on realistic deltas, against a plain bytes copy.

    python bench/codec.py            # 64 MiB of F32 and of BF16 deltas
    python bench/codec.py --mib 8    # smaller, for a quick look

Deltas are gaussian with a small standard deviation (1e-3, about what an outer step's
pseudo-gradient looks like), cut into tensors of ``--tensor-mib`` MiB as a model's layers
are. Each operation runs ``--repeat`` times and the fastest run counts, timed by the wall
clock or, with ``--clock cpu``, by this process's CPU time (steadier on a busy machine).
Throughput is MB/s (10^6 bytes) of tensor data; "x copy" divides it by the throughput of
copying the same number of bytes into a new ``bytes`` object in the same run. The entropy
column is the order-0 entropy of each byte plane, summed: the smallest size any coder of
independent byte planes can reach, so the gap to it is what the codec leaves on the table.

Targets (issue 2): zstd at least 16% smaller than uncompressed on F32 and 31% on BF16;
unpack at least 1 GB/s.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from gradientmail.core.codecs import ZSTD_PARAMETERS, compress, decompress, max_packed_size
from gradientmail.core.tensors import ParameterSpec, Schema, TensorBytes, pack, unpack

T = TypeVar("T")
TARGET_SMALLER = {"F32": 0.16, "BF16": 0.31}
UNPACK_TARGET_MBS = 1000.0


def deltas(dtype: str, mib: int, tensor_mib: int, std: float) -> dict[str, TensorBytes]:
    item = 4 if dtype == "F32" else 2
    count = (mib << 20) // item
    values = (np.random.default_rng(0).standard_normal(count) * std).astype(np.float32)
    if dtype == "BF16":
        bits = values.view(np.uint32)
        # Round to nearest even, as torch's float32 -> bfloat16 conversion does.
        raw = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2").tobytes()
    else:
        raw = values.astype("<f4").tobytes()
    step = (tensor_mib << 20) // item
    return {
        f"layers.{i:03d}.delta": TensorBytes(
            dtype=dtype,  # type: ignore[arg-type]
            shape=(min(step, count - start),),
            data=raw[start * item : (start + step) * item],
        )
        for i, start in enumerate(range(0, count, step))
    }


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def best(args: argparse.Namespace, fn: Callable[[], T]) -> tuple[float, T]:
    clock, times, result = CLOCKS[args.clock], [], None
    for _ in range(args.repeat):
        start = clock()
        result = fn()
        times.append(clock() - start)
    assert result is not None
    return min(times), result


def plane_entropy(tensors: dict[str, TensorBytes], item: int) -> float:
    """Order-0 entropy of the byte planes, as a fraction of the raw size."""
    raw = np.frombuffer(b"".join(t.data for t in tensors.values()), np.uint8).reshape(-1, item)
    bits = 0.0
    for k in range(item):
        counts = np.bincount(raw[:, k], minlength=256).astype(np.float64)
        p = counts[counts > 0] / counts.sum()
        bits += float(-(p * np.log2(p)).sum())
    return bits / (8 * item)


def unshuffled_zstd(blob: bytes) -> int:
    import zstandard

    params = zstandard.ZstdCompressionParameters.from_level(1, **ZSTD_PARAMETERS)
    return len(zstandard.ZstdCompressor(compression_params=params).compress(blob))


def measure(dtype: str, args: argparse.Namespace) -> dict[str, float]:
    tensors = deltas(dtype, args.mib, args.tensor_mib, args.std)
    schema = Schema.of(
        ParameterSpec(name=n, dtype=t.dtype, shape=t.shape) for n, t in tensors.items()
    )
    size = sum(len(t.data) for t in tensors.values())
    blob = pack(tensors)
    copy_s, _ = best(args, lambda: memoryview(blob).tobytes())
    pack_s, packed = best(args, lambda: pack(tensors))
    unpack_s, unpacked = best(args, lambda: unpack(blob))
    enc_s, frame = best(args, lambda: compress(tensors, "zstd"))
    limit = max_packed_size(schema)
    dec_s, decoded = best(args, lambda: decompress(frame, "zstd", limit=limit))
    assert packed == blob and unpacked == tensors and decoded == tensors
    return {
        "size": size,
        "copy": size / copy_s / 1e6,
        "pack": size / pack_s / 1e6,
        "unpack": size / unpack_s / 1e6,
        "zstd encode": size / enc_s / 1e6,
        "zstd decode": size / dec_s / 1e6,
        "ratio": len(frame) / len(blob),
        "plain ratio": unshuffled_zstd(blob) / len(blob),
        "limit": plane_entropy(tensors, 4 if dtype == "F32" else 2),
    }


def report(results: dict[str, dict[str, float]], args: argparse.Namespace) -> str:
    dtypes = list(results)
    lines = [
        f"Deltas: gaussian, std {args.std:g}, {args.mib} MiB per dtype in tensors of "
        f"{args.tensor_mib} MiB; best of {args.repeat}, {args.clock} clock.",
        "",
        "| operation | " + " | ".join(f"{d} MB/s | {d} x copy" for d in dtypes) + " |",
        "|---|" + "---:|---:|" * len(dtypes),
    ]
    for op in ("copy", "pack", "unpack", "zstd encode", "zstd decode"):
        label = "bytes copy (baseline)" if op == "copy" else op
        cells = " | ".join(
            f"{results[d][op]:,.0f} | {results[d][op] / results[d]['copy']:.2f}" for d in dtypes
        )
        lines.append(f"| {label} | {cells} |")
    lines += [
        "",
        "| dtype | zstd size / raw | smaller by | target | entropy limit | "
        "zstd without shuffle | met |",
        "|---|---:|---:|---:|---:|---:|:---:|",
    ]
    for d in dtypes:
        r = results[d]
        smaller, target = 1 - r["ratio"], TARGET_SMALLER[d]
        lines.append(
            f"| {d} | {r['ratio']:.4f} | {smaller:.1%} | {target:.0%} | {1 - r['limit']:.1%} "
            f"| {1 - r['plain ratio']:.1%} | {'yes' if smaller >= target else 'NO'} |"
        )
    unpack_ok = all(results[d]["unpack"] >= UNPACK_TARGET_MBS for d in dtypes)
    lines += ["", f"unpack >= {UNPACK_TARGET_MBS:,.0f} MB/s: {'yes' if unpack_ok else 'NO'}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=64, help="MiB of deltas per dtype")
    parser.add_argument("--tensor-mib", type=int, default=4, help="MiB per tensor")
    parser.add_argument("--repeat", type=int, default=3, help="runs per operation (best kept)")
    parser.add_argument("--std", type=float, default=1e-3, help="standard deviation of deltas")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall time, or this process's CPU time (steadier on a machine shared with others)",
    )
    args = parser.parse_args()
    results = {d: measure(d, args) for d in ("F32", "BF16")}
    print(report(results, args))


if __name__ == "__main__":
    main()
