"""docs/integrations.md's examples, run as written: each code block with only the names it
leaves to the reader supplied (``MODEL`` and ``DATASET``, ``MODULE`` and ``LOADER``) and its
mailbox URL pointed at a directory; the model then holds the run's final parameters, as
``align`` loads them, and what the example saved is that model."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import frameworks_worker

from gradientmail import align, mailbox_from_url

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


def block(marker: str) -> tuple[str, str]:
    """The doc's Python block that contains ``marker``, and the s3:// URL it names."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    code = next(b for b in blocks if marker in b)
    [url] = re.findall(r'"(s3://[^"]+)"', code)
    return code, url


def run(code: str, url: str, tmp_path: Path, names: dict[str, Any]) -> None:
    run_url = (tmp_path / "run").as_uri()
    cwd = os.getcwd()
    os.chdir(tmp_path)  # the examples write to relative paths
    try:
        exec(compile(code.replace(url, run_url), str(DOC), "exec"), names)
    finally:
        os.chdir(cwd)


def test_the_hugging_face_example(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    code, url = block("GradientmailCallback(")
    model = frameworks_worker.gpt2(seed=0)
    names = {"MODEL": model, "DATASET": frameworks_worker.token_data(0, 160)}
    run(code, url, tmp_path, names)
    fresh = frameworks_worker.gpt2(seed=1)
    assert align(fresh, mailbox=mailbox_from_url((tmp_path / "run").as_uri())) >= 3
    assert frameworks_worker.digest(fresh) == frameworks_worker.digest(model)
    from transformers import GPT2LMHeadModel

    saved = GPT2LMHeadModel.from_pretrained(tmp_path / "out" / "final")
    assert frameworks_worker.digest(saved) == frameworks_worker.digest(model)


def test_the_lightning_example(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    code, url = block("lightning.pytorch")
    module = frameworks_worker.regression(seed=0)
    x = torch.randn(1280, 8, generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=16
    )
    run(code, url, tmp_path, {"MODULE": module, "LOADER": loader})
    fresh = frameworks_worker.regression(seed=1)
    assert align(fresh, mailbox=mailbox_from_url((tmp_path / "run").as_uri())) >= 3
    assert frameworks_worker.digest(fresh) == frameworks_worker.digest(module)
    saved = torch.load(tmp_path / "final.ckpt", weights_only=False)["state_dict"]
    assert all(torch.equal(saved[k], v) for k, v in module.state_dict().items())


TORCHRUN_PRELUDE = """
import torch

torch.manual_seed(0)
MODEL = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
_g = torch.Generator().manual_seed(int(__import__("os").environ["RANK"]))
LOADER = [(x, x.sum(dim=1, keepdim=True)) for x in torch.randn(40, 8, 4, generator=_g)]
"""

# Reached only when the example ran through: leave without the interpreter's teardown, where
# gloo's threads sometimes abort a process whose work is all done (docs/integrations.md; a plain
# torch script with no gradientmail in it aborts there too).
TORCHRUN_EPILOGUE = """
import os as _os, sys as _sys
_sys.stdout.flush()
_os._exit(0)
"""


def torchrun_example(marker: str, tmp_path: Path) -> None:
    """Run the doc's block holding ``marker`` as a script under ``torchrun`` (2 ranks), its
    mailbox URL pointed at ``tmp_path / "run"``."""
    import subprocess

    code, url = block(marker)
    script = tmp_path / "train.py"
    run_url = (tmp_path / "run").as_uri()
    script.write_text(TORCHRUN_PRELUDE + code.replace(url, run_url) + TORCHRUN_EPILOGUE)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    done = subprocess.run(
        [*command, "--nproc-per-node", "2", str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def test_the_torchrun_example(tmp_path: Path) -> None:
    torchrun_example("DDP(MODEL)", tmp_path)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    assert align(fresh, mailbox=mailbox_from_url((tmp_path / "run").as_uri())) >= 3
    saved = torch.load(tmp_path / "final.pt")
    for name, value in fresh.state_dict().items():
        assert torch.equal(saved[name], value), name


def test_the_fsdp2_example(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from gradientmail.integrations.torchrun import shard_module, shard_url

    torchrun_example("fully_shard(model)", tmp_path)
    run_url = (tmp_path / "run").as_uri()
    # The whole model from both shards' runs: rank i holds rows [8i, 8i+8) of the first layer
    # and the last layer's single row lives on rank 0 (FSDP2 shards dim 0, padded at the end).
    whole = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    rows = {"0.weight": 8, "0.bias": 8, "2.weight": 1, "2.bias": 1}
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in rows}
    for rank in (0, 1):
        shape = dict(whole.named_parameters())
        shards = {
            name: torch.zeros(rows[name], *shape[name].shape[1:])
            for name in rows
            if rank == 0 or rows[name] == 8
        }
        module = shard_module(shards)
        assert align(module, mailbox=mailbox_from_url(shard_url(run_url, rank, 2))) >= 3
        for name, value in shards.items():
            parts[name].append(value)
    dcp_to_torch_save(tmp_path / "final", tmp_path / "final.pt")
    saved = torch.load(tmp_path / "final.pt")
    for name in rows:
        assert torch.equal(saved[name], torch.cat(parts[name])), name
