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
import os
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["WORTH_TRIMMING", "release_memory", "release_memory_soon"]

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


_SPENT: queue.SimpleQueue[object] = queue.SimpleQueue()
_RELEASER: list[threading.Thread] = []
_STARTING = threading.Lock()


def release_memory_soon(spent: list[Any] | None = None) -> None:
    """Free what ``spent`` holds and ``release_memory``, on a thread of the process's own, so
    that the training thread waits for neither: at 355M parameters, freeing a merged commit
    and its capture took 30-40 ms on it, the trim after that 62 ms. ``spent``: the caller's
    last references to large objects, in a list it gives up; they are taken out of it (so the
    last reference is dropped on that thread). What is handed over before a trim starts is
    freed before it."""
    with _STARTING:
        if not _RELEASER:
            thread = threading.Thread(target=_release, name="gradientmail-release", daemon=True)
            thread.start()
            _RELEASER.append(thread)
    while spent:
        _SPENT.put(spent.pop())
    _SPENT.put(None)  # a trim, even with nothing handed over


def _release() -> None:
    while True:
        spent = _SPENT.get()
        while True:  # drop everything handed over so far, then trim once
            del spent
            try:
                spent = _SPENT.get_nowait()
            except queue.Empty:
                break
        release_memory()


def _forget_releaser() -> None:
    """In a forked child the releasing thread is not running: the next call starts one."""
    global _SPENT, _STARTING
    _SPENT, _STARTING = queue.SimpleQueue(), threading.Lock()
    _RELEASER.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_releaser)
