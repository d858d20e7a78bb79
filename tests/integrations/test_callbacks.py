"""The callbacks' own rules, without a framework loop: what counts as a batch's samples, and
the clear errors for misuse."""

from __future__ import annotations

import pytest
import torch

from gradientmail import DiLoCo
from gradientmail.integrations._common import SessionHolder


def test_batch_samples_reads_the_first_dimension_of_common_batch_shapes() -> None:
    pytest.importorskip("lightning")
    from gradientmail.integrations.lightning import batch_samples

    x = torch.zeros(16, 8)
    assert batch_samples(x) == 16
    assert batch_samples((x, torch.zeros(16, 1))) == 16
    assert batch_samples([x]) == 16
    assert batch_samples({"input_ids": torch.zeros(4, 32, dtype=torch.long)}) == 4
    with pytest.raises(TypeError, match="samples="):
        batch_samples("not a batch")
    with pytest.raises(TypeError, match="samples="):
        batch_samples(torch.tensor(3.0))


def test_misuse_is_a_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TypeError, match="algorithm must be a DiLoCo"):
        SessionHolder({"inner_steps": 10}, str(tmp_path), {})  # type: ignore[arg-type]
    holder = SessionHolder(DiLoCo(inner_steps=10), str(tmp_path / "run"), {})
    with pytest.raises(RuntimeError, match="before it began"):
        holder.step(4)
    holder.close()  # closing what never opened does nothing
    assert not (tmp_path / "run").exists()
