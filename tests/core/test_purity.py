"""The core stays pure: no module of ``gradientmail.core`` imports I/O, threads, clocks,
randomness, ML frameworks, the adapters or the shell, or calls open(), sleep() or time().

Read from the source with ``ast``, so a forbidden import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gradientmail.core

CORE = Path(gradientmail.core.__file__).parent
MODULES = sorted(CORE.glob("*.py"))

FORBIDDEN_MODULES = frozenset(
    {
        "os",
        "time",
        "threading",
        "asyncio",
        "socket",
        "random",
        "pathlib",
        "io",
        "subprocess",
        "torch",
        "mlx",
        "numpy",
        "obstore",
        "multiprocessing",
        "concurrent",
        "datetime",
        "secrets",
        "uuid",
        "signal",
        "shutil",
        "tempfile",
        "select",
        "selectors",
        "urllib",
        "http",
        "importlib",
    }
)
FORBIDDEN_CALLS = frozenset(
    {
        "open",
        "sleep",
        "time",
        "time_ns",
        "monotonic",
        "monotonic_ns",
        "perf_counter",
        "process_time",
        "now",
        "utcnow",
        "urandom",
        "input",
        "print",
        "exec",
        "eval",
        "__import__",
    }
)


def _forbidden_module(name: str) -> bool:
    root = name.split(".")[0]
    if root in FORBIDDEN_MODULES:
        return True
    # Inside gradientmail only the core itself may be imported: not the shell, not adapters.
    return root == "gradientmail" and not (name + ".").startswith("gradientmail.core.")


def violations(source: str, filename: str = "<core>") -> list[str]:
    """Every impure import or call in ``source``, as ``line: what``."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [
                f"{node.lineno}: import {a.name}" for a in node.names if _forbidden_module(a.name)
            ]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                found.append(f"{node.lineno}: relative import (use gradientmail.core paths)")
            elif node.module == "gradientmail":
                found += [
                    f"{node.lineno}: from gradientmail import {a.name}"
                    for a in node.names
                    if a.name != "core"
                ]
            elif node.module and _forbidden_module(node.module):
                found.append(f"{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            func = node.func
            name = (
                func.id
                if isinstance(func, ast.Name)
                else (func.attr if isinstance(func, ast.Attribute) else None)
            )
            if name in FORBIDDEN_CALLS:
                found.append(f"{node.lineno}: call {name}()")
    return found


def test_the_core_has_the_expected_modules() -> None:
    names = {p.stem for p in MODULES}
    assert {
        "keys",
        "algorithm",
        "fragments",
        "records",
        "learner",
        "syncer",
        "leases",
        "errors",
    } <= names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_core_module_is_pure(path: Path) -> None:
    assert violations(path.read_text(encoding="utf-8"), str(path)) == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import os", ["1: import os"]),
        ("import os.path as p", ["1: import os.path"]),
        ("from time import monotonic", ["1: from time import ..."]),
        ("def f():\n    import torch", ["2: import torch"]),
        ("import mlx.core as mx", ["1: import mlx.core"]),
        ("from numpy import float32", ["1: from numpy import ..."]),
        (
            "from gradientmail.adapters.torch import TorchBackend",
            ["1: from gradientmail.adapters.torch import ..."],
        ),
        ("from gradientmail.session import Session", ["1: from gradientmail.session import ..."]),
        ("from gradientmail import session", ["1: from gradientmail import session"]),
        ("import gradientmail._clock", ["1: import gradientmail._clock"]),
        ("from . import keys", ["1: relative import (use gradientmail.core paths)"]),
        ("data = open('f').read()", ["1: call open()"]),
        ("import asyncio\nasyncio.sleep(1)", ["1: import asyncio", "2: call sleep()"]),
        ("t = clock.time()", ["1: call time()"]),
        ("import obstore", ["1: import obstore"]),
        ("import subprocess, socket", ["1: import subprocess", "1: import socket"]),
    ],
)
def test_the_checker_catches_impurity(source: str, expected: list[str]) -> None:
    assert sorted(violations(source)) == sorted(expected)


@pytest.mark.parametrize(
    "source",
    [
        "import hashlib, json, math, struct",
        "from gradientmail.core import keys",
        "from gradientmail.core.errors import FormatError",
        "import gradientmail.core.tensors",
        "from gradientmail import core",
        "import attrs\nfrom collections.abc import Mapping",
        "x = state.step + 1",
    ],
)
def test_the_checker_allows_pure_code(source: str) -> None:
    assert violations(source) == []
