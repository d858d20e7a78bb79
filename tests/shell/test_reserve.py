"""Work taken off the training thread: a capture's memory prepared one step before the capture
(``Backend.reserve``), which the node uses and trains to the same parameters as without it;
spent tensors freed and the allocator trimmed on a thread of their own."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from virtual_run import drift, lone_session, make_model  # noqa: E402

from gradientmail import Committed, DiLoCo, Published, Session, mailbox_from_url  # noqa: E402
from gradientmail._node import learner, release, training  # noqa: E402
from gradientmail.adapters.base import Adapter, Tensors  # noqa: E402
from gradientmail.adapters.torch import TorchBackend  # noqa: E402


class CountingBackend(TorchBackend):
    """The torch backend, counting reservations and the captures that went into them."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.reserved: list[tuple[str, ...]] = []
        self.into: list[bool] = []

    def reserve(self, adapter: Adapter, names: Sequence[str]) -> Tensors:
        made = super().reserve(adapter, names)
        self.reserved.append(tuple(sorted(made)))
        return made

    def capture(
        self, adapter: Adapter, names: Sequence[str], *, into: Tensors | None = None
    ) -> Tensors:
        captured = super().capture(adapter, names, into=into)
        if into:
            assert all(captured[name] is into[name] for name in names)
        self.into.append(bool(into))
        return captured


@pytest.mark.parametrize("overlap", [0, 1])
def test_captures_go_into_reserved_memory_and_train_to_the_same_parameters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overlap: int
) -> None:
    finals, backends = {}, {}
    for reserving in (False, True):
        # Every fragment counts as large, or none does (the toy model's are bytes).
        monkeypatch.setattr(training, "RESERVE_BYTES", 0 if reserving else 2**62)
        model, backend = make_model(), CountingBackend()
        with lone_session(
            model, f"file://{tmp_path / str(reserving)}", overlap_steps=overlap, backend=backend
        ) as session:
            drift(model, session, 24)
        assert session.rounds_seen >= 10
        finals[reserving] = [p.detach().numpy().copy() for p in model.parameters()]
        backends[reserving] = backend
    assert all(np.array_equal(a, b) for a, b in zip(finals[False], finals[True], strict=True))
    off, on = backends[False], backends[True]
    assert off.reserved == [] and not any(off.into)
    # Every slot's capture while training (24 steps, a slot each 2) found its memory; the
    # captures close() makes were not forecast.
    assert sum(on.into) == 12 and len(on.reserved) == 12
    assert all(names for names in on.reserved)


@pytest.mark.parametrize("overlap", [0, 1])
def test_a_merge_by_the_difference_keeps_the_steps_trained_since_the_capture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overlap: int
) -> None:
    """The learner loop's ``commit - capture`` and the training thread's one pass give the
    two-pass merge's parameters, up to one rounding a merge: the steps trained between the
    capture and the merge (each moves every parameter by 0.01) are kept. Each step waits for
    the commit of what it published, so that with overlap 1 the commit is merged at the
    start of the next ``step()``, one training step after its capture."""
    finals = {}
    for by_difference in (False, True):
        monkeypatch.setattr(learner, "MERGE_BY_DIFFERENCE", by_difference)
        model = make_model()
        events: list[object] = []
        session = Session(
            model,
            algorithm=DiLoCo(inner_steps=4, fragments=2, overlap_steps=overlap),
            mailbox=mailbox_from_url(f"file://{tmp_path / str(by_difference)}"),
            poll_interval=0.05,
            lease_every=1.0,
            lease_timeout=3.0,
            callbacks=(events.append,),
        )
        with session:
            for _ in range(24):
                drift(model, session, 1)
                deadline = time.monotonic() + 10
                while count(events, Committed) < count(events, Published):
                    assert time.monotonic() < deadline, "no commit"
                    time.sleep(0.01)
                time.sleep(0.1)  # the commit delivered to the training side
        assert session.rounds_seen >= 10
        finals[by_difference] = [p.detach().numpy().copy() for p in model.parameters()]
    for a, b in zip(finals[False], finals[True], strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def count(events: list[object], kind: type) -> int:
    return sum(isinstance(event, kind) for event in events)


def test_a_reservation_for_another_fragment_is_not_used_and_a_failure_is_raised() -> None:
    model = torch.nn.Linear(3, 2)
    backend = TorchBackend("cpu")
    adapter = backend.adapter(model)
    reserved = training._Reserved(backend, adapter)
    assert reserved.take(0) == {}  # nothing asked
    reserved.request(0, ["weight"])
    made = reserved.take(0)
    assert list(made) == ["weight"] and tuple(made["weight"].shape) == (2, 3)
    assert reserved.take(0) == {}  # spent
    reserved.request(1, ["bias"])
    assert reserved.take(0) == {}  # forecast wrong: the capture takes new memory
    reserved.request(0, ["no.such.parameter"])
    with pytest.raises(Exception, match=r"no\.such\.parameter"):
        reserved.take(0)


class Spent:
    """Stands for a merged commit's tensors: says on which thread it was freed."""

    def __init__(self, freed: list[str], done: threading.Event) -> None:
        self.freed, self.done = freed, done

    def __del__(self) -> None:
        self.freed.append(threading.current_thread().name)
        self.done.set()


def test_spent_objects_are_freed_on_the_releasing_thread() -> None:
    freed: list[str] = []
    done = threading.Event()
    spent: list[object] = [Spent(freed, done)]
    release.release_memory_soon(spent)
    assert spent == []  # taken out: the caller holds no reference
    assert done.wait(10)
    assert freed == ["gradientmail-release"]
    release.release_memory_soon()  # nothing to free: a trim alone


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_a_forked_child_starts_its_own_releasing_thread() -> None:
    release.release_memory_soon()  # the parent's thread runs
    pid = os.fork()
    if pid == 0:  # the child: its object must still be freed, on a thread of its own
        code = 1
        try:
            freed: list[str] = []
            done = threading.Event()
            release.release_memory_soon([Spent(freed, done)])
            code = 0 if done.wait(10) and freed == ["gradientmail-release"] else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
