"""The synchronisation primitives of the library, all in one place.

* :class:`Waiter`: one thread's wait for one thing (a reply, a confirm, CloseOk).
* :class:`SelfPipe`: a self-pipe, for event loops and the drainer's ``select``.
* :class:`FairRLock`: the legacy transport lock, handed to waiters in arrival order.
"""

from __future__ import annotations

import socket
import threading
from collections import deque
from time import monotonic
from typing import Any, Protocol

__all__ = ["Awaitable", "FairRLock", "SelfPipe", "Waiter", "deadline_after", "lock_timeout"]


def deadline_after(timeout: float | None) -> float | None:
    """The ``monotonic()`` deadline of a wait of ``timeout`` seconds; None for no limit
    (``timeout`` None, or too long for any wait to express)."""
    if timeout is None or timeout >= threading.TIMEOUT_MAX:
        return None
    return monotonic() + timeout


def lock_timeout(timeout: float | None) -> float:
    """``Lock.acquire``'s timeout for a wait of ``timeout`` seconds (None: no limit): -1
    for none, and none for one too long to express (``float('inf')`` would raise
    ``OverflowError`` in the wait)."""
    if timeout is None or timeout >= threading.TIMEOUT_MAX:
        return -1
    return max(timeout, 0.0)


class Awaitable(Protocol):
    """Something a thread can wait for: a :class:`Waiter`, or the inbox."""

    def ready(self) -> bool: ...
    def wait(self, timeout: float | None) -> bool: ...


class Waiter:
    """One thread's wait for a reply: filled by whichever thread reads it, waited on by
    its owner. A reply and a failure that race may both be stored: the owner looks at
    the reply first.

    The signal is a bare lock, held until the reply (or the end) arrives: waking a thread
    from ``Lock.acquire`` costs less than from ``Event.wait``, which matters when one
    failure wakes dozens of waiters at once.
    """

    __slots__ = ("methods", "done", "value", "error", "_signal")

    def __init__(self, methods: tuple[tuple[int, int], ...] = ()) -> None:
        self.methods = methods
        self.done = False
        self.value: tuple[tuple[int, int], tuple[Any, ...]] | None = None
        self.error: BaseException | None = None
        self._signal = threading.Lock()
        self._signal.acquire()

    def __call__(self, method_sig: tuple[int, int], *args: Any) -> None:
        """Fill the wait with a reply (py-amqp's ``dispatch_method`` calls this)."""
        if not self.done:
            self.value = (method_sig, args)
            self._wake()

    def fail(self, error: BaseException | None = None) -> None:
        """Wake the owner without a reply: with ``error``, or (None) with the connection's
        end, which the owner then looks up."""
        if not self.done:
            self.error = error
            self._wake()

    def _wake(self) -> None:
        self.done = True
        try:
            self._signal.release()
        except RuntimeError:  # a reply and a failure raced: already woken
            pass

    def ready(self) -> bool:
        return self.done

    def wait(self, timeout: float | None) -> bool:
        """Block until filled or ``timeout``; the owner's thread only."""
        if self.done:
            return True
        if self._signal.acquire(timeout=lock_timeout(timeout)):
            self._signal.release()  # a later wait() returns at once
            return True
        return self.done


class SelfPipe:
    """A self-pipe: readable after :meth:`set` until :meth:`clear`. Thread-safe."""

    def __init__(self) -> None:
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)
        self._is_set = False  # a byte is pending or coming; a stale read costs a spare byte
        # Guards the sockets against close(): a send racing the close could otherwise
        # write to a descriptor number reused meanwhile. Taken by set()'s send and close().
        self._lock = threading.Lock()
        self._closed = False

    def fileno(self) -> int:
        return self._r.fileno()

    def set(self) -> None:
        if not self._is_set:
            self._is_set = True
            self._send()

    def _send(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                self._w.send(b"\0")
            except OSError:  # full: a byte is pending anyway
                pass

    def clear(self) -> None:
        # The flag first: a set() from here on writes its byte. If one lands before the
        # pipe is empty, its byte may be read away: the flag tells, and it is written again.
        self._is_set = False
        try:
            while self._r.recv(4096):
                pass
        except OSError:
            pass
        if self._is_set:
            self._send()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._r.close()
            self._w.close()

    def after_fork(self) -> None:
        """In a forked child: the thread that may have held the lock is not here."""
        self._lock = threading.Lock()


class FairRLock:
    """``threading.RLock``'s interface; ``release()`` passes ownership to the
    longest-waiting thread.

    Legacy mode needs it: Python's own locks are not fair, so a thread looping on
    ``drain_events(timeout=1)`` would take the transport lock back before a waiting
    publisher wakes, and starve it for many read timeouts instead of one.

    Taking and letting go of it while nobody waits costs a C lock's acquire or release
    and no more (legacy mode takes it twice per delivery acked): ``_held`` is held while
    some thread owns the lock, and only a thread that has to queue takes ``_mutex``. A
    release hands ``_held`` on, still held, to the first waiter; a release that found
    nobody waiting lets it go and looks again, and a waiter that queued looks at
    ``_held`` again once queued, so one of the two always sees the other.
    """

    def __init__(self) -> None:
        self._held = threading.Lock()  # held while a thread owns the lock
        self._mutex = threading.Lock()  # guards _waiters, and each hand-over
        self._owner: int | None = None  # written by the owner, or for it by a hand-over
        self._depth = 0
        self._waiters: deque[tuple[int, threading.Lock]] = deque()
        #: Another thread waits for the lock (a hint: it may change at once). An
        #: attribute, not a property: a legacy reader asks after every frame.
        self.contended = False

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = threading.get_ident()
        if self._owner == me:
            self._depth += 1
            return True
        if not self._waiters and self._held.acquire(blocking=False):
            self._owner, self._depth = me, 1
            return True
        if not blocking:
            return False
        turn = threading.Lock()
        turn.acquire()
        entry = (me, turn)
        with self._mutex:
            self._waiters.append(entry)
            self.contended = True
            # The owner may have let go since we looked, and found nobody queued.
            if self._waiters[0] is entry and self._held.acquire(blocking=False):
                self._waiters.popleft()
                self.contended = bool(self._waiters)
                self._owner, self._depth = me, 1
                return True
        try:
            if turn.acquire(timeout=lock_timeout(None if timeout < 0 else timeout)):
                return True  # a release made us the owner before waking us
        except BaseException:  # interrupted: as if this thread had never come
            if self._give_up(entry):
                self.release()
            raise
        return self._give_up(entry)

    def _give_up(self, entry: tuple[int, threading.Lock]) -> bool:
        """A waiter stops waiting: out of the queue, unless a release made it the owner
        just now (then True: it owns the lock)."""
        with self._mutex:
            if self._owner == entry[0]:
                return True
            self._waiters.remove(entry)
            self.contended = bool(self._waiters)
            return False

    def release(self) -> None:
        if self._owner != threading.get_ident():
            raise RuntimeError("cannot release un-acquired lock")
        if self._depth > 1:
            self._depth -= 1
            return
        let_go = not self._waiters
        if let_go:
            self._owner, self._depth = None, 0
            self._held.release()
            if not self._waiters:
                return
        with self._mutex:  # a waiter: hand it _held (taken back if we let it go)
            if let_go and not self._held.acquire(blocking=False):
                return  # taken meanwhile (by the waiter, or another): not ours to hand
            if self._waiters:
                self._owner, turn = self._waiters.popleft()
                self.contended = bool(self._waiters)
                self._depth = 1
                turn.release()
            else:  # the waiter timed out meanwhile
                self._owner, self._depth = None, 0
                self._held.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc_info: Any) -> None:
        self.release()
