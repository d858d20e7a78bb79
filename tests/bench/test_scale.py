"""``bench/scale.py`` end to end on a tiny GPT-2 (the real script, real processes, a real
directory mailbox): both loops run, and every figure the report prints is measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "scale.py"


def test_scale_runs_both_loops_and_measures_every_figure() -> None:
    pytest.importorskip("transformers")
    command = [sys.executable, str(BENCH), "--model", "tiny", "--steps", "16", "--warmup", "1"]
    command += ["--inner-steps", "8", "--fragments", "2", "--overlap", "1", "--threads", "1"]
    command += ["--barrier"]  # a lone node's start barrier: itself
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    (plain,), (session,) = figures["plain"], figures["session"]
    assert plain["params"] == session["params"] > 0
    assert plain["seconds"] > 0 and session["seconds"] > 0
    assert session["peak_rss"] >= session["base_rss"] > 0
    # 16 steps at H=8, K=2: a fragment round every 4 steps, so rounds were published and
    # committed (the lone node closes each), and their latency is measured.
    assert session["rounds_published"] >= 3
    measured = session["latencies"] + session["close_latencies"]
    assert len(measured) >= 2 and min(measured) > 0
    assert session["model_snapshot_bytes"] >= 4 * session["params"]  # F32 deltas, no zstd
    assert session["write_seconds"] > 0 and session["write_seconds_training"] > 0
    assert session["bytes_out"] > session["model_snapshot_bytes"]
    assert session["step_max"] > 0 and session["close"] > 0
    assert "publish to commit" in done.stdout and "bytes per parameter" in done.stdout


def test_paired_runs_both_loops_at_once_on_a_cpu_each_then_swapped() -> None:
    pytest.importorskip("transformers")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("--paired needs two CPUs")
    command = [sys.executable, str(BENCH), "--model", "tiny", "--steps", "12", "--warmup", "1"]
    command += ["--inner-steps", "8", "--fragments", "2", "--overlap", "1", "--threads", "1"]
    command += ["--paired"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    cpus = sorted(os.sched_getaffinity(0))[:2]
    ratios = []
    for pair, cpu in zip(figures["pairs"], cpus, strict=True):
        (plain,), (session,) = pair["plain"], pair["session"]
        assert session["cpu"] == cpu and plain["cpu"] != cpu
        assert plain["seconds"] > 0 and session["seconds"] > 0
        assert session["rounds_published"] >= 2
        # The plain loop trained on while the Session loop closed: it stopped only when told.
        assert plain["padding"] >= 1
        ratios.append(plain["seconds"] / session["seconds"])
        assert f"paired: plain on CPU {plain['cpu']} and Session on CPU {cpu}" in done.stdout
    assert figures["ratio"] == pytest.approx((ratios[0] * ratios[1]) ** 0.5)
    assert f"paired ratio (geometric mean of {ratios[0]:.3f} and {ratios[1]:.3f}" in done.stdout
