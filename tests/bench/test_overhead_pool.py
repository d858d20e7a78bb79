"""``bench/overhead.py --pool``: sittings saved apart are reported together, and their loss per
round is restated against another H, with the arithmetic written out here independently."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "overhead.py"


def sitting(
    path: Path,
    session: list[float],
    plain: list[float],
    cpu: dict[str, list[float]] | None = None,
    **setting: object,
) -> Path:
    described = {
        "inner_steps": 20,
        "fragments": 4,
        "overlap": 4,
        "poll_interval": 1.0,
        "threads": 2,
        "control": False,
        **setting,
    }
    steps, rounds = 10 * len(plain), 2 * len(plain)  # two slots of 5 steps a pair at H=20
    pairs = {"session": session, "plain": plain, "steps": steps, "rounds": rounds, "comm_cpu": 0.1}
    pairs |= cpu or {}  # sittings saved before the CPU halves were measured have none
    path.write_text(json.dumps({"setting": described, "pairs": pairs}))
    return path


def pool(*paths: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH), "--pool", *map(str, paths), "--at-inner-steps", "50"],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_sittings_pool_into_one_cost_and_its_value_at_another_h(tmp_path: Path) -> None:
    a = sitting(tmp_path / "a.json", [1.10, 1.00, 1.05], [1.00, 0.95, 1.00])
    b = sitting(tmp_path / "b.json", [0.90, 1.20], [0.88, 1.10])
    done = pool(a, b)
    assert done.returncode == 0, done.stderr
    session = [1.10, 1.00, 1.05, 0.90, 1.20]
    plain = [1.00, 0.95, 1.00, 0.88, 1.10]
    cost = 1 - sum(plain) / sum(session)
    lost = (sum(session) - sum(plain)) / 10  # 10 rounds in all
    round_at_50 = 12.5 * sum(plain) / 50  # 12.5 plain steps, at the pooled seconds per step
    at_50 = lost / (lost + round_at_50)
    row = next(line for line in done.stdout.splitlines() if line.startswith("| 2 | Session"))
    assert f"{100 * cost:+.2f}%" in row
    assert f"| 5 | {1000 * lost:.1f} ms |" in row
    stated = re.search(r"At H=50 .* costs ([+-][0-9.]+)%", done.stdout)
    assert stated is not None, done.stdout
    assert float(stated.group(1)) == round(100 * at_50, 2)


def test_sittings_of_different_settings_do_not_pool(tmp_path: Path) -> None:
    a = sitting(tmp_path / "a.json", [1.0], [0.9])
    b = sitting(tmp_path / "b.json", [1.0], [0.9], inner_steps=50)
    done = pool(a, b)
    assert done.returncode != 0
    assert "settings differ" in done.stderr
    assert f"{b} has inner_steps=50 where {a} has inner_steps=20" in done.stderr


def test_pooled_cpu_per_round_splits_this_process_from_the_rest_of_the_machine(
    tmp_path: Path,
) -> None:
    a = sitting(
        tmp_path / "a.json",
        [1.2, 1.1],
        [1.0, 1.0],
        cpu={"process_cpu": [4.0, 3.0], "machine_cpu": [4.5, 3.1]},
    )
    b = sitting(
        tmp_path / "b.json",
        [1.3],
        [1.1],
        cpu={"process_cpu": [2.5, 2.0], "machine_cpu": [3.0, 2.1]},
    )
    done = pool(a, b)
    assert done.returncode == 0, done.stderr
    rounds = 6  # two a pair
    own = (4.0 + 2.5 - 3.0 - 2.0) / rounds
    rest = (4.5 + 3.0 - 3.1 - 2.1) / rounds - own
    lost = (1.2 + 1.1 + 1.3 - 1.0 - 1.0 - 1.1) / rounds
    threads = 0.2 / rounds  # comm_cpu 0.1 a sitting
    note = next(line for line in done.stdout.splitlines() if line.startswith("CPU per closed"))
    assert f"this process {1000 * own:+.0f} ms" in note
    assert f"the rest of the machine {1000 * rest:+.0f} ms" in note
    assert f"threads used {1000 * threads:.0f} ms a round" in note
    assert f"training lost {1000 * lost:.0f} ms" in note


def test_sittings_without_cpu_halves_print_no_cpu_line(tmp_path: Path) -> None:
    done = pool(sitting(tmp_path / "a.json", [1.1], [1.0]))
    assert done.returncode == 0, done.stderr
    assert "CPU per closed round" not in done.stdout


def test_a_sitting_without_cpu_halves_leaves_the_pool_without_a_cpu_line(tmp_path: Path) -> None:
    # Summing the one sitting's CPU over both sittings' rounds would halve it.
    cpu = {"process_cpu": [4.0, 3.0], "machine_cpu": [4.5, 3.1]}
    a = sitting(tmp_path / "a.json", [1.2], [1.0], cpu=cpu)
    b = sitting(tmp_path / "b.json", [1.3], [1.1])
    done = pool(a, b)
    assert done.returncode == 0, done.stderr
    assert "CPU per closed round" not in done.stdout
