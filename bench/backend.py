"""Quantize and dequantize throughput of the torch and MLX backends, against a plain copy.

    python bench/backend.py                   # 64M parameters, every installed framework
    python bench/backend.py --params 4000000  # smaller, for a quick look

The delta is gaussian F32 (standard deviation 1e-3, about an outer step's pseudo-gradient), cut
into tensors of ``--tensor`` parameters as a model's layers are. "encode" is ``Backend.encode``
(finite check, quantization, the error-feedback residual and the payload's host bytes; a
quantized one of a delta it may spend, ``owned=True``, as the learner calls it, on a copy made
before the clock starts) and "decode" is ``Backend.decode`` of that payload (F32 tensors,
finite check). Throughput is GB/s (10^9 bytes) of F32 delta; "x copy" is the time over that of
copying the same tensors on the backend's device in the same run (torch ``clone``, MLX ``x * 1``
evaluated), so lower is better.
Each operation is timed ``--repeat`` times and the best run is kept. Bytes per parameter count
everything in the payload, scales included: F4's limit is 0.5 + 1/32 = 0.53125.

Every framework runs in its own process, once per ``--memory`` setting of glibc's allocator,
because a fresh tensor's cost depends on it more than on the arithmetic (a copy of 64M
parameters ran at 2 GB/s into fresh memory and 10-14 GB/s into memory the allocator kept):

- ``fresh``: ``MALLOC_MMAP_THRESHOLD_=131072``, so every tensor of ``--tensor`` parameters is
  its own mapping, faulted in page by page when first written and returned when freed;
- ``reused``: ``MALLOC_MMAP_THRESHOLD_=33554432`` and no trimming, so freed tensors' pages are
  kept and reused (tensors up to 8M parameters: glibc maps anything above 32 MiB).

A copy and an encode of the same run see the same setting. (Elsewhere than glibc the variables
do nothing and both settings measure the same thing.)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from gradientmail.core.tensors import ParameterSpec, Schema

T = TypeVar("T")
U = TypeVar("U")
F4_TARGET = 0.53125
TARGET_X = 5.0
"""Issue 19: a quantized encode or decode within this many times a copy of the same tensors."""
FORMATS: tuple[Any, ...] = (None, "F8_E4M3", "F4")
MEMORY = {
    "fresh": {"MALLOC_MMAP_THRESHOLD_": "131072"},
    "reused": {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "1099511627776"},
}
"""glibc's allocator settings of each ``--memory`` run (see the module's docstring)."""


def best(repeat: int, fn: Callable[[], T]) -> tuple[float, T]:
    return best_spending(repeat, lambda: None, lambda _: fn())


def best_spending(repeat: int, make: Callable[[], U], fn: Callable[[U], T]) -> tuple[float, T]:
    """The best time of ``repeat`` calls of ``fn``, each on what an untimed ``make`` made."""
    times, result = [], None
    for _ in range(repeat):
        made = make()
        start = time.perf_counter()
        result = fn(made)
        times.append(time.perf_counter() - start)
    assert result is not None
    return min(times), result


def arrays(params: int, tensor: int) -> dict[str, np.ndarray[Any, Any]]:
    values = (np.random.default_rng(0).standard_normal(params) * 1e-3).astype(np.float32)
    return {
        f"layers.{i:03d}.weight": values[start : start + tensor]
        for i, start in enumerate(range(0, params, tensor))
    }


def torch_case(device: str | None) -> tuple[Any, Callable[[Any], Any], Callable[[Any], Any]]:
    import torch

    from gradientmail.adapters import TorchBackend

    backend = TorchBackend(device)

    def to_tensor(a: np.ndarray[Any, Any]) -> Any:
        return torch.from_numpy(a.copy()).to(backend.device)

    def copy(tensors: Any) -> Any:
        out = {n: t.clone() for n, t in tensors.items()}
        if backend.device.type == "cuda":
            torch.cuda.synchronize(backend.device)
        return out

    return backend, to_tensor, copy


def mlx_case(device: str | None) -> tuple[Any, Callable[[Any], Any], Callable[[Any], Any]]:
    import mlx.core as mx

    from gradientmail.adapters import MLXBackend

    def to_tensor(a: np.ndarray[Any, Any]) -> Any:
        array = mx.array(a)
        mx.eval(array)
        return array

    def copy(tensors: Any) -> Any:
        out = {n: t * 1 for n, t in tensors.items()}
        mx.eval(list(out.values()))
        return out

    return MLXBackend(), to_tensor, copy


CASES = {"torch": torch_case, "mlx": mlx_case}


def measure(framework: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    backend, to_tensor, copy = CASES[framework](args.device)
    host = arrays(args.params, args.tensor)
    delta = {n: to_tensor(a) for n, a in host.items()}
    schema = Schema.of(ParameterSpec(name=n, dtype="F32", shape=a.shape) for n, a in host.items())
    gigabytes = 4 * args.params / 1e9
    copy_s, _ = best(args.repeat, lambda: copy(delta))
    rows = []
    for quantization in FORMATS:
        if quantization is None:
            encode_s, (payload, _) = best(args.repeat, lambda: backend.encode(delta, None))
        else:  # as the learner does: the delta is spent on its payload (``owned``)
            encode_s, (payload, _) = best_spending(
                args.repeat,
                lambda: copy(delta),
                lambda fresh, q=quantization: backend.encode(fresh, q, owned=True),
            )
        decode_s, _ = best(args.repeat, lambda p=payload: backend.decode(p, schema))
        rows.append(
            {
                "framework": framework,
                "format": quantization or "F32 (plain)",
                "encode": gigabytes / encode_s,
                "encode_x": encode_s / copy_s,
                "decode": gigabytes / decode_s,
                "decode_x": decode_s / copy_s,
                "bytes": sum(len(t.data) for t in payload.values()) / args.params,
                "copy": gigabytes / copy_s,
            }
        )
    return rows


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"{args.params:,} parameters in tensors of {args.tensor:,}; best of {args.repeat}.",
        "",
        "| framework | memory | format | copy GB/s | encode GB/s | encode x copy | decode GB/s "
        "| decode x copy | payload bytes/param |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['framework']} | {r['memory']} | {r['format']} | {r['copy']:.2f} "
            f"| {r['encode']:.2f} | {r['encode_x']:.1f} | {r['decode']:.2f} "
            f"| {r['decode_x']:.1f} | {r['bytes']:.5f} |"
        )
    quantized = [r for r in rows if r["format"] != "F32 (plain)"]
    if quantized:
        worst = max(quantized, key=lambda r: max(r["encode_x"], r["decode_x"]))
        x = max(worst["encode_x"], worst["decode_x"])
        verdict = "within" if x <= TARGET_X else "OVER"
        lines += [
            "",
            f"Slowest quantized encode or decode: {x:.1f}x a copy ({worst['framework']}, "
            f"{worst['format']}, {worst['memory']} memory): {verdict} the {TARGET_X:g}x target.",
        ]
    f4 = [r["bytes"] for r in rows if r["format"] == "F4"]
    if f4:
        verdict = "meets" if max(f4) <= F4_TARGET + 1e-4 else "MISSES"
        lines += ["", f"F4 payload: {max(f4):.5f} bytes/param, {verdict} the {F4_TARGET} limit."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=64 * 2**20, help="parameters (64M)")
    parser.add_argument("--tensor", type=int, default=4 * 2**20, help="parameters a tensor")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", default=None, help="torch device (default: cuda if any)")
    parser.add_argument("--frameworks", default="torch,mlx", help="comma-separated")
    parser.add_argument(
        "--memory",
        default="fresh,reused",
        help="allocator settings, comma-separated: " + ", ".join(MEMORY),
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)  # "framework:memory"
    args = parser.parse_args(argv)
    if args.child:
        framework, memory = args.child.split(":")
        rows = [{**row, "memory": memory} for row in measure(framework, args)]
        print(json.dumps(rows))
        return
    rows = []
    for framework in args.frameworks.split(","):
        if importlib.util.find_spec(framework) is None:
            print(f"{framework} is not installed: skipped")
            continue
        for memory in args.memory.split(","):
            rows += child(framework, memory, args)
    print(table(rows, args))


def child(framework: str, memory: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """``measure`` in a process of its own, under the allocator setting ``memory``."""
    if memory not in MEMORY:
        raise SystemExit(f"--memory: unknown setting {memory!r} (known: {', '.join(MEMORY)})")
    command = [sys.executable, __file__, "--child", f"{framework}:{memory}"]
    for name in ("params", "tensor", "repeat"):
        command += [f"--{name}", str(getattr(args, name))]
    if args.device:
        command += ["--device", args.device]
    done = subprocess.run(
        command, env={**os.environ, **MEMORY[memory]}, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"{framework} ({memory} memory) failed:\n{done.stderr}")
    rows: list[dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return rows


if __name__ == "__main__":
    main()
