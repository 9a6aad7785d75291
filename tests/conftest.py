"""The test tiers, and the order a parallel run takes the test files in.

Tests that start the bundled Triton server are marked ``server``; ``make test-fast``
leaves them out. ``make test`` runs the whole suite on four pytest-xdist workers (the Makefile's WORKERS) with
``--dist loadfile``, so that a module's shared server starts once, on one worker
(``--dist loadgroup`` would not: xdist 3.8 renames ``item._nodeid``, which pytest 9 no
longer reads). The files that start servers are the long ones: they are handed out first, the longest
(marked ``long``) before them (``--no-loadscope-reorder`` keeps this order), and the quick
files fill in at the end, so that no worker is left alone with a long file.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):  # not an xdist worker: keep the files in their own order
        return
    with_servers = {item.path for item in items if item.get_closest_marker("server") is not None}
    long = {item.path for item in items if item.get_closest_marker("long") is not None}
    # Stable: each file keeps its own order. The longest first (the notebook, over two minutes), then the servers'.
    items.sort(key=lambda item: (item.path not in long, item.path not in with_servers))
