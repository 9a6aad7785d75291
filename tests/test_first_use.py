"""What a new user meets first: tracebacks without noise, the command line taking the
arrays they have (strings, BF16), hints that fix the mistake they made, and names that
are what they look like."""

from __future__ import annotations

import subprocess
import sys
import traceback

import ml_dtypes
import numpy as np
import pytest

from pipelines import InputError, Pipeline, StepError, TensorSpec, step
from pipelines.cli import main

PIPELINES_FILE = '''
import numpy as np
from pipelines import Pipeline, TensorSpec, step

@step(inputs={"text": TensorSpec("BYTES", [1])}, outputs={"size": TensorSpec("INT32", [1])})
def measure(text):
    return {"size": np.array([[len(t)] for t in text.reshape(-1)], np.int32)}

texts = Pipeline("texts", inputs={"text": TensorSpec("BYTES", [1])}, max_batch_size=8)
texts.output("size", texts.add(measure, text=texts.input("text"))["size"])

@step(inputs={"x": TensorSpec("BF16", [2])}, outputs={"y": TensorSpec("FP32", [2])})
def widen(x):
    return {"y": x.astype(np.float32) * 2}

halves = Pipeline("halves", inputs={"x": TensorSpec("BF16", [2])}, max_batch_size=4)
halves.output("y", halves.add(widen, x=halves.input("x"))["y"])
'''


@pytest.fixture
def user_file(tmp_path):
    f = tmp_path / "mine.py"
    f.write_text(PIPELINES_FILE)
    return f


def test_a_step_error_from_p_run_is_not_chained_to_the_event_loop_probe():
    @step(inputs={"x": TensorSpec("FP32", [1])}, outputs={"y": TensorSpec("FP32", [1])})
    def explode(x):
        raise ValueError("no negatives here")

    p = Pipeline("noisy", inputs={"x": TensorSpec("FP32", [1])}, max_batch_size=2)
    p.output("y", p.add(explode, x=p.input("x"))["y"])
    with pytest.raises(StepError) as caught:
        p.run({"x": np.ones((1, 1), np.float32)})
    text = "".join(traceback.format_exception(caught.value))
    assert "no running event loop" not in text
    assert "During handling of the above exception" not in text
    assert "no negatives here" in text


def test_run_takes_object_arrays_of_strings_as_bytes(user_file, tmp_path, capsys):
    np.save(tmp_path / "text.npy", np.array([["héllo"], ["abc"]], dtype=object))  # str, as users have them
    np.save(tmp_path / "raw.npy", np.array([[b"\x00\xff"], [b"abcd"]], dtype=object))
    assert main(["run", f"{user_file}:texts", "--input", f"text={tmp_path / 'text.npy'}"]) == 0
    assert "[[6], [3]]" in capsys.readouterr().out  # "héllo" is 6 bytes in UTF-8
    assert main(["run", f"{user_file}:texts", "--input", f"text={tmp_path / 'raw.npy'}"]) == 0
    assert "[[2], [4]]" in capsys.readouterr().out


class Payload:
    def __reduce__(self):
        return (print, ("PAYLOAD RAN",))


def test_run_refuses_other_pickled_objects_without_running_them(user_file, tmp_path, capsys):
    evil = np.empty((1, 1), dtype=object)
    evil[0, 0] = Payload()
    np.save(tmp_path / "evil.npy", evil)
    np.save(tmp_path / "ints.npy", np.array([[1], [2]], dtype=object))
    assert main(["run", f"{user_file}:texts", "--input", f"text={tmp_path / 'evil.npy'}"]) == 2
    captured = capsys.readouterr()
    assert "PAYLOAD RAN" not in captured.out
    assert "--input text" in captured.err and "not str or bytes" in captured.err and "builtins.print" in captured.err
    assert main(["run", f"{user_file}:texts", "--input", f"text={tmp_path / 'ints.npy'}"]) == 2
    assert "holds ['int'] objects" in capsys.readouterr().err


def test_run_takes_a_bf16_array_back_from_np_save(user_file, tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.array([[1.5, -2.0]], dtype=ml_dtypes.bfloat16))  # loads back as |V2
    assert main(["run", f"{user_file}:halves", "--input", f"x={tmp_path / 'x.npy'}"]) == 0
    assert "[[3.0, -4.0]]" in capsys.readouterr().out


def test_a_flat_batch_of_strings_is_told_to_add_the_last_axis(user_file):
    from pipelines.commands.loading import load_pipeline

    p = load_pipeline(f"{user_file}:texts")
    text = np.array([b"a", b"bb", b"ccc"], dtype=object)
    with pytest.raises(InputError, match=r"send text\[:, None\] for a batch of 3 rows of \[1\]") as caught:
        p.run({"text": text})
    assert "text[None]" not in str(caught.value)  # [1, 3] would not fit [batch, 1] either
    np.testing.assert_array_equal(p.run({"text": text[:, None]})["size"], [[1], [2], [3]])


def test_a_single_unbatched_row_is_told_to_add_the_first_axis():
    p = Pipeline("rows", inputs={"x": TensorSpec("FP32", [-1])}, max_batch_size=4)

    @step(inputs={"x": TensorSpec("FP32", [-1])}, outputs={"y": TensorSpec("FP32", [-1])})
    def same(x):
        return {"y": x}

    p.output("y", p.add(same, x=p.input("x"))["y"])
    with pytest.raises(InputError, match=r"send x\[None\] for a batch of one, or x\[:, None\] for a batch of 3"):
        p.run({"x": np.zeros(3, np.float32)})  # ambiguous: one row of 3, or 3 rows of 1


def test_graph_of_a_step_says_it_is_not_a_pipeline(user_file):
    done = subprocess.run([sys.executable, "-m", "pipelines", "graph", f"{user_file}:measure"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "is the step 'measure', not a Pipeline" in done.stderr and "['texts', 'halves']" in done.stderr


def test_steps_package_attributes_are_their_modules_and_step_is_the_decorator():
    import types

    import pipelines
    import pipelines.steps
    from pipelines import Step
    from pipelines.steps.letterbox import letterbox
    from pipelines.steps.nms import nms

    for name in ("nms", "letterbox", "scale_boxes", "detector"):
        module = getattr(pipelines.steps, name)
        assert isinstance(module, types.ModuleType) and module.__name__ == f"pipelines.steps.{name}"
        assert isinstance(getattr(module, name), Step)
    assert isinstance(nms, Step) and isinstance(letterbox, Step)
    assert pipelines.step is step and callable(step)  # the README's `from pipelines import step`
