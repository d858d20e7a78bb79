"""``bench/backend.py`` end to end on a small delta: each framework runs in a process of its
own under each allocator setting, and the verdict line names the slowest quantized row."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "backend.py"


def test_backend_bench_measures_each_allocator_setting_in_its_own_process() -> None:
    pytest.importorskip("torch")
    command = [sys.executable, str(BENCH), "--frameworks", "torch", "--params", "65536"]
    command += ["--tensor", "16384", "--repeat", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("| torch")]
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in lines]
    assert [(c[1], c[2]) for c in cells] == [
        (memory, fmt) for memory in ("fresh", "reused") for fmt in ("F32 (plain)", "F8_E4M3", "F4")
    ]
    quantized = [c for c in cells if c[2] != "F32 (plain)"]
    worst = max(max(float(c[5]), float(c[7])) for c in quantized)
    verdict = re.search(r"Slowest quantized encode or decode: ([0-9.]+)x a copy", done.stdout)
    assert verdict is not None, done.stdout
    assert float(verdict.group(1)) == worst
    assert all(float(c[8]) == pytest.approx(0.53125, abs=1e-4) for c in cells if c[2] == "F4")


def test_backend_bench_names_an_unknown_allocator_setting() -> None:
    command = [sys.executable, str(BENCH), "--frameworks", "torch", "--memory", "pooled"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "--memory: unknown setting 'pooled' (known: fresh, reused)" in done.stderr
