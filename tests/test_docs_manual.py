"""The docs read as a manual, not a log of runs: no page is longer than a reader can use (one
task a page), and no page says when in a day something was measured (a figure carries one
dated provenance line; the run-by-run history lives in git)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
MAX_LINES = 400
# The API reference is generated from the docstrings, and grows with the API.
LONG_BY_DESIGN = {"api.md"}
# A clock time: 16:02, 9:31. Not a port (8000:8000, 127.0.0.1:8000) nor a ratio of longer numbers.
CLOCK = re.compile(r"(?<![\w.:/])(?:[01]?\d|2[0-3]):[0-5]\d(?![\d:])")


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def test_there_are_pages_to_check():
    assert len(pages()) > 10


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_no_page_is_longer_than_a_reader_can_use(page):
    if page.name in LONG_BY_DESIGN:
        pytest.skip(f"{page.name} is generated")
    lines = len(page.read_text().splitlines())
    assert lines <= MAX_LINES, (
        f"docs/{page.relative_to(DOCS)} has {lines} lines (at most {MAX_LINES}): split it by task "
        "(how-to and reference on one page, how it works on another), and move what was tried to design_notes.md"
    )


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_no_page_says_what_time_of_day_it_measured(page):
    found = [(n, line.strip()) for n, line in enumerate(page.read_text().splitlines(), 1) if CLOCK.search(line)]
    assert not found, (
        f"docs/{page.relative_to(DOCS)} gives clock times, a log of runs: "
        + "; ".join(f"line {n}: {line[:80]!r}" for n, line in found[:5])
        + ". Give a figure one provenance line (machine, date) and leave the history to git"
    )


def test_the_clock_pattern_tells_a_time_from_a_port():
    assert CLOCK.search("the table of the 16:02 run")
    assert CLOCK.search("at 9:31 that day")
    assert not CLOCK.search("docker run -p 8000:8000")
    assert not CLOCK.search("HTTP  127.0.0.1:8000")
    assert not CLOCK.search("localhost:8001 and 2026-11-29")
