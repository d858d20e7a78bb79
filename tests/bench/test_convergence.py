"""``bench/convergence.py`` end to end in its quick configuration (the real script, real worker
processes, a real directory mailbox): the reference and the mailbox run end on the same loss,
and the report says so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "convergence.py"


def test_the_mailbox_run_matches_the_reference_in_the_report(tmp_path: Path) -> None:
    command = [sys.executable, str(BENCH), "--quick", "--only", "a,b1,ref,c"]
    command += ["--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "(c) within 1% of the reference: met (+0.000%)" in done.stdout
    report = json.loads((tmp_path / "convergence.json").read_text())
    results = {r["key"]: r for r in report["results"]}
    assert results["c"]["heldout"] == results["ref"]["heldout"]
    assert results["c"]["outer_steps"] == results["ref"]["outer_steps"] == 3
    assert results["c"]["sent"] > 0 and results["c"]["by_bytes"]
    # The baselines train alone (no mailbox): data parallelism's bytes are computed.
    assert results["a"]["sent"] > 0 and results["b1"]["sent"] == 0
    assert results["b1"]["tokens"] * 4 == results["a"]["tokens"]
    assert (tmp_path / "convergence-tokens.png").stat().st_size > 0
