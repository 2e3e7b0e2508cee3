"""The package tree is the pipeline: stage packages import only earlier stages (no back-edges)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "deepspec"

# stage -> stages it may import (besides itself and the always-allowed utils/config).
ALLOWED = {
    "targets": set(),
    "data": {"targets"},
    "cache": {"targets", "data"},
    "drafters": {"targets", "cache", "data"},
    "losses": set(),
    "training": {"targets", "data", "cache", "drafters", "losses", "calibration"},
    "decoding": {"targets", "drafters", "data"},
    "calibration": {"targets", "data", "cache", "drafters", "losses", "decoding", "training"},
    "evaluation": {"targets", "data", "drafters", "decoding", "calibration"},
    "export": {"targets", "drafters", "evaluation"},
}


def _deepspec_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    stages = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "deepspec" and len(parts) > 1:
                stages.add(parts[1])
    return stages


def test_no_back_edges_between_stages():
    problems = []
    for stage, allowed in ALLOWED.items():
        for path in (ROOT / stage).rglob("*.py"):
            for imported in _deepspec_imports(path) - {stage, "utils", "config"}:
                if imported not in allowed:
                    problems.append(f"{path.relative_to(ROOT.parent)} imports deepspec.{imported}")
    assert not problems, "\n".join(problems)
