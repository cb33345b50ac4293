"""The layering docs/architecture.md draws: every stagetrace import inside the package points down it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "stagetrace"
SHARED = {"conventions", "settings", "_compat", "_safety", "_version", "_compiled"}
# package -> the stagetrace packages and modules it may import (besides SHARED and itself)
ALLOWED: dict[str, set[str]] = {
    "analysis": set(),
    "common": {"analysis"},
    "capture": {"common", "analysis", "_state"},
    "handoff": {"capture", "common", "analysis", "exporter", "_state"},
    "exporter": {"common", "analysis", "destinations"},
    "destinations": set(),
}


def imports_of(path: Path) -> set[str]:
    """The stagetrace subpackages and top-level modules a file imports (functions' bodies included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] == "stagetrace":
                if len(parts) > 1:
                    found.add(parts[1])
                else:
                    found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "stagetrace" and len(parts) > 1:
                    found.add(parts[1])
    return found


def test_every_import_points_down_the_layers():
    wrong = []
    for package, allowed in ALLOWED.items():
        for path in sorted((PACKAGE / package).rglob("*.py")):
            for target in imports_of(path) - SHARED - {package} - allowed:
                wrong.append(f"{path.relative_to(PACKAGE)} imports stagetrace.{target}")
    assert wrong == []


def test_the_checker_sees_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from stagetrace.exporter.signals import flatten\n")
    assert imports_of(bad) == {"exporter"}


def test_the_public_names_resolve_and_the_exporter_process_never_imports_capture():
    """``import stagetrace`` imports each public name on first use; ``python -m stagetrace.exporter`` loads
    the exporter's own modules only (its start-up is every process-mode test's and every worker's cost)."""
    import subprocess
    import sys

    import stagetrace

    assert sorted(stagetrace.__all__) == sorted([*stagetrace._PUBLIC, "__version__"])
    assert all(getattr(stagetrace, name) is not None for name in stagetrace.__all__)
    probe = (
        "import sys, stagetrace.exporter.process; "
        "print(sorted(m for m in sys.modules if m.startswith(('stagetrace.capture', 'stagetrace.configuration', "
        "'stagetrace.handoff', 'stagetrace.integrations', 'torch'))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
