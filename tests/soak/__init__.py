"""The soak: one shared kombu connection, many threads, a fault every few seconds.

Run it with ``PYTHONPATH=src:tests python -m soak --seconds N --runs A/drainer,B/drainer``
(``scripts/soak.sh`` runs every run); ``tests/test_soak.py`` runs short ones in the test
command. Each run prints one summary line; the last line sums them up, and
``bench-results/soak.json`` holds every figure. See :mod:`soak.run` for the scenarios
and modes, :mod:`soak.faults` for the faults, :mod:`soak.ledger` for the accounting.
"""

from .run import MODES, SCENARIOS, Options, run, summary_line

__all__ = ["MODES", "SCENARIOS", "Options", "run", "summary_line"]
