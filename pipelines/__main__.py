"""``python -m pipelines`` is the ``pipelines`` command."""

import sys

from .cli import main

sys.exit(main())
