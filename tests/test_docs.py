"""The docs site builds strictly: a broken link, a missing page or a bad nav entry fails here,
as it fails `make docs`; and its API reference is generated from the docstrings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=180, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    return done, out


def test_the_docs_site_builds_with_no_warning(site):
    done, out = site
    assert done.returncode == 0, done.stdout + done.stderr
    assert (out / "architecture" / "index.html").is_file()


def test_the_api_reference_is_generated_from_the_docstrings(site):
    done, out = site
    assert done.returncode == 0, done.stdout + done.stderr
    page = (out / "api" / "index.html").read_text()
    for anchor in ("pipelines.Pipeline.add", "pipelines.Pipeline.compile", "pipelines.runtime.LocalRuntime.infer",
                   "pipelines.triton.TritonServer", "pipelines.endpoint.LocalServer", "pipelines.predict.Prediction"):
        assert f'id="{anchor}"' in page, f"{anchor} is missing from the API reference"
    assert "and wire its inputs" in page  # Pipeline.add's docstring, rendered
