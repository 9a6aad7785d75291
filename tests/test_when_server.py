"""Conditional steps on the real tritonserver: one repository compiled with "all" (the
ensemble left out, with a warning), one server. For the BLS, BLS-sync and fused forms,
over HTTP and gRPC: requests with 0, some and all rows true answer as the local runtime
does; the branch's model runs once per request on the true rows (its ``inference_count``
grows by their number, and nothing runs for a request with none); a failing step inside
the branch fails only the requests whose rows reached it; every subset of outputs answers.
"""

from __future__ import annotations

import itertools
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from when_pipelines import DETECTOR_MODEL, expected, gated_pipeline, rows

from pipelines import InferenceError
from pipelines.forms import FormLeftOutWarning
from pipelines.triton import TritonServer

pytestmark = pytest.mark.server

FORMS = ("bls", "bls_sync", "fused")
CASES = {"none": (0, 3), "some": (2, 3), "all": (3, 0)}
BRANCH_MODEL = "gated__detector"


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    model_file = tmp_path_factory.mktemp("detector") / "model.py"
    model_file.write_text(DETECTOR_MODEL)
    return gated_pipeline(str(model_file))


@pytest.fixture(scope="module")
def server(tmp_path_factory, pipeline):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FormLeftOutWarning)
        repo = pipeline.compile("all")
    with TritonServer(repo.write(tmp_path_factory.mktemp("when") / "repo")) as running:
        yield running


@pytest.fixture(scope="module", params=("http", "grpc"))
def client(request, server):
    with server.client(request.param, timeout=60) as c:
        yield c


def _counts(client) -> tuple[int, int]:
    entry = client.statistics(BRANCH_MODEL)["model_stats"][0]
    return int(entry.get("inference_count", 0)), int(entry.get("execution_count", 0))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("form", FORMS)
def test_answers_as_the_local_runtime_and_runs_the_branch_on_the_true_rows_only(client, pipeline, form, case):
    true, false = CASES[case]
    x = rows(true, false, seed=len(form))
    local = pipeline.run({"x": x}, mode=form.replace("_", "-"))
    before = _counts(client)
    got = client.infer(f"gated_{form}", {"x": x})
    inferences, executions = (a - b for a, b in zip(_counts(client), before, strict=True))
    assert sorted(got) == sorted(local)
    for name, value in local.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
        np.testing.assert_array_equal(got[name], expected(x)[name], err_msg=name)
    assert inferences == true  # Triton counts each row of a batch as one inference
    assert executions == (1 if true else 0)  # one batch of the true rows, or no call at all


@pytest.mark.parametrize("form", FORMS)
def test_a_failing_step_in_the_branch_fails_only_the_requests_whose_rows_reached_it(client, form):
    reached = rows(2, 1)
    reached[1, 2] = 666  # a true row: the detector refuses it
    passed_by = rows(2, 1)
    passed_by[2, 2] = 666  # a false row: the detector never sees it
    requests = [reached if i % 2 == 0 else passed_by for i in range(8)]

    def one(x):
        try:
            return client.infer(f"gated_{form}", {"x": x})
        except InferenceError as exc:
            return exc

    with ThreadPoolExecutor(8) as pool:  # together, so the server may batch them
        answers = list(pool.map(one, requests))
    for x, answer in zip(requests, answers, strict=True):
        if x is reached:
            assert isinstance(answer, InferenceError), answer
            assert "detector" in str(answer) and "marker row" in str(answer)
        else:
            assert not isinstance(answer, Exception), answer
            np.testing.assert_array_equal(answer["z"], expected(x)["z"])


@pytest.mark.parametrize("form", FORMS)
def test_every_subset_of_outputs_answers(client, form):
    x = rows(2, 2, seed=3)
    want = expected(x)
    for size in range(1, len(want) + 1):
        for subset in itertools.combinations(want, size):
            got = client.infer(f"gated_{form}", {"x": x}, outputs=list(subset))
            assert sorted(got) == sorted(subset)
            for name in subset:
                np.testing.assert_array_equal(got[name], want[name], err_msg=f"{subset}: {name}")
