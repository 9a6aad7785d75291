"""The yolov5 notebook: committed with its outputs so that it reads without running it, and
run top to bottom here, on the real Triton server, as a user would run it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from pipelines.forms import FORMS

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "yolov5_pipeline.ipynb"
MODELS = [form.model_name("yolov5", side_by_side=True) for form in FORMS.values()]
STREAMING_MODELS = [form.model_name("textgen_ungated", side_by_side=True) for form in FORMS.values()]


def _outputs(cells):
    return [o for c in cells if c["cell_type"] == "code" for o in c["outputs"]]


def _text(value):
    # a notebook file keeps multi-line strings as lists of lines
    return "".join(value) if isinstance(value, list) else str(value or "")


def check_story(cells):
    """What a reader must find in the outputs: the diagram, the boxes, the answers, the measurements,
    the streamed tokens."""
    outputs = _outputs(cells)
    assert not [o for o in outputs if o["output_type"] == "error"]
    diagrams = [o for o in outputs if "image/svg+xml" in o.get("data", {})]
    assert len(diagrams) == 2 and all("image/png" in o["data"] for o in diagrams)  # before and after the own step
    assert "output0 → candidates" in _text(diagrams[0]["data"]["image/svg+xml"])
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 6  # two diagrams, the boxes, the two benchmark plots, the first responses
    text = "".join(_text(o.get("text")) for o in outputs)
    for model in MODELS:
        assert f"{model:16s} agrees with the local runtime and the ground truth, on Triton" in text
        assert "and on the local endpoint" in text
    # the benchmark's own report: its table, with the stability column, from warm-up and repeated windows
    assert "windows of 0.75 s, stability ±10%" in text and "stable" in text
    for form in FORMS:
        assert f"local {form}" in text and f"server {form}" in text
    # textgen streams, token by token, locally in every mode and from every form on the server, the same text
    for form, model in zip(FORMS, STREAMING_MODELS, strict=True):
        assert f"local  {form:9s} " in text
        assert f"server {form:9s} " in text and f"the local runtime's text ({model})" in text
    assert text.count("first response after") == 2 * len(FORMS)
    words = "".join(_text(o.get("data", {}).get("text/markdown")) for o in outputs)
    assert "**Verdict.**" in words and "the local runtime measured" in words


def test_committed_with_its_outputs():
    nb = json.loads(NOTEBOOK.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(c["execution_count"] is not None for c in code), "run the notebook before committing it"
    assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1)), "run it top to bottom, once"
    check_story(nb["cells"])


@pytest.mark.long  # over two minutes: handed out first in `make test`
@pytest.mark.server  # the notebook loads its forms into the bundled server and benchmarks them
def test_the_notebook_runs_clean(tmp_path, monkeypatch):
    # The kernel is this interpreter's: its venv comes first on PATH, as in a user's activated venv.
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:  # what was committed must not pass for what this run shows
        if cell.cell_type == "code":
            cell.outputs = []
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    check_story(nb.cells)
