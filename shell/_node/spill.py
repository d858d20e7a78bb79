"""A fragment's base kept in a file instead of memory (#19).

The learner measures every delta from the fragment's newest merged commit (its *base*) and
rebases onto it, so a node holds one F32 copy of the whole model besides the model itself:
1.0x the model's bytes, the largest thing a Session holds. A ``SpilledBase`` keeps those
tensors in an anonymous temporary file instead (created, written and unlinked at once, so
nothing is left behind when the process ends, however it ends): the kernel's page cache
holds them while memory is free and drops them when it is not, and a read costs a tensor's
bytes for as long as one delta or merge needs them.

Written on the learner loop's thread, before the commit is delivered (the training thread
only swaps which base it points to), and read on the learner loop's thread (a delta), the
training thread (a rebase, which merges since the base) or the syncer (the master of the
fragment's next outer step, ``outer_step``). The syncer writes files of its own for an outer
state it keeps (the momentum). A file is never written after it is made, so threads read it
without a lock; it is closed when no one holds it.
"""

from __future__ import annotations

import os
import tempfile
import weakref
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any

import attrs

from gradientmail.adapters.base import Backend, Tensors
from gradientmail.core.errors import SchemaMismatch
from gradientmail.core.tensors import PayloadDType, TensorBytes

__all__ = ["Base", "SpilledBase", "delta", "outer_step", "spill", "spills"]


_PREADV = getattr(os, "preadv", None)
"""``os.preadv``, where the system has it (Linux, the BSDs; not every macOS build)."""


@attrs.frozen
class _Entry:
    dtype: PayloadDType
    shape: tuple[int, ...]
    offset: int
    size: int


class SpilledBase(Mapping[str, Any]):
    """A fragment's base tensors in an anonymous file; ``base[name]`` reads one back as a
    backend tensor (a new one, each time)."""

    def __init__(self, backend: Backend, fd: int, entries: dict[str, _Entry]) -> None:
        self._backend = backend
        self._fd = fd
        self._entries = entries
        self._closer = weakref.finalize(self, os.close, fd)

    def __getitem__(self, name: str) -> Any:
        entry = self._entries[name]
        read_tensor = getattr(self._backend, "read_tensor", None)
        if read_tensor is not None:  # read straight into the new tensor's memory
            return read_tensor(entry.dtype, entry.shape, partial(self._fill, name, entry))
        parts = []
        done = 0
        while done < entry.size:  # one read, but for reads the kernel cuts short
            part = os.pread(self._fd, entry.size - done, entry.offset + done)
            if not part:
                raise OSError(f"the spilled base of {name!r} ended early")
            parts.append(part)
            done += len(part)
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        value = TensorBytes(dtype=entry.dtype, shape=entry.shape, data=data)
        return self._backend.load({name: value})[name]

    def _fill(self, name: str, entry: _Entry, buffer: memoryview) -> None:
        """Read ``name``'s bytes into ``buffer`` (the file's read releases the GIL); where the
        system has no ``preadv``, through ``pread``'s bytes."""
        done = 0
        while done < entry.size:  # one read, but for reads the kernel cuts short
            at = entry.offset + done
            if _PREADV is not None:
                read = _PREADV(self._fd, [buffer[done:]], at)
            else:
                part = os.pread(self._fd, entry.size - done, at)
                read = len(part)
                buffer[done : done + read] = part
            if not read:
                raise OSError(f"the spilled base of {name!r} ended early")
            done += read

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(e.size for e in self._entries.values())


Base = Tensors | SpilledBase
"""A fragment's base as a node keeps it: tensors in memory, or a file."""


def spills(backend: Backend) -> bool:
    """Whether a node with ``backend`` keeps its base in a file by default: what the backend
    says (``spills_base``: torch on the CPU, and MLX, where the base competes with the model
    for the same memory). A CUDA backend keeps it on its device (Decision 10's pinned host
    copy is not built), and a backend that does not say keeps it in memory."""
    return bool(getattr(backend, "spills_base", False))


def spill(backend: Backend, tensors: Tensors, directory: str | None = None) -> SpilledBase:
    """``tensors`` written to a new anonymous file in ``directory`` (the system's temporary
    directory when None)."""
    try:
        fd, path = tempfile.mkstemp(prefix="gradientmail-base-", dir=directory)
    except OSError as exc:
        raise _where(exc, directory) from exc
    try:
        os.unlink(path)
        entries: dict[str, _Entry] = {}
        offset = 0
        for name, view in backend.lend(tensors).items():
            data = memoryview(view.data).cast("B")
            written = 0
            while written < len(data):
                written += os.pwrite(fd, data[written:], offset + written)
            entries[name] = _Entry(dtype=view.dtype, shape=view.shape, offset=offset, size=written)
            offset += written
    except OSError as exc:
        os.close(fd)
        raise _where(exc, directory) from exc
    except BaseException:
        os.close(fd)
        raise
    return SpilledBase(backend, fd, entries)


def _where(exc: OSError, directory: str | None) -> OSError:
    where = directory if directory is not None else tempfile.gettempdir()
    return OSError(
        exc.errno,
        f"keeping a fragment's tensors in a file in {where!r} failed ({exc.strerror or exc}); "
        "give it two to three times the model's F32 bytes of room (docs/operations.md), or set "
        "Session(spill_dir=...) elsewhere, or Session(spill_base=False) to keep them in memory",
    )


def delta(
    backend: Backend, base: Base, captured: Tensors, residual: Base | None, *, owned: bool = False
) -> Tensors:
    """``backend.delta`` with a base or residual that may be spilled: then one tensor at a
    time, so a single tensor of each file is in memory at once. ``owned``: ``captured`` is
    given up (``Backend.delta``)."""
    # Unowned, the call a backend written before ``owned`` existed also takes.
    extra = {"owned": True} if owned else {}
    if not isinstance(base, SpilledBase) and not isinstance(residual, SpilledBase):
        return backend.delta(base, captured, residual, **extra)
    for group in (base, residual):
        if group is not None and set(group) != set(captured):
            names = sorted(set(group) ^ set(captured))
            raise SchemaMismatch(names, "delta: the tensors name different parameters")
    out: dict[str, Any] = {}
    for name in captured:
        one = None if residual is None else {name: residual[name]}
        out.update(backend.delta({name: base[name]}, {name: captured[name]}, one, **extra))
    return out


def outer_step(
    backend: Backend,
    master: Base,
    momentum: Base | None,
    gradient: Tensors,
    **options: Any,
) -> tuple[Tensors, Tensors]:
    """``backend.outer_step`` (``options``: its keywords) with a master or momentum that may
    be kept in a file: then one tensor at a time, so that a single tensor of each file is in
    memory at once besides the gradient and the new momentum."""
    if not isinstance(master, SpilledBase) and not isinstance(momentum, SpilledBase):
        return backend.outer_step(master, momentum, gradient, **options)
    for group in (master, momentum):
        if group is not None and set(group) != set(gradient):
            names = sorted(set(group) ^ set(gradient))
            raise SchemaMismatch(names, "outer_step: the tensors name different parameters")
    new_master: dict[str, Any] = {}
    new_momentum: dict[str, Any] = {}
    for name in sorted(gradient):
        one = None if momentum is None else {name: momentum[name]}
        stepped, moved = backend.outer_step(
            {name: master[name]}, one, {name: gradient[name]}, **options
        )
        new_master.update(stepped)
        new_momentum.update(moved)
    return new_master, new_momentum
