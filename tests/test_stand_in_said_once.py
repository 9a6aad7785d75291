"""A model served by a stand-in is explained once per model and command: the bench's report
carries the full paragraph, and the server's start says it in a few words."""

from __future__ import annotations

import io
import logging

import numpy as np
import pytest
from test_onnx_stand_in import affine_pipelines, write_affine_onnx

from pipelines.bench import BenchSettings, run_benchmark

PARAGRAPH = "where this model's own timings belong"  # the end of StandIn.label


@pytest.mark.server
def test_the_bench_explains_a_stand_in_once(tmp_path, capsys, caplog):
    chain = affine_pipelines(write_affine_onnx(tmp_path / "affine.onnx"))["onnxchain"]
    settings = BenchSettings(local=False, server=True, forms=("ensemble", "bls"), concurrency=(1,), requests=5,
                             warmup=0, max_trials=3)
    echo = io.StringIO()
    with caplog.at_level(logging.WARNING, logger="pipelines.triton"):
        result = run_benchmark(chain, settings, inputs={"x": np.ones((1, 4), np.float32)}, out=None,
                               progress=True, echo=echo)
    assert not any(m.errors for m in result.measurements)
    captured = capsys.readouterr()
    everything = echo.getvalue() + captured.out + captured.err + caplog.text
    assert everything.count(PARAGRAPH) == 1, everything
    assert "STAND-IN for 'onnxchain__affine'" in echo.getvalue()  # the report's note: the full one
    assert "'onnxchain__affine' is served by a STAND-IN: a Python model running" in caplog.text  # in short
