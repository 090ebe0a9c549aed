"""Rules of ownership in gateway/ that imports do not show: a turn is closed and changed only by
its owner (the chat service and the module of `PreparedTurn`), and no module or function grows
past what one reader holds."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gateway"
TURN_OWNERS = {PACKAGE / "services" / "turns.py", PACKAGE / "services" / "turn.py"}
MAX_LINES = 800


def _trees(folder: Path) -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text()) for path in sorted(folder.rglob("*.py"))}


def _named_turn(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "turn"


def turn_closes(trees: dict[Path, ast.Module]) -> list[str]:
    """Calls of `something.close(turn, ...)`: closing a turn by hand."""
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "close"
                and node.args
                and _named_turn(node.args[0])
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def turn_mutations(trees: dict[Path, ast.Module]) -> list[str]:
    """Assignments to an attribute of a variable `turn` (a `PreparedTurn` wherever it is named so)."""
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AugAssign | ast.AnnAssign)
                else []
            )
            for target in targets:
                if isinstance(target, ast.Attribute) and _named_turn(target.value):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_the_http_layer_never_closes_a_turn_itself() -> None:
    assert turn_closes(_trees(PACKAGE / "api")) == []


def test_a_turn_is_changed_only_by_its_owner() -> None:
    trees = {p: t for p, t in _trees(PACKAGE).items() if p not in TURN_OWNERS}
    assert turn_mutations(trees) == []


def test_the_rules_see_what_they_forbid() -> None:
    tree = ast.parse("async def f(service, turn):\n    turn.done = True\n    await service.close(turn)\n")
    assert turn_closes({ROOT / "x.py": tree}) == ["x.py:3"]
    assert turn_mutations({ROOT / "x.py": tree}) == ["x.py:2"]


def test_no_module_is_longer_than_a_reader_holds() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_no_function_is_more_complex_than_a_reader_holds() -> None:
    """McCabe complexity at most 15 (`[tool.ruff.lint.mccabe]`) in the code and the benchmark."""
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent))
    if ruff is None:
        pytest.skip("ruff is not installed beside this Python (the dev extra)")
    found = subprocess.run(
        [ruff, "check", "--no-cache", "--select", "C901", "--output-format", "concise", "gateway", "bench"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert found.returncode == 0, found.stdout
