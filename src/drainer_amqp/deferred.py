"""Deferred publisher confirms: a future per publish, and the bound on how many are out.

* :class:`ConfirmFuture`: what ``Channel.basic_publish_deferred`` returns, a
  ``concurrent.futures.Future`` settled exactly once by the thread that reads the
  broker's answer (the drainer; in legacy mode a thread in a read) or by the end of the
  connection. It fills the same role as a :class:`~drainer_amqp.sync.Waiter` in
  :class:`~drainer_amqp.waits.Confirms` and :class:`~drainer_amqp.waits.Waiters`.
* :class:`Window`: at most ``size`` deferred confirms outstanding per connection; a
  publish beyond it waits, first come first served.

The threading contract: docs/confirms.md.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from amqp import spec
from amqp.exceptions import MessageNacked

from .errors import CannotWaitInReadingThread
from .reading import Reader
from .sync import deadline_after, lock_timeout

__all__ = ["ConfirmFuture", "Window"]

logger = logging.getLogger(__name__)


class FutureConnection(Protocol):
    """What a :class:`ConfirmFuture` uses of its connection."""

    reader: Reader

    def error_for_caller(self, report: bool = True) -> BaseException: ...


class _Unwatched:
    """The condition of a future that settled before any thread watched it: its state no
    longer changes, so there is nothing to guard or to wait for."""

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return True

    def release(self) -> None:
        pass

    def __enter__(self) -> bool:
        return True

    def __exit__(self, *exc_info: Any) -> None:
        pass

    def wait(self, timeout: float | None = None) -> bool:
        return True

    def wait_for(self, predicate: Callable[[], Any], timeout: float | None = None) -> Any:
        return predicate()

    def notify(self, n: int = 1) -> None:
        pass

    def notify_all(self) -> None:
        pass


_UNWATCHED = _Unwatched()
_FINISHED = "FINISHED"  # concurrent.futures' state names
_DONE_STATES = frozenset(("CANCELLED", "CANCELLED_AND_NOTIFIED", _FINISHED))
#: Guards each future's claim by its first answer (``_claimed``) and the choice of its
#: condition (``_watch``): a watcher's new Condition (and its lists), or the no-op once
#: it has settled unwatched. Taken by the thread that settles a future, and by the first
#: watcher of one; held for a few assignments, never with another lock.
_CHOOSING = threading.Lock()


def _after_fork_in_child() -> None:
    global _CHOOSING
    _CHOOSING = threading.Lock()  # a parent thread may have held it


os.register_at_fork(after_in_child=_after_fork_in_child)


class ConfirmFuture(concurrent.futures.Future):  # type: ignore[type-arg]
    """The broker's answer to one deferred publish.

    ``result()`` returns True once the broker acked the message; it raises
    ``MessageNacked`` on a nack, ``ChannelError`` 312 when a mandatory message came back
    unroutable, and the connection's or the channel's error when either ended first
    (``ConnectionClosedIntentionally`` after ``close()``). Settled exactly once. Done
    callbacks run in the thread that settles it: the drainer (docs/confirms.md). In
    legacy mode ``result()`` and ``exception()`` read the socket while they wait, as any
    legacy wait does. A future that failed and is dropped without anyone asking for
    its outcome logs one warning.

    Most futures are settled before any thread looks at them, so the
    ``threading.Condition`` that ``concurrent.futures`` gives every future is made only
    when a thread watches one that is still pending (``result()``,
    ``add_done_callback()``, ``concurrent.futures.wait()``...); one settled unwatched
    gets a no-op condition, with its state already final. Which comes first is decided
    under ``_CHOOSING``; a watched future's state changes under its condition, as
    ``concurrent.futures`` expects.
    """

    # concurrent.futures.Future's attributes, as class defaults: a future nobody watches
    # stays one object (no instance dict, no lists), which matters to the garbage
    # collector with thousands outstanding. The lists and the condition come with the
    # first watcher (_condition).
    _state = "PENDING"
    _result: Any = None
    _exception: BaseException | None = None
    _waiters: Any = ()
    _done_callbacks: Any = ()
    _watch: Any = None  # the condition: None until watched or settled (see above)
    _claimed = False  # set, under _CHOOSING, by the first answer
    _asked = False  # result() or exception() was called

    def __init__(
        self, conn: FutureConnection, on_settled: Callable[[ConfirmFuture, str], None]
    ) -> None:
        self._conn = conn
        self._on_settled = on_settled

    @property
    def _condition(self) -> Any:  # type: ignore[override]
        watch = self._watch
        if watch is None or type(self._waiters) is tuple:
            with _CHOOSING:
                if type(self._waiters) is tuple:  # the first watcher: its lists
                    self._waiters, self._done_callbacks = [], []
                watch = self._watch
                if watch is None:
                    watch = self._watch = threading.Condition()
        return watch

    # -- settled by the reading thread, or by the connection's end ----------------------
    def __call__(self, method_sig: tuple[int, int], *args: Any) -> None:
        """The broker's ack or nack (``Confirms.settle``)."""
        if method_sig == spec.Basic.Nack:
            self._settle(MessageNacked(), "nacked")
        else:
            self._settle(None, "acked")

    def fail(self, error: BaseException | None = None) -> None:
        """A Return (``error``), the channel's close (``error``), or the connection's end
        (None: its reason)."""
        if error is None:
            self._settle(self._conn.error_for_caller(report=False), "failed")
        else:
            self._settle(error, "returned" if getattr(error, "reply_code", 0) == 312 else "failed")

    def _settle(self, error: BaseException | None, outcome: str) -> None:
        with _CHOOSING:
            if self._claimed:
                return  # the first answer stands
            self._claimed = True
        # Counted first: whoever sees the future done sees its outcome counted too.
        self._on_settled(self, outcome)
        watch = self._watch
        if watch is None:
            with _CHOOSING:
                watch = self._watch
                if watch is None:  # nobody watches it: no waiter, no done callback
                    self._finish(error)
                    self._watch = _UNWATCHED
                    return
        with watch:  # as Future.set_result / set_exception
            self._finish(error)
            for waiter in self._waiters:
                if error is None:
                    waiter.add_result(self)
                else:
                    waiter.add_exception(self)
            watch.notify_all()
        self._invoke_callbacks()  # type: ignore[attr-defined]

    def _finish(self, error: BaseException | None) -> None:
        if error is None:
            self._result = True
        else:
            self._exception = error
        self._state = _FINISHED

    def done(self) -> bool:
        return self._state in _DONE_STATES  # it only moves forward: no lock needed

    def cancel(self) -> bool:
        """A publish cannot be called back: always False (as for a running future)."""
        return False

    # -- waited on ---------------------------------------------------------------------
    def ready(self) -> bool:
        return self.done()

    def wait(self, timeout: float | None) -> bool:
        done, _ = concurrent.futures.wait([self], timeout)
        return bool(done)

    def _read_until_done(self, timeout: float | None) -> None:
        if not self.done():
            try:
                self._conn.reader.wait(self, deadline_after(timeout))
            except TimeoutError:
                raise concurrent.futures.TimeoutError() from None
            except CannotWaitInReadingThread:
                raise
            except Exception:  # noqa: BLE001, S110 - the connection ended: settled with it
                pass

    def result(self, timeout: float | None = None) -> Any:
        if self._state == _FINISHED and self._exception is None:
            self._asked = True  # acked: final, so no lock (a streaming publisher's case)
            return self._result
        self._read_until_done(timeout)
        self._asked = True
        return super().result(0 if self.done() else timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._read_until_done(timeout)
        self._asked = True
        return super().exception(0 if self.done() else timeout)

    def __del__(self) -> None:
        # No lock: nobody else holds the future any more. _exception is set only by
        # set_exception (concurrent.futures keeps it None otherwise).
        error = self._exception
        if error is not None and not self._asked:
            logger.warning("a deferred publish failed and nobody asked: %r", error)


class _Turn:
    """One thread's wait for a slot."""

    __slots__ = ("signal", "granted")

    def __init__(self) -> None:
        self.signal = threading.Lock()
        self.signal.acquire()
        self.granted = False  # set, under the window's lock, with the slot


class Window:
    """At most ``size`` deferred confirms outstanding; beyond, :meth:`enter` waits in
    arrival order. Any thread enters; the thread that settles a confirm leaves.

    Once the window is full, waiting publishers (and watchers) are woken when an eighth
    of it is free again, not slot by slot: each then publishes a run of messages,
    instead of one wake-up per message freed."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._refill_at = size - max(1, size // 8)  # hand slots over at or below this
        self._lock = threading.Lock()  # guards the four below; any thread
        self._changed = threading.Condition(self._lock)  # for wait() and room.wait()
        self.used = 0
        self._turns: deque[_Turn] = deque()  # waiters, first come first served
        self._ended = False
        self._watchers = 0  # threads in wait() or room.wait()
        self.room = _Room(self)

    def enter(self, timeout: float | None) -> bool:
        """Take a slot; False after ``timeout`` seconds, or if the connection ended. An
        interrupted wait leaves no slot taken."""
        with self._lock:
            if self._ended:
                return False
            if self.used < self.size and not self._turns:
                self.used += 1
                return True
            turn = _Turn()
            self._turns.append(turn)
        try:
            turn.signal.acquire(timeout=lock_timeout(timeout))
        except BaseException:  # interrupted: leave no slot taken
            with self._lock:
                if turn in self._turns:
                    self._turns.remove(turn)
                elif turn.granted:
                    turn.granted = False
                    self.used -= 1
                    self._hand_over()
            raise
        with self._lock:
            if turn in self._turns:
                self._turns.remove(turn)  # timed out
            return turn.granted

    def leave(self) -> None:
        with self._lock:
            self.used -= 1
            if self.used <= self._refill_at:
                if self._turns:
                    self._hand_over()
                if self._watchers:
                    self._changed.notify_all()

    def _hand_over(self) -> None:
        while self._turns and self.used < self.size and not self._ended:
            turn = self._turns.popleft()
            turn.granted = True
            self.used += 1
            turn.signal.release()

    def end(self) -> None:
        """The connection ended: every waiting ``enter`` returns False, and later ones."""
        with self._lock:
            self._ended = True
            turns, self._turns = self._turns, deque()
            self._changed.notify_all()
        for turn in turns:
            turn.signal.release()

    def watch(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        """Wait until ``ready()`` (checked under the lock); False after ``timeout``."""
        with self._lock:
            self._watchers += 1
            try:
                return self._changed.wait_for(ready, None if timeout is None else max(timeout, 0))
            finally:
                self._watchers -= 1

    # -- an Awaitable: "nothing outstanding", for close() --------------------------------
    def ready(self) -> bool:
        return not self.used

    def wait(self, timeout: float | None) -> bool:
        return self.watch(self.ready, timeout)


class _Room:
    """An Awaitable: the window has a free slot (or the connection ended), for a legacy
    thread that must read the broker's confirms while it waits for one."""

    def __init__(self, window: Window) -> None:
        self._window = window

    def ready(self) -> bool:
        window = self._window
        return window.used < window.size or window._ended

    def wait(self, timeout: float | None) -> bool:
        return self._window.watch(self.ready, timeout)
