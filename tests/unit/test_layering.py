"""The design's dependency rules, enforced: which package may import which, and what stays torch-free."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from cluster import REPO

HEAVY = ("torch", "torchft", "torchtitan")
ENTRY_POINTS = {
    "ftctl": "service.cli",
    "control plane": "service.controlplane.__main__",
    "agent": "service.agent.__main__",
    "Lighthouse wrapper": "lighthouse.__main__",
}
# package -> packages of this project it must never import
FORBIDDEN = {
    "protocol": {"trainer", "service", "lighthouse", "dashboards", "bench"},
    "trainer": {"service", "lighthouse", "dashboards", "bench"},
    "service": {"trainer", "lighthouse", "dashboards", "bench"},
    "lighthouse": {"trainer", "service", "dashboards", "bench"},
}


@pytest.mark.parametrize("process", sorted(ENTRY_POINTS))
def test_every_service_process_starts_without_torch(process):
    """The control plane, the agents, the wrapper and ftctl start in well under a second: no torch."""
    module = ENTRY_POINTS[process]
    probe = (f"import sys, importlib; importlib.import_module({module!r}); "
             f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"{module} imports {out.stdout.strip()}"


def imports_of(path: Path) -> set[str]:
    """Top-level names of every module the file imports, wherever in the file the import is."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_packages_import_only_what_the_design_allows(package):
    files = sorted((REPO / package).rglob("*.py"))
    assert files, f"no Python files under {package}/"
    broken = {str(f.relative_to(REPO)): sorted(imports_of(f) & FORBIDDEN[package]) for f in files}
    assert not {f: names for f, names in broken.items() if names}, f"{package}/ imports what it must not"


def test_protocol_is_torch_free():
    """Everything shared between processes is defined where no process has to load torch for it."""
    used = {str(f.relative_to(REPO)): sorted(imports_of(f) & set(HEAVY)) for f in (REPO / "protocol").rglob("*.py")}
    assert not {f: names for f, names in used.items() if names}
