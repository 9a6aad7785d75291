"""`when` blocks in the simulation: a step runs on the rows where its conditions hold, drawn once a
request and block, and not at all where none does; exact where the share is 0 or 1. And the
predictor's shares: counted over the sample requests, or given by name."""

from __future__ import annotations

import pytest
from test_simulator import closed, costs, step

from pipelines.errors import ArgumentError, PipelinesError
from pipelines.predict.simulator import simulate
from pipelines.predict.spec import SimSpec

FORMS = ("bls", "bls-sync", "fused")


def gated(form: str, share: float, *, inner: float = 1.0, rows: int = 1) -> SimSpec:
    """check (100 µs) -> big (1000 µs, in when A) -> bigger (2000 µs, in when A and B)."""
    steps = (step("check", 100), step("big", 1000, deps=("check",), when=("A",)),
             step("bigger", 2000, deps=("big",), when=("A", "B")))
    return SimSpec(form, steps, rows=rows, in_bytes=1000.0, out_bytes=1000.0, cores=8.0, costs=costs(),
                   when_rates={"A": share, "B": inner})


@pytest.mark.parametrize("form", FORMS)
def test_a_block_that_never_holds_runs_none_of_its_steps_and_one_that_always_does_runs_all(form):
    never = simulate(gated(form, 0.0), closed(1, requests=50, warmup=5))
    always = simulate(gated(form, 1.0), closed(1, requests=50, warmup=5))
    assert never.p50_us == pytest.approx(100.0) and never.p99_us == pytest.approx(100.0)
    assert always.p50_us == pytest.approx(3100.0)
    assert never.utilisation.get("big", 0.0) == 0.0 or form == "fused"


@pytest.mark.parametrize("form", FORMS)
def test_a_nested_block_runs_only_inside_the_block_around_it(form):
    outer_off = simulate(gated(form, 0.0, inner=1.0), closed(1, requests=50, warmup=5))
    inner_off = simulate(gated(form, 1.0, inner=0.0), closed(1, requests=50, warmup=5))
    assert outer_off.p99_us == pytest.approx(100.0)  # 'bigger' never runs, though B always holds
    assert inner_off.p50_us == pytest.approx(1100.0)


def test_half_the_requests_take_the_branch_and_the_draws_repeat():
    result = simulate(gated("bls", 0.5, inner=0.0), closed(1, requests=400, warmup=20))
    again = simulate(gated("bls", 0.5, inner=0.0), closed(1, requests=400, warmup=20))
    assert result.p50_us in (pytest.approx(100.0), pytest.approx(1100.0))
    assert result.p99_us == pytest.approx(1100.0) and result.mean_us == pytest.approx(600.0, rel=0.15)
    assert result.mean_us == again.mean_us  # seeded: the same spec simulates alike


def test_rows_of_one_request_are_drawn_each_against_the_share():
    # 4 rows, big costs 1000 µs whatever the rows: the block runs unless all 4 rows are off
    result = simulate(gated("bls", 0.5, inner=0.0, rows=4), closed(1, requests=400, warmup=20))
    assert result.mean_us == pytest.approx(100.0 + 1000.0 * (1 - 0.5 ** 4), rel=0.1)


def test_what_cannot_be_simulated_is_refused():
    with pytest.raises(PipelinesError, match="an ensemble cannot skip a step"):
        simulate(gated("ensemble", 0.5), closed(1))
    with pytest.raises(PipelinesError, match=r"when_rates\['A'\] is the share of rows where it holds, 0..1"):
        simulate(gated("bls", 1.5), closed(1))
    bare = gated("bls", 0.5)
    with pytest.raises(PipelinesError, match=r"steps run under \['A', 'B'\], which when_rates does not give"):
        simulate(SimSpec("bls", bare.steps, rows=1, in_bytes=1.0, out_bytes=1.0, cores=8.0, costs=costs()),
                 closed(1))


# ---------------------------------------------------------------------- the predictor's shares


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    from test_predict import flat_profile

    path = tmp_path_factory.mktemp("when") / "profile.json"
    flat_profile().save(path)
    return path


def test_the_predictor_counts_the_share_over_the_samples_and_takes_a_given_one(profile_path, tmp_path):
    from pipelines.examples import yolov5_skip_blank as example

    p = example.pipeline
    steps = tmp_path / "steps.json"  # the yolov5 steps are measured once, for the three predictions
    counted = p.predict(profile_path, concurrency=(4,), forms=("bls", "fused"), module=example, cache=steps)
    assert any("is_blank.blank is true on 50% of the rows of 8 sample request(s) (8 rows, through is_blank)" in n
               for n in counted.notes)
    mostly_blank = p.predict(profile_path, concurrency=(4,), forms=("bls", "fused"), module=example, cache=steps,
                             when_rates={"is_blank.blank": 0.9})
    by = {r.form: r.throughput for r in counted.rows}
    faster = {r.form: r.throughput for r in mostly_blank.rows}
    assert all(faster[f] > 1.5 * by[f] for f in by)  # the detector runs for a tenth of the frames, not half
    with pytest.raises(ArgumentError, match=r"when_rates names \['blank'\]; the conditions .* are \['is_blank.blank'\]"):
        p.predict(profile_path, concurrency=(1,), module=example, cache=steps, when_rates={"blank": 0.5})
    with pytest.raises(ArgumentError, match="has no `when` block"):
        example.unconditional.predict(profile_path, concurrency=(1,), cache=False, when_rates={"x": 0.5})
