"""The notebook imports the public API only: names a package exports (its ``__all__``), its
public submodules, or a step from the module of its name (``from pipelines.steps.nms import nms``,
as ``pipelines.steps`` documents); never a private module such as ``pipelines.profiling.measure``.
"""

from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def _imports(notebook: Path) -> list[tuple[str, str | None]]:
    """(module, name) for each ``from module import name``, (module, None) for each ``import module``."""
    found = []
    for cell in json.loads(notebook.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        tree = ast.parse("\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                found += [(node.module, alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                found += [(alias.name, None) for alias in node.names]
    return [(m, n) for m, n in found if m == "pipelines" or m.startswith("pipelines.")]


def _why_not_public(module_name: str, name: str | None) -> str | None:
    module = importlib.import_module(module_name)
    step_module = module_name.startswith("pipelines.steps.") and module_name.count(".") == 2
    if not hasattr(module, "__path__") and not step_module:
        return f"{module_name} is a module inside a package, not the package's public face"
    if name is None:
        return None
    exported = getattr(module, "__all__", ())
    if name in exported:
        return None
    if hasattr(module, "__path__") and not name.startswith("_") and importlib.util.find_spec(f"{module_name}.{name}"):
        return None  # a public submodule (pipelines.examples.yolov5)
    return f"{name!r} is not in {module_name}.__all__"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_a_notebook_imports_the_public_api_only(notebook):
    imports = _imports(notebook)
    assert imports, "the notebook imports pipelines"
    refused = [f"{m}{'' if n is None else ' import ' + n}: {why}" for m, n in imports
               if (why := _why_not_public(m, n)) is not None]
    assert not refused, "\n".join(refused)
