"""The README's example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_api_example_runs_as_written(tmp_path, monkeypatch):
    block = re.search(r"## The API in one screen\s+```python\n(.*?)```", README.read_text(), re.S).group(1)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__main__"}
    exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["out"]["y"].tolist() == [[4.0] * 4] * 2
    assert sorted(namespace["repo"].top_level) == ["demo_bls", "demo_bls_sync", "demo_ensemble"]
    assert (tmp_path / "model_repository" / "demo_ensemble" / "config.pbtxt").is_file()
