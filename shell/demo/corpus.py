"""A byte-level corpus made of the Python standard library's own source files.

Every machine with Python has it, so the demo needs no download. The files are the top-level
``*.py`` modules of the standard library directory, sorted by name, so a given Python version
gives the same bytes everywhere. Every tenth file is held out for evaluation: whole files, so no
text is shared between the two splits.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import attrs
import numpy as np
import numpy.typing as npt

__all__ = ["Corpus", "batches", "heldout_windows", "load_corpus", "stdlib_sources"]

Tokens = npt.NDArray[np.uint8]

HELDOUT_EVERY = 10


@attrs.frozen(kw_only=True)
class Corpus:
    """The training and held-out bytes (token ids 0..255), and the files they came from."""

    train: Tokens = attrs.field(eq=False)
    heldout: Tokens = attrs.field(eq=False)
    files: tuple[str, ...]


def stdlib_sources() -> list[Path]:
    """The standard library's top-level ``*.py`` files, sorted by file name."""
    root = Path(sysconfig.get_paths().get("stdlib") or os.path.dirname(os.__file__))
    files = sorted(root.glob("*.py"), key=lambda p: p.name)
    if not files:
        raise FileNotFoundError(f"no Python source files in the standard library at {root}")
    return files


def load_corpus(files: list[Path] | None = None) -> Corpus:
    """Concatenate ``files`` (default: ``stdlib_sources()``) into the two splits.

    File ``i`` in sorted order is held out when ``i % 10 == 0``; the rest train. A few MB.
    """
    files = stdlib_sources() if files is None else files
    train: list[bytes] = []
    heldout: list[bytes] = []
    for i, path in enumerate(files):
        (heldout if i % HELDOUT_EVERY == 0 else train).append(path.read_bytes())
    return Corpus(
        train=np.frombuffer(b"".join(train), np.uint8),
        heldout=np.frombuffer(b"".join(heldout), np.uint8),
        files=tuple(p.name for p in files),
    )


def _windows(tokens: Tokens, starts: npt.NDArray[np.int64], length: int) -> Tokens:
    windows: Tokens = tokens[starts[:, None] + np.arange(length)[None, :]]
    return windows


def batches(tokens: Tokens, *, batch: int, context: int, seed: int, node: int) -> Iterator[Tokens]:
    """An endless stream of ``(batch, context + 1)`` windows at random offsets in ``tokens``.

    Inputs are ``[:, :-1]`` and targets ``[:, 1:]``. The generator is seeded with
    ``(seed, node)``, so each node of a run draws its own independent stream and a rerun draws
    the same one.
    """
    if tokens.size <= context + 1:
        raise ValueError(f"corpus of {tokens.size} tokens is too short for context {context}")
    rng = np.random.default_rng([seed, node])
    while True:
        starts = rng.integers(0, tokens.size - context - 1, size=batch, dtype=np.int64)
        yield _windows(tokens, starts, context + 1)


def heldout_windows(tokens: Tokens, *, count: int, context: int, seed: int = 1234) -> Tokens:
    """A fixed set of ``count`` windows of ``context + 1`` tokens to evaluate held-out loss on.

    Evenly spaced through ``tokens`` (offset by ``seed``), so they cover every held-out file.
    """
    span = tokens.size - context - 1
    if span <= 0 or count <= 0:
        raise ValueError(f"cannot draw {count} windows of {context + 1} from {tokens.size} tokens")
    offset = seed % max(1, span // count)
    starts = (offset + np.arange(count, dtype=np.int64) * (span // count)).astype(np.int64)
    return _windows(tokens, starts, context + 1)
