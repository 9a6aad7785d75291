"""Long commands say what they do: a bar redrawn on a terminal, a line per stage elsewhere
(a pipe, a CI log), and a line again every 30 s of a long stage, never minutes of silence."""

from __future__ import annotations

import io
import subprocess
import sys

from pipelines.commands.progress import HEARTBEAT_S, Progress, counted_stages


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_without_a_terminal_each_stage_is_one_line_and_a_long_stage_is_said_again():
    out, clock = io.StringIO(), _Clock()
    bar = Progress(stream=out, clock=clock)
    assert not bar.live
    bar.note("starting the bundled Triton server on 31 probe models")
    for done in range(1, 101):  # as calibrate's probes tick
        clock.now += 1.0
        bar.update("calibrating", "probes", done / 100, f"{done}/100 probes x rounds")
    bar.update("calibrating", "wake", 0.0, "hand-offs after a wait")
    bar.update("calibrating", "wake", 0.0, "hand-offs after a wait")
    bar.finish("calibrated", "31 probes, 10 rounds, in 294 s")
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    probes = [line for line in lines if "probes x rounds" in line]
    # the stage's first line, then one per HEARTBEAT_S of it: 100 s of ticks make 4, not 100
    assert len(probes) == 1 + int(99 // HEARTBEAT_S)
    assert probes[0].split() == ["calibrating", "probes", "1%", "1/100", "probes", "x", "rounds"]
    assert [line.split()[:2] for line in lines if "wake" in line] == [["calibrating", "wake"]]
    assert lines[0].startswith("starting the bundled") and lines[-1].split()[:2] == ["calibrated", "31"]


def test_on_a_terminal_the_bar_is_redrawn_in_place_and_permanent_lines_clear_it():
    out = _Terminal()
    bar = Progress(stream=out)
    assert bar.live
    bar.update("server ensemble", "measuring", 0.5, "window 1/10: 12.0 infer/s")
    bar.update("server ensemble", "measuring", 1.0, "window 1/10: 13.0 infer/s")
    bar.finish("server ensemble", "13.0 infer/s")
    text = out.getvalue()
    assert text.count("\r") >= 3 and "█" * 24 in text
    assert text.endswith("server ensemble              13.0 infer/s\n")


def test_counted_stages_make_each_step_a_stage():
    out = io.StringIO()
    tick = counted_stages(Progress(stream=out), "profiling steps", "steps")
    for i, name in enumerate(["decode", "resize", "detect"], 1):
        tick(i, 3, name)
    assert [line.split()[:3] for line in out.getvalue().splitlines()] == [
        ["profiling", "steps", "decode"], ["profiling", "steps", "resize"], ["profiling", "steps", "detect"]]


def test_quiet_says_nothing():
    out = io.StringIO()
    bar = Progress(stream=out, enabled=False)
    bar.update("a", "b", 0.5)
    bar.note("n")
    bar.finish("a", "done")
    assert out.getvalue() == ""


def test_the_bench_piped_to_a_log_prints_its_stages(tmp_path):
    ran = subprocess.run(
        [sys.executable, "-m", "pipelines", "bench", "pipelines.examples.basic:chain", "--no-server",
         "--concurrency", "1,2", "--duration", "0.1", "--warmup", "0.1", "--forms", "ensemble",
         "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120,
    )
    assert ran.returncode == 0, ran.stderr
    lines = [line for line in ran.stderr.splitlines() if "local ensemble" in line]
    # each level: its warm-up, its measuring, and its figures, in that order; no bar drawn
    assert len(lines) == 6 and "\r" not in ran.stderr, ran.stderr
    for level, (warm, measuring, figures) in zip((1, 2), (lines[:3], lines[3:]), strict=True):
        assert warm.split() == ["local", "ensemble", f"c={level}", "warm-up"]
        assert measuring.split() == ["local", "ensemble", f"c={level}", "measuring", "window", "1/10"]
        assert "infer/s" in figures
