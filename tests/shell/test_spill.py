"""A fragment's base kept in an anonymous file (``spill``): the same bytes back, nothing left
on disk, the same deltas, and a Session that spills ends on the same parameters as one that
does not."""

from __future__ import annotations

import gc
import os
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from virtual_run import drift, lone_session, make_model  # noqa: E402

from gradientmail import DiLoCo  # noqa: E402
from gradientmail._node import spill  # noqa: E402
from gradientmail.adapters.torch import TorchBackend  # noqa: E402
from gradientmail.core.errors import SchemaMismatch  # noqa: E402

BACKEND = TorchBackend("cpu")


def tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {
        "a": torch.randn(17, 5, generator=generator),
        "b": torch.randn(8, generator=generator).to(torch.bfloat16),
        "empty": torch.zeros(0, 3),
    }


def test_a_spilled_base_reads_back_the_same_bytes_and_leaves_no_file(tmp_path: Path) -> None:
    original = tensors()
    base = spill.spill(BACKEND, original, str(tmp_path))
    assert list(tmp_path.iterdir()) == [], "unlinked as soon as it is made"
    assert sorted(base) == ["a", "b", "empty"] and len(base) == 3
    assert base.nbytes == 17 * 5 * 4 + 8 * 2
    for name, t in original.items():
        back = base[name]
        assert back.dtype == t.dtype and back.shape == t.shape
        assert torch.equal(back, t)
        assert back.data_ptr() != t.data_ptr() or t.numel() == 0
    fd = base._fd
    os.fstat(fd)  # open while the base is held
    del base
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(fd)


def test_a_spilled_base_cut_short_names_the_tensor_it_cannot_read(tmp_path: Path) -> None:
    base = spill.spill(BACKEND, tensors(), str(tmp_path))
    os.ftruncate(base._fd, 17 * 5 * 4 - 3)  # the file ends inside "a"
    with pytest.raises(OSError, match="spilled base of 'a' ended early"):
        base["a"]


@pytest.mark.parametrize("preadv", [True, False], ids=["preadv", "pread"])
def test_a_spilled_tensor_is_read_into_its_own_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, preadv: bool
) -> None:
    """The torch backend reads a spilled tensor straight into the new tensor (one copy): what
    it returns owns its memory, and a second read is a second tensor."""
    if not preadv:  # a system without os.preadv (some macOS builds)
        monkeypatch.setattr(spill, "_PREADV", None)
    original = {"w": torch.randn(256, 1024)}
    base = spill.spill(BACKEND, original, str(tmp_path))
    first, second = base["w"], base["w"]
    assert torch.equal(first, original["w"]) and torch.equal(second, original["w"])
    assert first.data_ptr() != second.data_ptr()
    first.add_(1.0)  # writable, and shared with nothing
    assert torch.equal(second, original["w"])
    with pytest.raises(TypeError, match="F8_E4M3"):
        BACKEND.read_tensor("F8_E4M3", (4,), lambda buffer: None)


def test_a_delta_from_a_spilled_base_is_the_in_memory_delta(tmp_path: Path) -> None:
    base = {"a": torch.randn(6, 4), "b": torch.randn(3)}
    local = {n: t + 0.25 for n, t in base.items()}
    residual = {n: torch.full_like(t, 0.5) for n, t in base.items()}
    spilled = spill.spill(BACKEND, base, str(tmp_path))
    kept = spill.spill(BACKEND, residual, str(tmp_path))  # a quantized round's error feedback
    cases = [(spilled, None), (spilled, residual), (spilled, kept), (base, kept)]
    for b, r in cases:
        want = BACKEND.delta(base, local, None if r is None else residual)
        got = spill.delta(BACKEND, b, local, r)
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[n], want[n]) for n in want)
    with pytest.raises(SchemaMismatch, match="different parameters"):
        spill.delta(BACKEND, spilled, {"a": local["a"]}, None)
    with pytest.raises(SchemaMismatch, match="different parameters"):
        spill.delta(BACKEND, {"a": base["a"]}, {"a": local["a"]}, kept)


def test_a_directory_that_cannot_take_the_base_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "gone"
    with pytest.raises(OSError, match="spill_dir") as caught:
        spill.spill(BACKEND, tensors(), str(missing))
    assert str(missing) in str(caught.value)


def test_spilling_is_the_cpu_default() -> None:
    assert spill.spills(BACKEND)
    assert not spill.spills(TorchBackend("meta"))


@pytest.mark.parametrize("quantization", [None, "F8_E4M3", "F4"])
def test_a_session_that_spills_trains_to_the_same_parameters(
    tmp_path: Path, quantization: Any
) -> None:
    """Quantized, the error feedback goes to a file too (and is read back for the next delta
    of its fragment): the run ends on the same parameters, bit for bit."""
    finals = {}
    for spilled in (False, True):
        model = make_model()
        url = f"file://{tmp_path / str(spilled)}"
        with lone_session(
            model,
            url,
            overlap_steps=0,
            quantization=quantization,
            spill_base=spilled,
            spill_dir=tmp_path,
        ) as session:
            drift(model, session, 24)
        assert session.rounds_seen >= 10
        finals[spilled] = [p.detach().numpy().copy() for p in model.parameters()]
    assert all(np.array_equal(a, b) for a, b in zip(finals[False], finals[True], strict=True))


def keep_committed(into: list[object], event: object) -> None:
    from gradientmail import Committed

    if isinstance(event, Committed):
        into.append(event)


def test_a_closer_keeps_its_state_in_files_and_reads_nothing_back(tmp_path: Path) -> None:
    """Over the exchange's budget (``written_cache`` 0 here; at 124M parameters a fragment's
    state is over the default 64 MiB), a closer whose learner keeps its base in a file keeps
    its momentum in a file of its own and takes the master from the learner's file of the
    commit's (or initial) parameters, and no closer reads its own snapshot back: a lone node
    then reads nothing from the store after its join but records. All three ways end
    on the same parameters, bit for bit: state in memory, read back from the store, in files."""
    from gradientmail import Session
    from gradientmail._node.syncer import SyncerLoop
    from gradientmail.mailboxes import DirectoryMailbox

    finals, read, commits = {}, {}, {}
    for case in ("memory", "store", "files"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(128, 128), torch.nn.Tanh(), torch.nn.Linear(128, 128)
        )
        model_bytes = sum(4 * p.numel() for p in model.parameters())
        mailbox = DirectoryMailbox(tmp_path / case, fsync=False)
        committed: list[object] = []
        session = Session(
            model,
            algorithm=DiLoCo(inner_steps=4, fragments=2, overlap_steps=0),
            mailbox=mailbox,
            poll_interval=0.05,
            lease_every=1.0,
            lease_timeout=3.0,
            callbacks=(partial(keep_committed, committed),),
            spill_base=case == "files",
            spill_dir=tmp_path,
        )
        if case != "memory":
            session._node.exchange._written_limit = 0  # before the first commit
        with session:
            drift(model, session, 24)
        syncer = session._node.syncer
        assert isinstance(syncer, SyncerLoop)
        kept = list(syncer._kept.values())
        if case == "files":
            assert kept and all(isinstance(k.momentum, spill.SpilledBase) for k in kept)
            assert all(k.master is None and k.size == 0 for k in kept), "the learner's file"
            assert sorted(p.name for p in tmp_path.iterdir()) == ["files", "memory", "store"]
        finals[case] = [p.detach().numpy().copy() for p in model.parameters()]
        read[case] = mailbox.stats["bytes_in"]
        commits[case] = len(committed)
    assert all(n >= 10 for n in commits.values()), commits
    for case in ("store", "files"):
        pairs = zip(finals["memory"], finals[case], strict=True)
        assert all(np.array_equal(a, b) for a, b in pairs), case
    # The join reads the initial parameters back; in memory each fragment's first outer step
    # reads them again as its master, where the files take them from the learner's file of
    # them. Beyond that, only records.
    assert read["files"] < 1.5 * model_bytes < 2 * model_bytes < read["memory"], read
    assert read["memory"] < 2.5 * model_bytes, read
    # Reading the state back costs each later round its fragment's momentum (half the model).
    later = commits["store"] - 2
    assert read["store"] - read["files"] >= 0.9 * later * model_bytes / 2, (read, commits)


def _commit(r: int, nonce: str) -> Any:
    from gradientmail.core import keys
    from gradientmail.core.records import Commit, Included, PayloadRef

    params = PayloadRef(key=keys.params(r, nonce), digest="0" * 64, size=1)
    state = PayloadRef(key=keys.state(r, nonce), digest="0" * 64, size=1)
    included = Included(node="n0", nonce=nonce, samples=8, steps=1, base_round=-1, digest="0" * 64)
    fields = {"closer": "n0", "attempt": 0, "included": (included,), "params": params}
    return Commit(round=r, fragment=r % 2, base_round=r - 2, nonce=nonce, state=state, **fields)


def test_the_handover_gives_only_the_file_of_the_commit_asked_for(tmp_path: Path) -> None:
    """A closer takes its master from the learner's file only when it holds the very commit
    (round and nonce) the outer step starts from, or the initial parameters (None) for a
    fragment's first round; a newer commit's file replaces an older one, never the reverse."""
    from gradientmail._node.handoff import Handover

    handover = Handover()
    init, first, second = (spill.spill(BACKEND, tensors(), str(tmp_path)) for _ in range(3))
    handover.put_base(0, None, init)
    assert handover.base(0, None) is init
    assert handover.base(1, None) is None, "another fragment"
    c2, c4 = _commit(2, "a" * 16), _commit(4, "b" * 16)
    assert handover.base(0, c2) is None, "the initial parameters are not commit 2's"
    handover.put_base(0, c2, first)
    assert handover.base(0, c2) is first and handover.base(0, None) is None
    assert handover.base(0, _commit(2, "c" * 16)) is None, "another nonce: a lost race"
    handover.put_base(0, c4, second)
    handover.put_base(0, c2, first)  # a late registration of an older commit
    assert handover.base(0, c4) is second and handover.base(0, c2) is None
