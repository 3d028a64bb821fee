"""CPU time of other processes: the broker's, a server's workers'.

User + system seconds so far, read from ``/proc`` through psutil; a benchmark reads them
before and after its window. The broker is the process that listens on the broker's
port, which only a user allowed to see other users' sockets can find (root, as here and
in CI); where a figure cannot be read it is None, and the report says so.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import psutil
from support.broker import BROKER_HOST

__all__ = ["broker_pid", "cpu_seconds"]


@functools.cache
def broker_pid() -> int | None:
    """The pid of the process listening on the broker's port on this machine, or None."""
    host, _, port = BROKER_HOST.partition(":")
    if host not in ("127.0.0.1", "localhost", "::1"):
        return None
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr.port == int(port or 5672):
                return conn.pid
    except (psutil.Error, OSError):
        pass
    return None


def cpu_seconds(pids: Iterable[int | None]) -> float | None:
    """User + system CPU seconds the processes ``pids`` have used so far, or None when any
    is unknown or cannot be read."""
    total = 0.0
    try:
        for pid in pids:
            if pid is None:
                return None
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
    except (psutil.Error, OSError):
        return None
    return total
