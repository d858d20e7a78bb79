"""Launching worker processes for the integration tests (imported via tests/shell/conftest)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("worker.py")


class Cluster:
    """Real node processes over one mailbox URL; results and event logs land in ``tmp``."""

    def __init__(self, url: str, tmp: Path, algorithm: dict[str, Any]) -> None:
        self.url, self.tmp, self.algorithm = url, tmp, algorithm
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, node: str, index: int, *, steps: int = 160, **options: Any) -> None:
        args = [
            sys.executable,
            str(WORKER),
            "--mailbox",
            self.url,
            "--node",
            node,
            "--index",
            str(index),
            "--steps",
            str(steps),
            "--algorithm",
            json.dumps(self.algorithm),
            "--out",
            str(self.tmp / f"{node}.json"),
            "--events",
            str(self.tmp / f"{node}.events"),
        ]
        for name, value in options.items():
            args += [f"--{name.replace('_', '-')}", str(value)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        log = open(self.tmp / f"{node}.log", "wb")  # noqa: SIM115 - closed with the process
        self.procs[node] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait(self, timeout: float = 240) -> dict[str, dict[str, Any]]:
        deadline = time.monotonic() + timeout
        for node, proc in self.procs.items():
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                raise AssertionError(f"{node} did not finish:\n{self.log(node)}") from None
            assert code == 0, f"{node} exited {code}:\n{self.log(node)}"
        return {node: self.result(node) for node in self.procs}

    def result(self, node: str) -> dict[str, Any]:
        return json.loads((self.tmp / f"{node}.json").read_text())  # type: ignore[no-any-return]

    def events(self, node: str) -> list[dict[str, Any]]:
        path = self.tmp / f"{node}.events"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line]

    def log(self, node: str) -> str:
        return (self.tmp / f"{node}.log").read_text(errors="replace")[-4000:]

    def kill(self, node: str) -> None:
        """SIGKILL ``node``: no cleanup, no lease release, whatever it was writing."""
        proc = self.procs.pop(node)
        proc.kill()
        proc.wait()

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
