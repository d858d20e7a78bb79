"""Handing the allocator's free memory back to the system between a node's large operations.

A node's loops allocate and free fragment-sized tensors and buffers on two threads, in pieces
of a few MB each (a layer's weights): glibc's malloc keeps such pieces in per-thread arenas once
its mmap threshold has risen past them, and a freed piece in the middle of an arena stays
resident. Over rounds that retained memory grew a lone 124M node's peak by about 1.5x the model
(docs/benchmarks.md). ``malloc_trim(0)`` returns every free page of every arena; it changes no
allocation policy, so the training loop's own allocations behave as before.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

__all__ = ["WORTH_TRIMMING", "release_memory"]

WORTH_TRIMMING = 32 * 2**20
"""Bytes freed at once below which the training thread does not trim: a trim walks every
arena (about 10 ms a merge at 842k parameters, where a merge frees under a megabyte)."""


def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None
    return trim


_TRIM = _malloc_trim()


def release_memory() -> None:
    """Return the allocator's free pages to the system (glibc's ``malloc_trim``; nothing where
    the C library has none). Called by a node's loops after a round's large work is done."""
    if _TRIM is not None:
        _TRIM(0)
