"""Legacy-versus-drainer benchmarks (``pytest tests/benchmarks -m benchmark``).

Shared helpers: the interleaved order of rounds, connections in either mode, and
thread inspection (is a thread blocked yet, dump every stack on a deadlock).
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

from support.threads import blocked_in, stack_names

import drainer_amqp

MODES = ("legacy", "drainer")

__all__ = [
    "MODES",
    "QUICK",
    "all_stacks",
    "blocked_in",
    "connect",
    "interleaved",
    "stack_names",
]

#: Quick mode (CI): fewer messages and rounds, the same checks.
QUICK = os.environ.get("DRAINER_BENCH_QUICK", "") not in ("", "0")


def interleaved(rounds: int) -> Iterator[tuple[int, str]]:
    """``(round, mode)`` pairs, modes alternating in ABBA order: legacy, drainer,
    drainer, legacy, legacy, ... so that slow drift on the machine hits both alike."""
    for i in range(rounds):
        yield from ((i, m) for m in (MODES if i % 2 == 0 else MODES[::-1]))


def connect(mode: str, host: str = "127.0.0.1:5672", **kwargs: Any) -> drainer_amqp.Connection:
    """A connected :class:`drainer_amqp.Connection` in ``mode`` ("legacy" or "drainer")."""
    if mode not in MODES:
        raise ValueError(mode)
    conn = drainer_amqp.Connection(host=host, dedicated_drainer=(mode == "drainer"), **kwargs)
    conn.connect()
    return conn


def all_stacks() -> str:
    """Every thread's stack, for a deadlock report (also dumped to stderr)."""
    faulthandler.dump_traceback(all_threads=True)
    import traceback

    by_id = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {by_id.get(ident, '?')} ({ident})")
        parts.append("".join(traceback.format_stack(frame)))
    return "\n".join(parts)
