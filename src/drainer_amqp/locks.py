"""A re-entrant lock that hands itself to waiting threads in arrival order.

Legacy mode needs it: Python's own locks are not fair, so a thread looping on
``drain_events(timeout=1)`` takes the transport lock back before a waiting publisher
or confirm-waiter wakes, and starves it for many read timeouts instead of one. With
first-come-first-served hand-off each waiter waits for at most the reads queued
ahead of it. Drainer mode never holds the lock across a read, so it keeps the
cheaper ``threading.RLock``.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

__all__ = ["FairRLock"]


class FairRLock:
    """``threading.RLock``'s interface; ``release()`` passes ownership to the
    longest-waiting thread."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._owner: int | None = None
        self._depth = 0
        self._waiters: deque[tuple[int, threading.Lock]] = deque()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = threading.get_ident()
        with self._mutex:
            if self._owner == me:
                self._depth += 1
                return True
            if self._owner is None and not self._waiters:
                self._owner, self._depth = me, 1
                return True
            if not blocking:
                return False
            turn = threading.Lock()
            turn.acquire()
            entry = (me, turn)
            self._waiters.append(entry)
        if turn.acquire(timeout=timeout):
            return True  # release() made us the owner before waking us
        with self._mutex:
            if self._owner == me:  # handed over just as we timed out
                return True
            self._waiters.remove(entry)
            return False

    def release(self) -> None:
        with self._mutex:
            if self._owner != threading.get_ident():
                raise RuntimeError("cannot release un-acquired lock")
            self._depth -= 1
            if self._depth:
                return
            if self._waiters:
                self._owner, turn = self._waiters.popleft()
                self._depth = 1
                turn.release()
            else:
                self._owner = None

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc_info: Any) -> None:
        self.release()
