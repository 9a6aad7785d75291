"""The recipe of docs/streaming.md runs as written: the pipeline streams locally, compiles to
four forms, and the page's tritonclient code reads the stream from the local endpoint."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import numpy as np

from pipelines.endpoint import LocalServer

PAGE = Path(__file__).resolve().parent.parent / "docs" / "streaming.md"


def _blocks(language: str) -> list[str]:
    return [block.split("```")[0] for block in PAGE.read_text().split(f"```{language}\n")[1:]]


def test_the_recipe_streams_compiles_and_the_client_code_reads_the_stream(tmp_path):
    recipe, client_code = _blocks("python")[:2]
    (tmp_path / "reverse.py").write_text(recipe)
    ran = subprocess.run([sys.executable, "reverse.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == "olleh"
    compiled = subprocess.run(
        [sys.executable, "-m", "pipelines", "compile", "reverse:p", "--target", "all", "--out", "model_repository"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert compiled.returncode == 0, compiled.stderr
    assert "by value" not in compiled.stderr
    commands = _blocks("bash")[0]
    assert "pipelines compile reverse:p --target all --out model_repository" in commands
    tops = {"reverse_ensemble", "reverse_bls", "reverse_bls_sync", "reverse_fused"}
    assert tops <= {p.name for p in (tmp_path / "model_repository").iterdir()}
    for top in tops:
        assert "decoupled: true" in (tmp_path / "model_repository" / top / "config.pbtxt").read_text(), top

    sys.path.insert(0, str(tmp_path))
    try:
        import reverse  # the page's module, as a user's script would import it

        with LocalServer(reverse.p, modes=["fused"]) as server:
            printed = io.StringIO()
            code = client_code.replace('"localhost:8001"', repr(server.grpc_url))
            with contextlib.redirect_stdout(printed):
                exec(code, {"np": np})  # noqa: S102 - the page's own code, as a user pastes it
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("reverse", None)
    assert printed.getvalue() == "olleh"
