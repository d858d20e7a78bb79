"""The public surface is what docs/api.md lists: each public module's ``__all__`` holds exactly
the names its section names, and each of them exists."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

API = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def sections() -> dict[str, set[str]]:
    """Module name to the names its section of docs/api.md lists: a bullet (with its indented
    continuation lines) defines the names in backticks before its first colon, and any name
    a colon follows further on ("...; `Crashed`: what ...")."""
    found: dict[str, set[str]] = {}
    bullets: list[tuple[str, str]] = []
    module = None
    for line in API.read_text(encoding="utf-8").splitlines():
        heading = re.fullmatch(r"## `([\w.]+)`", line.strip())
        if heading:
            module = heading.group(1)
            found[module] = set()
        elif module is not None and line.startswith("- "):
            bullets.append((module, line[2:]))
        elif module is not None and line.startswith("  ") and bullets:
            bullets[-1] = (bullets[-1][0], bullets[-1][1] + " " + line.strip())
        elif not line.strip():
            continue
    for module, text in bullets:
        head = text.split(":", 1)[0]
        found[module] |= set(re.findall(r"`(\w+)`", head))
        found[module] |= set(re.findall(r"`(\w+)`:", text))
    return found


@pytest.mark.parametrize("module", sorted(sections()))
def test_the_public_surface_is_what_the_docs_list(module: str) -> None:
    listed = sections()[module]
    imported = importlib.import_module(module)
    assert set(imported.__all__) == listed, (
        f"{module}: only in __all__: {sorted(set(imported.__all__) - listed)}; "
        f"only in docs/api.md: {sorted(listed - set(imported.__all__))}"
    )
    for name in listed:
        assert getattr(imported, name) is not None


def test_the_docs_cover_every_public_module() -> None:
    assert set(sections()) == {
        "gradientmail",
        "gradientmail.mailboxes",
        "gradientmail.testing",
        "gradientmail.adapters",
        "gradientmail.ops",
    }
