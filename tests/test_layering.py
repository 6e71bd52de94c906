"""The package's dependency arrows stay one-way (STYLE.md):

    types <- draft, verify, schedule <- engine <- server, cli
    train, eval -> draft, verify, types   (eval also reuses train's calibration metrics)

Checked on the source text (every import statement, including ones inside
functions), so a violation fails here before it tangles the code.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "dspark"

# package -> dspark packages it must never import
FORBIDDEN = {
    "types": {"models", "draft", "verify", "schedule", "engine", "server", "train", "eval", "bench", "cli"},
    "verify": {"models", "draft", "schedule", "engine", "server", "train", "eval", "bench", "cli"},
    "schedule": {"models", "draft", "verify", "engine", "server", "train", "eval", "bench", "cli"},
    "models": {"draft", "verify", "schedule", "engine", "server", "train", "eval", "bench", "cli"},
    "draft": {"engine", "server", "train", "eval", "bench", "cli"},
    "engine": {"server", "train", "eval", "bench", "cli"},
    "server": {"train", "eval", "bench", "cli"},
    "train": {"server", "eval", "bench", "cli"},
    "eval": {"server", "bench", "cli"},  # eval reuses train's calibration metrics
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _package(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


SOURCES = sorted(p for p in ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(ROOT)) for p in SOURCES])
def test_dependency_direction(path):
    package = _package(path)
    used = {name.split(".")[1] for name in _imports(path) if name.startswith("dspark.")}
    bad = used & FORBIDDEN.get(package, set())
    assert not bad, f"{path.relative_to(ROOT)} ({package}) imports dspark.{sorted(bad)}"


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(ROOT)) for p in SOURCES])
def test_library_never_parses_arguments(path):
    if path.name == "cli.py":
        return
    assert "argparse" not in _imports(path), f"{path.relative_to(ROOT)} imports argparse: keep it in cli.py"


def test_schedule_and_server_hold_no_tensors():
    """The scheduler and the HTTP layer work on plain Python values (the
    server's launcher, which loads the models, is the one exception)."""
    for package in ("schedule", "server"):
        for path in (ROOT / package).rglob("*.py"):
            if path.name == "launch.py":
                continue
            assert "torch" not in {n.split(".")[0] for n in _imports(path)}, path
