"""``python -m soak``: see :mod:`soak` (run with ``PYTHONPATH=src:tests``)."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main())
