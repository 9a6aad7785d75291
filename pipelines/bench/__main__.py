"""``python -m pipelines.bench MODULE:ATTR ...``, the same as ``pipelines bench``."""

from __future__ import annotations

import sys

from .command import run

sys.exit(run())
