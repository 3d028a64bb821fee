"""Legacy-versus-drainer benchmarks (``pytest tests/benchmarks -m benchmark``).

Shared helpers: the interleaved order of rounds, connections in either mode, and
thread inspection (is a thread blocked yet, dump every stack on a deadlock).
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import Any

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


def stack_names(thread: threading.Thread) -> list[str]:
    """The function names on ``thread``'s Python stack, innermost first."""
    frame = sys._current_frames().get(thread.ident or -1)
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return names


#: Innermost Python frames of a thread asleep in the library: a condition or event wait,
#: a lock acquire in the read/write paths (C locks show as their caller's frame, the
#: library's FairRLock as ``acquire``), or a blocking socket read (py-amqp's ``_read``).
BLOCKING_FRAMES = frozenset(
    {
        "acquire",  # FairRLock.acquire (legacy transport lock)
        "wait",
        "wait_for",
        "_read_events",
        "_read",
        "read_frame",
        "blocking_read",
        "write_frame",
        "write_frame_under_lock",
        "_writer_turns",
        "_await_turn",  # Writer: a thread waits for its batch to be written
    }
)


def blocked_in(thread: threading.Thread, entry_points: Iterable[str]) -> bool:
    """Whether ``thread`` is inside one of ``entry_points`` and asleep there."""
    names = stack_names(thread)
    return bool(names) and names[0] in BLOCKING_FRAMES and bool(set(entry_points) & set(names))


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
