"""The README's example, run as written: its code block is executed with only the names it
leaves to the reader supplied (``MyModel``, ``batches``, ``eval_model``) and its mailbox URL
pointed at a directory, then at a moto S3 server."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from gradientmail.testing._s3 import with_prefix

README = Path(__file__).resolve().parents[2] / "README.md"
URL = "s3://my-bucket/runs/exp1"


def example() -> str:
    """The README's first Python block that opens a Session."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    return next(b for b in blocks if "with Session(" in b)


class Output:
    def __init__(self, loss: torch.Tensor) -> None:
        self.loss = loss


class MyModel(torch.nn.Module):
    """A model whose forward returns an object with ``.loss``, as the example expects."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(4))

    def forward(self, batch: torch.Tensor) -> Output:
        target = torch.tensor([1.0, -2.0, 0.5, 3.0])
        return Output(((batch * (self.weight - target)) ** 2).mean())


def run_example(url: str) -> dict[str, Any]:
    code = example()
    assert URL in code, "the README's example names the URL this test replaces"
    generator = torch.Generator().manual_seed(0)
    batches = [torch.rand(8, 4, generator=generator) for _ in range(30)]
    namespace: dict[str, Any] = {"MyModel": MyModel, "batches": batches, "eval_model": MyModel()}
    exec(compile(code.replace(URL, url), str(README), "exec"), namespace)
    return namespace


def check(namespace: dict[str, Any]) -> None:
    model, eval_model = namespace["model"], namespace["eval_model"]
    session = namespace["session"]
    # Leaving the block published the 30 steps and waited for their commit; align loads it.
    assert session.rounds_seen == 0
    assert torch.equal(eval_model.weight, model.weight)
    assert not torch.equal(eval_model.weight, torch.zeros(4)), "training moved the model"


def test_readme_example_against_a_directory(tmp_path: Path) -> None:
    check(run_example((tmp_path / "runs" / "exp1").as_uri()))


@pytest.mark.s3
def test_readme_example_against_moto(s3_url: str) -> None:
    check(run_example(with_prefix(s3_url, "readme-example")))
