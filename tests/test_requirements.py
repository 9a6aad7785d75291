"""requirements.txt says each distribution once, whatever the models' needs repeat."""

from __future__ import annotations

import numpy as np

from pipelines import Pipeline, TensorSpec, step
from pipelines.compile.requirements import NUMPY_REQUIREMENT, one_line_each

V = TensorSpec("FP32", [3])


def test_specifiers_of_one_distribution_share_a_line():
    merged = one_line_each(["numpy<2", "numpy~=1.26.4", "Ml_Dtypes==0.5.4", "ml-dtypes==0.5.4",
                            "tritonclient[grpc,http]==2.51.0", 'foo>=1; python_version<"3.12"'])
    assert merged == ["Ml_Dtypes==0.5.4", "numpy<2,~=1.26.4", "tritonclient[grpc,http]==2.51.0",
                      'foo>=1; python_version<"3.12"']


def test_a_compiled_repository_names_numpy_once(tmp_path):
    @step(inputs={"x": V}, outputs={"y": V})
    def uses_numpy(x):
        return {"y": np.sqrt(np.abs(x))}

    p = Pipeline("numpy_once", inputs={"x": V}, max_batch_size=2)
    p.output("y", p.add(uses_numpy, x=p.input("x"))["y"])
    p.compile("all").write(tmp_path / "models")
    lines = [line for line in (tmp_path / "models" / "requirements.txt").read_text().splitlines()
             if line and not line.startswith("#")]
    numpy_lines = [line for line in lines if line.startswith("numpy")]
    assert len(numpy_lines) == 1 and NUMPY_REQUIREMENT in numpy_lines[0].split(",")
    assert len({line.split("=")[0].split("<")[0].split("~")[0] for line in lines}) == len(lines)
