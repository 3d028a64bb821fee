"""This process's threads, descriptors, sockets and memory, before, during and after.

Threading contract: :class:`RssSampler` samples in one named daemon thread of its own
(``soak-rss``), started and stopped (bounded join) by the run's thread; the other
functions are called from the run's thread.
"""

from __future__ import annotations

import statistics
import threading
from dataclasses import dataclass, field
from time import monotonic

import psutil
from support.broker import drainer_threads, sockets_to, wait_until

__all__ = ["RssSampler", "Snapshot", "snapshot", "settled"]

_SOAK_PREFIXES = ("soak-", "drainer-amqp-")


@dataclass
class Snapshot:
    threads: set[str]  # names of the live threads
    drainers: int
    fds: int
    sockets: int  # established sockets to the watched ports

    def as_dict(self) -> dict[str, int]:
        return {
            "threads": len(self.threads),
            "drainers": self.drainers,
            "fds": self.fds,
            "sockets": self.sockets,
        }


def snapshot(ports: list[int]) -> Snapshot:
    return Snapshot(
        threads={t.name for t in threading.enumerate()},
        drainers=len(drainer_threads()),
        fds=psutil.Process().num_fds(),
        sockets=sum(len(sockets_to(port)) for port in ports),
    )


def _new_threads(before: Snapshot) -> list[str]:
    """Threads alive now that were not before and belong to the soak or the library
    (the in-process proxy's own threads come and go with its links)."""
    return sorted(
        t.name
        for t in threading.enumerate()
        if t.name not in before.threads and t.name.startswith(_SOAK_PREFIXES)
    )


def settled(before: Snapshot, ports: list[int], timeout: float = 10.0) -> Snapshot:
    """Wait (bounded) until threads, descriptors and sockets are back to ``before``;
    return what is there then."""
    process = psutil.Process()
    wait_until(
        lambda: (
            not _new_threads(before)
            and len(drainer_threads()) <= before.drainers
            and process.num_fds() <= before.fds
            and sum(len(sockets_to(p)) for p in ports) <= before.sockets
        ),
        timeout,
        interval=0.2,
    )
    after = snapshot(ports)
    after.threads = set(_new_threads(before))  # only the leaked ones
    return after


@dataclass
class RssSampler:
    """RSS once per ``interval``; :meth:`slope` is the least-squares line's slope after
    a warm-up, in MB per minute."""

    interval: float = 1.0
    samples: list[tuple[float, float]] = field(default_factory=list)  # (t, MB)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="soak-rss", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        process = psutil.Process()
        start = monotonic()
        while True:
            self.samples.append((monotonic() - start, process.memory_info().rss / 2**20))
            if self._stop.wait(self.interval):
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def slope(self, warmup: float) -> float:
        points = [(t, mb) for t, mb in self.samples if t >= warmup]
        if len(points) < 3:
            return 0.0
        times, mbs = zip(*points, strict=True)
        return statistics.linear_regression(times, mbs).slope * 60.0

    def peak(self) -> float:
        return max((mb for _, mb in self.samples), default=0.0)
