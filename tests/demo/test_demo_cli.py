"""The command line, the launcher's directory rules and its progress display."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gradientmail._secrets import SECRET_ENV, SECRET_FILE_ENV
from gradientmail.demo.plot import plot_curves, plot_nodes
from gradientmail.demo.processes import (
    MARKER,
    DemoError,
    allreduce_bytes,
    local_path,
    prepare_directory,
)
from gradientmail.demo.progress import Display, Follower, human_bytes, render


def cli(
    *argv: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the command line in a fresh process, with no run secret in its environment."""
    clean = {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, SECRET_FILE_ENV)}
    return subprocess.run(
        [sys.executable, "-m", "gradientmail.ops._cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={**clean, **(env or {})},
    )


@pytest.mark.parametrize("command", [[], ["demo"], ["status"], ["gc"]])
def test_every_command_has_help(command: list[str]) -> None:
    result = cli(*command, "--help")
    assert result.returncode == 0
    assert result.stdout.startswith("usage: gradientmail")


def test_demo_help_names_its_options() -> None:
    out = cli("demo", "--help").stdout
    for option in (
        "--nodes",
        "--mailbox",
        "--framework",
        "--steps",
        "--inner-steps",
        "--fragments",
        "--quantization",
        "--clip",
        "--out",
    ):
        assert option in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--nodes", "0"], "--nodes must be at least 1"),
        (["demo", "--mailbox", "memory://run"], "memory:// mailboxes live in one process"),
        (["demo", "--inner-steps", "4", "--fragments", "8"], "fragments"),
        (["demo", "--clip", "0.5"], "clip must be a number >= 1.0"),
    ],
)
def test_errors_are_one_line(argv: list[str], message: str, tmp_path: Path) -> None:
    result = cli(*argv, "--out", str(tmp_path / "out"))
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gradientmail: error: ")
    assert message in lines[0]


def test_demo_refuses_to_wipe_a_foreign_directory(tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    result = cli("demo", "--mailbox", precious.as_uri(), "--out", str(tmp_path / "out"))
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1
    assert "refusing to wipe" in result.stderr
    assert (precious / "thesis.tex").read_text() == "years of work"


@pytest.mark.parametrize("command", ["status", "gc"])
def test_status_and_gc_of_a_mailbox_without_a_run_fail_in_one_line(
    command: str, tmp_path: Path
) -> None:
    result = cli(command, f"file://{tmp_path / 'nowhere'}")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"gradientmail: error: file://{tmp_path / 'nowhere'} holds no run (no manifest)"
    ]


SECRET = "a demo run's secret: 32 bytes long"


@pytest.fixture(scope="module")
def signed_run(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A signed run that has only just been created (its manifest and initial parameters)."""
    torch = pytest.importorskip("torch")
    from gradientmail import DiLoCo, Session, mailbox_from_url

    torch.manual_seed(0)
    url = f"file://{tmp_path_factory.mktemp('signed') / 'run'}"
    model = torch.nn.Linear(4, 2)
    quick = {"poll_interval": 0.05, "lease_every": 0.2, "lease_timeout": 1.0, "callbacks": ()}
    algorithm = DiLoCo(inner_steps=10, fragments=1, overlap_steps=0)
    with Session(model, algorithm=algorithm, mailbox=mailbox_from_url(url), secret=SECRET, **quick):  # type: ignore[arg-type]
        pass
    return url


@pytest.mark.parametrize("command", [["status", "--watch", "0"], ["gc"]], ids=["status", "gc"])
def test_status_and_gc_of_a_signed_run_name_the_secret_they_need_in_one_line(
    command: list[str], signed_run: str, tmp_path: Path
) -> None:
    name, *options = command
    result = cli(name, signed_run, *options)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"gradientmail: error: the run is signed and gradientmail {name} has no secret: set "
        f"{SECRET_ENV} (or {SECRET_FILE_ENV}), or pass --secret-file PATH"
    ]
    wrong = cli(name, signed_run, *options, env={SECRET_ENV: "x" * 32})
    assert wrong.returncode == 1
    [line] = wrong.stderr.strip().splitlines()
    assert line.startswith("gradientmail: error: the run's manifest does not verify with ")
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    for env, extra in (({SECRET_ENV: SECRET}, []), ({}, ["--secret-file", str(secret_file)])):
        done = cli(name, signed_run, *options, "--json", *extra, env=env)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["rejected"] == []


def test_prepare_directory_wipes_only_what_a_demo_made(tmp_path: Path) -> None:
    run = tmp_path / "run"
    prepare_directory(run)
    assert (run / MARKER).exists()
    (run / "manifest").write_text("old run")
    prepare_directory(run)
    assert sorted(p.name for p in run.iterdir()) == [MARKER]
    (run / MARKER).unlink()
    (run / "data").write_text("x")
    with pytest.raises(DemoError, match="refusing to wipe"):
        prepare_directory(run)
    assert (run / "data").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(DemoError, match="not a directory"):
        prepare_directory(tmp_path / "file")


def test_local_path_reads_file_urls_and_paths(tmp_path: Path) -> None:
    assert local_path(tmp_path.as_uri()) == tmp_path.resolve()
    assert local_path(str(tmp_path)) == tmp_path.resolve()
    assert local_path("s3://bucket/run") is None
    with pytest.raises(DemoError, match="memory"):
        local_path("memory://x")


def test_allreduce_bytes_is_the_ring_formula() -> None:
    assert allreduce_bytes(1000, 4, 10) == round(2 * 3 / 4 * 1000 * 4 * 10)
    assert allreduce_bytes(1000, 1, 10) == 0


def test_human_bytes() -> None:
    assert human_bytes(12) == "12 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 * 2**30) == "3.0 GiB"


def test_follower_waits_for_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "progress.jsonl"
    follower = Follower(path)
    assert follower.poll() == [] and follower.latest is None
    with path.open("w") as f:
        f.write(json.dumps({"step": 1}) + "\n" + '{"step": ')
        f.flush()
        assert follower.poll() == [{"step": 1}]
        f.write("2}\n")
    assert follower.poll() == [{"step": 2}]
    assert follower.latest == {"step": 2}


def test_render_shows_step_loss_speed_round_and_bytes() -> None:
    records = [
        {
            "step": 10,
            "tokens": 1000,
            "loss": 3.0,
            "time": 1.0,
            "rounds_seen": -1,
            "bytes_out": 0,
            "bytes_in": 0,
        },
        {
            "step": 20,
            "tokens": 2000,
            "loss": 2.5,
            "time": 2.0,
            "rounds_seen": 3,
            "bytes_out": 2048,
            "bytes_in": 4096,
        },
    ]
    line = render("node-1", records, steps=100, state="running")
    for part in ("node-1", "20/100", "2.500", "1000 tok/s", "round    3", "2.0 KiB", "4.0 KiB"):
        assert part in line
    assert render("node-2", [], steps=100, state="running").split() == ["node-2", "starting"]
    assert render("node-2", [], steps=100, state="failed (1)").endswith("failed (1)")
    # A streaming run's line shows each fragment's newest round and the stalls.
    records[-1] |= {"fragments": [2, 3], "stalled": 1.25}
    line = render("node-1", records, steps=100, state="running")
    assert "(fragments 2/3)" in line and "stalled    1.2 s" in line


def test_display_rewrites_in_place_on_a_terminal_and_prints_periodically_elsewhere() -> None:
    tty, log = io.StringIO(), io.StringIO()
    on_tty, off_tty = Display(tty, tty=True), Display(log, tty=False, every=3)
    for i in range(4):
        on_tty.show([f"a{i}", f"b{i}"])
        off_tty.show([f"a{i}", f"b{i}"])
    off_tty.show(["end"], force=True)
    assert tty.getvalue().count("\x1b[2F") == 3  # moved up over the two lines each time
    assert "\x1b" not in log.getvalue()
    assert log.getvalue().splitlines() == ["a0", "b0", "a3", "b3", "end"]
    # A shorter block clears the lines the longer one left, and keeps the count right.
    on_tty.show(["only"])
    on_tty.show(["x", "y"])
    redraws = tty.getvalue().split("\x1b[2F")
    assert redraws[-2] == "\x1b[2Konly\n\x1b[2K\n"
    assert redraws[-1] == "\x1b[2Kx\n\x1b[2Ky\n"


def test_plots_are_png(tmp_path: Path) -> None:
    progress = {
        "node-0": [
            {"step": 1, "tokens": 10, "loss": 3.0},
            {"step": 2, "tokens": 20, "loss": 2.0, "heldout": 2.2},
        ],
    }
    nodes = plot_nodes(progress, tmp_path / "nodes.png", title="t", aligned=2.1)
    curves = plot_curves({"a": [(1.0, 3.0), (2.0, 2.0)], "b": []}, tmp_path / "c.png", title="t")
    for path in (nodes, curves):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_bad_alpha_is_refused_naming_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gradientmail.ops._cli import main

    url = (tmp_path / "run").as_uri()
    assert main(["demo", "--alpha", "often", "--mailbox", url, "--out", str(tmp_path)]) == 1
    assert "--alpha must be a number in [0, 1) or 'none', got 'often'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists(), "nothing started"
