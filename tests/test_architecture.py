"""The shape of the package, held by tests: no import cycle between modules (deferred imports and
those for type checkers included), and the layers of ``pyproject.toml``'s import contract kept."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_no_module_imports_itself_through_others():
    graph = grimp.build_graph("distml")
    cycles = []
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back is not None:
                cycles.append(" -> ".join((importer, *back)))
    assert cycles == [], "\n".join(cycles)


@pytest.mark.distributed
@pytest.mark.skipif(shutil.which("lint-imports") is None, reason="needs import-linter (dev extras)")
def test_the_layers_contract_is_kept():
    result = subprocess.run(["lint-imports"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
