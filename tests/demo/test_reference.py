"""DiLoCo through a directory mailbox against the paper's algorithm in one process.

The demo workers (real processes, one per node, a start barrier so that every round expects
all of them) and ``gradientmail.demo.reference`` (M models in one process, ``torch.optim.SGD``
as the outer optimizer) train the same model on the same batches; the run's final commit must
be the reference's global parameters: bit for bit when the mean over nodes is exact in floating
point (2 and 4 nodes: weights of 1/2 and 1/4), to rounding otherwise (3 nodes, and a last
round shorter than H, which both scale to H steps).
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import torch

from gradientmail import align, mailbox_from_url
from gradientmail.demo.config import GPTConfig
from gradientmail.demo.model import build
from gradientmail.demo.processes import Job, run_nodes

CONFIG = GPTConfig(context=32, layers=1, dim=32, heads=2)
MODEL = ("--context", "32", "--layers", "1", "--dim", "32", "--heads", "2", "--batch", "2")


def run_both(
    tmp_path: Path, *, nodes: int, steps: int, h: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[int]]:
    """The run's final parameters, the reference's, and how many snapshots each commit had."""
    common = (*MODEL, "--steps", str(steps), "--inner-steps", str(h), "--eval-windows", "8")
    mailbox, final = tmp_path / "mailbox", tmp_path / "reference.pt"
    mailbox.mkdir()
    jobs = [
        Job(
            label=f"node-{i}",
            node=i,
            argv=(*common, "--mailbox", mailbox.as_uri(), "--wait-nodes", str(nodes)),
            out=tmp_path / "run",
            steps=steps,
        )
        for i in range(nodes)
    ]
    jobs.append(
        Job(
            label="reference",
            node=0,
            argv=(*common, "--workers", str(nodes), "--final", str(final)),
            out=tmp_path / "reference",
            steps=steps,
            module="gradientmail.demo.reference",
        )
    )
    for job in jobs:
        job.out.mkdir(exist_ok=True)
    run_nodes(jobs, stream=io.StringIO(), refresh=0.2)
    model = build(CONFIG)
    # The steps after the last full round make one more round (close() publishes them).
    assert align(model, mailbox=mailbox_from_url(mailbox.as_uri())) == -(-steps // h) - 1
    included = [
        int(found.group(1))
        for log in sorted((tmp_path / "run").glob("node-*.log"))
        for line in log.read_text().splitlines()
        if (found := re.search(r" Committed .* included=(\d+)", line))
    ]
    ours = {name: p.detach() for name, p in model.named_parameters()}
    return ours, torch.load(final), included


@pytest.mark.parametrize("nodes", [2, 4])
def test_mailbox_run_is_the_papers_algorithm_bit_for_bit(tmp_path: Path, nodes: int) -> None:
    ours, reference, included = run_both(tmp_path, nodes=nodes, steps=40, h=10)
    assert included == [nodes] * 4, "every round includes every node's snapshot"
    assert ours.keys() == reference.keys()
    differ = [name for name in ours if not torch.equal(ours[name], reference[name])]
    assert not differ, f"parameters differ from the reference: {differ}"
    # The run moved away from the initial parameters, so equality says something.
    initial = dict(build(CONFIG).named_parameters())
    assert any(not torch.equal(ours[n], initial[n].detach()) for n in ours)


@pytest.mark.parametrize(("nodes", "steps"), [(3, 40), (2, 45)], ids=["3-nodes", "partial-round"])
def test_mailbox_run_matches_the_papers_algorithm_to_rounding(
    tmp_path: Path, nodes: int, steps: int
) -> None:
    # Three nodes' weights of 1/3 round; a last round of 5 steps counts as H steps' (Decision
    # 5), which the reference scales the same way, in another order of roundings.
    ours, reference, included = run_both(tmp_path, nodes=nodes, steps=steps, h=10)
    assert included == [nodes] * -(-steps // 10)
    for name in ours:
        torch.testing.assert_close(ours[name], reference[name], rtol=0, atol=1e-5, msg=name)
