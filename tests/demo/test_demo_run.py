"""The demo end to end: real worker processes training through a directory mailbox."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import gradientmail

pytestmark = pytest.mark.skipif(
    not hasattr(gradientmail, "Session"), reason="needs gradientmail.Session"
)

TINY = [
    "--layers",
    "1",
    "--dim",
    "32",
    "--heads",
    "2",
    "--context",
    "32",
    "--batch",
    "4",
    "--eval-windows",
    "8",
]


def demo(tmp_path: Path, *argv: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path / "out"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "gradientmail.ops._cli",
            "demo",
            "--mailbox",
            (tmp_path / "run").as_uri(),
            "--out",
            str(out),
            *TINY,
            *argv,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    return result, out


def check_run(result: subprocess.CompletedProcess[str], out: Path, nodes: int) -> dict[str, Any]:
    assert result.returncode == 0, result.stderr[-2000:]
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    assert len(summary["nodes"]) == nodes
    aligned = summary["aligned_heldout"]
    # Trained: well below the uniform guess over 256 bytes.
    assert math.isfinite(aligned) and aligned < math.log(256) - 0.5
    assert summary["round"] >= 0
    for node in summary["nodes"]:
        assert 0 < node["bytes_out"] < summary["allreduce_bytes"] or nodes == 1
        assert node["rounds_seen"] <= summary["round"]
    # The last node to close holds the run's final parameters, as a fresh aligned model does.
    last = max(summary["nodes"], key=lambda n: n["rounds_seen"])
    assert last["rounds_seen"] == summary["round"]
    assert last["heldout"] == pytest.approx(aligned, abs=1e-4)
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert "aligned" in result.stdout and "plot:" in result.stdout
    assert "audit: every invariant holds" in result.stdout
    return summary


def test_two_torch_nodes(tmp_path: Path) -> None:
    result, out = demo(
        tmp_path, "--nodes", "2", "--steps", "30", "--inner-steps", "10", "--eval-every", "10"
    )
    summary = check_run(result, out, 2)
    records = [
        json.loads(line)
        for line in (out / "progress-node-0.jsonl").read_text().splitlines()
        if line
    ]
    assert [r["step"] for r in records if "heldout" in r and not r.get("final")] == [10, 20, 30]
    assert summary["round"] >= 1


@pytest.mark.slow
def test_a_rerun_reuses_the_demo_directories(tmp_path: Path) -> None:
    for _ in range(2):
        result, out = demo(tmp_path, "--nodes", "1", "--steps", "20", "--inner-steps", "10")
        check_run(result, out, 1)


@pytest.mark.slow
def test_streaming_with_f4_deltas(tmp_path: Path) -> None:
    result, out = demo(
        tmp_path,
        "--nodes",
        "2",
        "--steps",
        "40",
        "--inner-steps",
        "10",
        "--fragments",
        "2",
        "--overlap-steps",
        "1",
        "--quantization",
        "F4",
    )
    check_run(result, out, 2)


@pytest.mark.slow
@pytest.mark.mlx
def test_mixed_torch_and_mlx_nodes(tmp_path: Path) -> None:
    pytest.importorskip("mlx.core")
    result, out = demo(
        tmp_path, "--nodes", "2", "--framework", "mixed", "--steps", "20", "--inner-steps", "10"
    )
    summary = check_run(result, out, 2)
    assert sorted(n["framework"] for n in summary["nodes"]) == ["mlx", "torch"]
