"""Generated tables in the docs: the text between a pair of markers in a page, replaced from a benchmark's json.

The benchmarks write their latest figures between markers of their own, so that a page keeps its prose and only
the table is rewritten (``--table`` on each script)."""

from __future__ import annotations

import sys
from pathlib import Path


def replace_between(page: Path, markers: tuple[str, str], text: str) -> bool:
    """Puts ``text`` between ``markers`` in ``page``; says so on stderr and returns False where the page or a marker
    is missing (the page is left as it was)."""
    start, end = markers
    body = page.read_text(encoding="utf-8") if page.exists() else ""
    if start not in body or end not in body:
        print(f"{page} has no markers {markers}; its table was not written", file=sys.stderr)
        return False
    head, rest = body.split(start, 1)
    page.write_text(head + start + "\n" + text + end + rest.split(end, 1)[1], encoding="utf-8")
    return True
