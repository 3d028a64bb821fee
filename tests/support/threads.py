"""Thread helpers for tests: where a thread is, waiting until it sleeps in the library,
counting the calls threads make, and a thread that drains a connection meanwhile.

Threading: the stack helpers read other threads' frames (``sys._current_frames()``), a
snapshot that is stale as soon as it is taken. They are for waiting until a thread has
reached a place it cannot leave without help (a blocking wait), never for racing it.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from .broker import JOIN, thread_stacks

__all__ = [
    "BLOCKING_FRAMES",
    "CallCounter",
    "Drain",
    "blocked_in",
    "run_in_thread",
    "drain_in_background",
    "stack_names",
    "wait_until_blocked",
]

#: Names of the innermost Python frame of a thread asleep in the library (each sleeps in
#: a C call made from that frame). They follow the library and py-amqp: update them here.
BLOCKING_FRAMES = frozenset(
    {
        "wait",  # sync.Waiter.wait, the writer's _Message.wait, threading's Condition.wait
        "acquire",  # sync.FairRLock.acquire: the legacy transport lock
        "_read",  # py-amqp's transport._read: a legacy reader in recv()
    }
)


def run_in_thread(target: Callable[[], object], name: str) -> tuple[threading.Thread, list[Any]]:
    """Run ``target`` in a daemon thread; the list gets its result or its exception."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(target())
        except BaseException as exc:  # noqa: BLE001 - the test asserts on it
            outcome.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, outcome


def stack_names(thread: threading.Thread) -> list[str]:
    """The function names on ``thread``'s Python stack, innermost first."""
    frame = sys._current_frames().get(thread.ident or -1)
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return names


def _asleep_at(
    thread: threading.Thread, entry_points: Iterable[str]
) -> tuple[FrameType, int] | None:
    """``(frame, line)`` where ``thread`` sleeps inside one of ``entry_points``, or None."""
    frame: FrameType | None = sys._current_frames().get(thread.ident or -1)
    if frame is None or frame.f_code.co_name not in BLOCKING_FRAMES:
        return None
    innermost, names = frame, set()
    while frame is not None:
        names.add(frame.f_code.co_name)
        frame = frame.f_back
    return (innermost, innermost.f_lineno) if names & set(entry_points) else None


def blocked_in(thread: threading.Thread, entry_points: Iterable[str]) -> bool:
    """Whether ``thread`` is inside one of ``entry_points`` and asleep there."""
    return _asleep_at(thread, entry_points) is not None


def wait_until_blocked(
    thread: threading.Thread, entry_points: Iterable[str], timeout: float = JOIN
) -> bool:
    """Wait until ``thread`` sleeps in a blocking call inside one of ``entry_points``
    (function names on its stack), seen at the same frame and line twice in a row;
    False after ``timeout`` seconds. Then a test may act on the thread's wait."""
    entry_points = frozenset(entry_points)
    deadline = time.monotonic() + timeout
    seen = None
    while True:
        now = _asleep_at(thread, entry_points)
        if now is not None and seen is not None and now[0] is seen[0] and now[1] == seen[1]:
            return True
        seen = now
        if time.monotonic() >= deadline or (thread.ident and not thread.is_alive()):
            return False
        time.sleep(0.005)  # polling another thread's stack: there is no event to wait on


class CallCounter:
    """Counts the calls (Python and C functions, by name) each thread makes inside a
    :meth:`window`. Only threads started inside :meth:`following_new_threads` are seen.

    A thread asleep in a blocking call makes no calls at all, so the count over a window
    tells a sleeping thread from a spinning one however loaded the machine is.
    """

    def __init__(self) -> None:
        # Per thread ident; a dict only while a window is open. Set by the test's thread,
        # read by the counted threads; each counted thread writes only its own entry.
        self._counts: dict[int, Counter[str]] | None = None

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        counts = self._counts
        if counts is not None and event in ("call", "c_call"):
            name = frame.f_code.co_name if event == "call" else getattr(arg, "__name__", "?")
            mine = counts.get(threading.get_ident())
            if mine is None:
                mine = counts[threading.get_ident()] = Counter()
            mine[name] += 1

    @contextmanager
    def following_new_threads(self) -> Iterator[None]:
        """Threads started inside this block are counted (in every later window)."""
        threading.setprofile(self._profile)
        try:
            yield
        finally:
            threading.setprofile(None)  # type: ignore[arg-type]

    @contextmanager
    def window(self) -> Iterator[dict[int, Counter[str]]]:
        """Count the calls made inside this block: a dict filled meanwhile, from thread
        ident to calls by function name (a thread that made none has no entry)."""
        counts: dict[int, Counter[str]] = {}
        self._counts = counts
        try:
            yield counts
        finally:
            self._counts = None


class Drain:
    """A thread (``name``) that calls ``conn.drain_events(timeout=timeout)`` until
    :meth:`stop`, or until an error other than a timeout, which it keeps in
    :attr:`error`. ``timeout`` bounds how long a legacy reader takes to see the stop."""

    def __init__(self, conn: Any, timeout: float = 0.2, name: str = "background-drain") -> None:
        self.error: BaseException | None = None  # written by the thread, once, as it ends
        self._conn = conn
        self._timeout = timeout
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Drain:
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._conn.drain_events(timeout=self._timeout)
            except TimeoutError:
                continue
            except BaseException as exc:  # noqa: BLE001 - kept for the test
                self.error = exc
                return

    def stop(self) -> None:
        """Stop the thread and join it; a thread still running after ``JOIN`` fails."""
        self._stop.set()
        self.thread.join(JOIN)
        assert not self.thread.is_alive(), f"the drain hung:\n{thread_stacks([self.thread])}"


@contextmanager
def drain_in_background(
    conn: Any, timeout: float = 0.2, name: str = "background-drain"
) -> Iterator[Drain]:
    """A :class:`Drain` of ``conn`` for the duration of the block, stopped and joined at
    its end; a block that ends normally also fails if the drain raised."""
    drain = Drain(conn, timeout, name).start()
    try:
        yield drain
    finally:
        drain.stop()
    assert drain.error is None, f"drain_events raised {drain.error!r}"
