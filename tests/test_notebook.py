"""The yolov5 notebook runs top to bottom, on the real Triton server, as a user would run it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "yolov5_pipeline.ipynb"


def test_outputs_are_stripped_in_git():
    nb = json.loads(NOTEBOOK.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None


def test_the_notebook_runs_clean(tmp_path, monkeypatch):
    # The kernel is this interpreter's: its venv comes first on PATH, as in a user's activated venv.
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 3  # the graph, the boxes, the cost charts
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    for model in ("yolov5_ensemble", "yolov5_bls", "yolov5_bls_sync"):
        assert f"{model}" in text and "agrees with the local runtime and the ground truth" in text
