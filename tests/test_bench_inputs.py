"""``pipelines bench --input NAME=FILE.npy`` sends the user's own request; the refusals name what is wrong."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines import Pipeline, PipelinesError, TensorSpec, step
from pipelines.bench.command import run

SEEN: list[bytes] = []


@step(inputs={"text": TensorSpec("BYTES", [1])}, outputs={"n": TensorSpec("INT64", [1])})
def count_chars(text):
    SEEN.extend(v[0] for v in text)
    return {"n": np.array([[len(v[0])] for v in text], np.int64)}


recording = Pipeline("recording", inputs={"text": TensorSpec("BYTES", [1])}, max_batch_size=4)
recording.output("n", recording.add(count_chars, text=recording.input("text"))["n"])


def test_bench_sends_the_users_own_request(tmp_path):
    path = tmp_path / "text.npy"
    np.save(path, np.array([[b"a sentence of mine"], [b"and another"]], dtype=object))
    SEEN.clear()
    code = run(["test_bench_inputs:recording", "--no-server", "--forms", "ensemble", "--concurrency", "1",
                "--duration", "0.2", "--warmup", "0", "--max-trials", "3", "--quiet", "--input", f"text={path}",
                "--out", str(tmp_path / "out")])
    assert code == 0
    assert set(SEEN) == {b"a sentence of mine", b"and another"}  # never b"sample 0"


def test_bench_input_names_what_is_missing_or_unknown(tmp_path):
    path = tmp_path / "t.npy"
    np.save(path, np.array([[b"x"]], dtype=object))
    from pipelines.bench.command import _given_inputs
    from pipelines.bench.settings import BenchSettings

    with pytest.raises(PipelinesError, match=r"takes inputs \['text'\]; --input names \['words'\], which it does not"):
        _given_inputs("test_bench_inputs:recording", [f"words={path}"], BenchSettings())
    with pytest.raises(PipelinesError, match="--batch does not apply with --input"):
        _given_inputs("test_bench_inputs:recording", [f"text={path}"], BenchSettings(batch=2))


def test_a_modules_sample_inputs_may_take_the_batch_or_nothing_and_a_wrong_one_is_named():
    import types

    from pipelines.commands.sample_inputs import sample_requests

    request = {"text": np.array([[b"mine"]], dtype=object)}
    for hook in (lambda: [request], lambda batch: [request], lambda batch=1: request):
        module = types.ModuleType("mypipe")
        module.sample_inputs = hook
        assert sample_requests(recording, module=module)[0]["text"][0, 0] == b"mine"
    module = types.ModuleType("mypipe")
    module.sample_inputs = lambda batch, seed: [request]
    with pytest.raises(PipelinesError, match=r"mypipe.sample_inputs\(batch, seed\) cannot be called: define it as "
                                             r"sample_inputs\(batch\)"):
        sample_requests(recording, module=module)
