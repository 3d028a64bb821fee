"""Who is waiting on a connection, shared by both modes.

* :class:`Waiters`: every thread waiting for a reply or a confirm, so that one end of the
  connection wakes them all.
* :class:`Confirms`: a channel's publisher confirms, matched by delivery tag.
* :class:`Inbox`: callbacks that run user code (deliveries, returns, cancels, ack
  events, blocked notices), queued by the thread that read them for the threads in
  ``drain_events()``.

The reading thread (the drainer, or in legacy mode the thread holding the transport
lock) fills these; any thread may wait on them.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable, Hashable
from time import monotonic
from typing import Any

from .sync import SelfPipe, Waiter

__all__ = ["Confirms", "Inbox", "Waiters"]


class Waiters:
    """The set of live :class:`Waiter` objects of one connection, and its channels'
    :class:`Confirms` (a deferred confirm waits only there)."""

    def __init__(self, on_add: Callable[[], None] | None = None) -> None:
        self._lock = threading.Lock()  # guards _waiting, _ended and _confirms
        self._waiting: set[Waiter] = set()
        self._ended = False
        self._confirms: weakref.WeakSet[Confirms] = weakref.WeakSet()
        self.on_add = on_add  # called after a waiter is registered

    def track(self, confirms: Confirms) -> None:
        """Fail every confirm ``confirms`` waits for when the connection ends."""
        with self._lock:
            self._confirms.add(confirms)

    def add(self, waiter: Waiter) -> Waiter:
        """Register ``waiter``; after the end it is failed at once."""
        with self._lock:
            ended = self._ended
            if not ended:
                self._waiting.add(waiter)
        if ended:
            waiter.fail()
        elif self.on_add is not None:
            self.on_add()
        return waiter

    def discard(self, waiter: Waiter) -> None:
        with self._lock:
            self._waiting.discard(waiter)

    def end(self) -> None:
        """Wake every waiting thread (they look up the connection's reason); later adds
        fail. The confirms not settled yet stay for :meth:`fail_confirms`."""
        with self._lock:
            self._ended = True
            waiting, self._waiting = self._waiting, set()
        for waiter in waiting:
            waiter.fail()

    def fail_confirms(self) -> None:
        """After :meth:`end`: every confirm still pending fails with the connection's
        reason; a deferred publish's future runs its done callbacks here."""
        with self._lock:
            confirms = list(self._confirms)
        for pending in confirms:
            pending.fail_all(None)

    def reset(self) -> None:
        """After a fork: the parent's waiters do not exist in this process, nor do the
        threads that may have held a lock here."""
        self._lock = threading.Lock()
        self._waiting = set()
        for confirms in list(self._confirms):
            confirms.after_fork()

    def __len__(self) -> int:
        return len(self._waiting)

    def besides(self, awaitable: object) -> int:
        """How many threads wait here, ``awaitable``'s own left out. Read without the lock:
        at most a moment stale, which only changes whether a waiter reads for itself
        (``Drainer._may_borrow``)."""
        waiting = self._waiting
        return len(waiting) - (awaitable in waiting)


class Confirms:
    """Publisher confirms of one channel: delivery tags in write order, each with the
    waiter of the thread that wants its ack, if any.

    :meth:`number` must be called in the order the publishes are written: a publish's
    ``take`` calls it under the writer's lock, as the message enters a batch that is
    written; :meth:`settle` is called by the reading thread.
    """

    def __init__(self, waiters: Waiters) -> None:
        self._waiters = waiters
        self._lock = threading.Lock()  # guards _tag, _waiting and _returnable
        self._tag = 0
        self._waiting: dict[int, Waiter] = {}  # insertion order is tag order
        # Mandatory publishes not settled yet, by tag: what a Basic.Return of each would
        # carry (a Return names no delivery tag, and acks of other tags may come between
        # a Return and its message's ack).
        self._returnable: dict[int, Hashable] = {}
        waiters.track(self)

    def reset(self) -> None:
        """Confirm.Select (re)starts numbering at 1."""
        with self._lock:
            self._tag = 0
            waiting, self._waiting = self._waiting, {}
            self._returnable = {}
        for waiter in waiting.values():
            self._waiters.discard(waiter)
            waiter.fail()

    def after_fork(self) -> None:
        """In a forked child: a parent thread may have held the lock. The waits stay, for
        the connection's end to fail them (a future inherited pending settles)."""
        self._lock = threading.Lock()

    def number(self, waiter: Waiter | None, returnable: Hashable = None) -> int:
        """Give the next publish its delivery tag; ``waiter`` (if any) waits for its ack;
        ``returnable``: the publish is mandatory, and a Return carrying that comes back
        for it (see :meth:`fail_returned`)."""
        with self._lock:
            self._tag += 1
            if waiter is not None:
                self._waiting[self._tag] = waiter
                if returnable is not None:
                    self._returnable[self._tag] = returnable
            return self._tag

    def fail_returned(self, returnable: Hashable, error: BaseException) -> bool:
        """A Basic.Return of a message like ``returnable``: the oldest such publish still
        waiting fails with ``error`` (RabbitMQ returns a channel's messages in publish
        order, each before its ack). False if none waits for it."""
        with self._lock:
            tag = next((t for t, r in self._returnable.items() if r == returnable), None)
            if tag is None:
                return False
            del self._returnable[tag]
            waiter = self._waiting.pop(tag, None)
        if waiter is None:
            return False
        waiter.fail(error)
        return True

    def drop(self, tag: int, waiter: Waiter | None) -> None:
        """``waiter`` no longer wants the ack of ``tag`` (its publish failed, timed out, or
        was answered). Only its own entry goes: after a reset (the channel reopened) the
        same tag may be another publish's."""
        if waiter is None:
            return
        with self._lock:
            if self._waiting.get(tag) is waiter:
                del self._waiting[tag]
        self._waiters.discard(waiter)

    def fail(self, tag: int, error: BaseException) -> bool:
        """The message of ``tag`` was returned: its waiter (if any) gets ``error``."""
        with self._lock:
            waiter = self._waiting.pop(tag, None)
        if waiter is None:
            return False
        waiter.fail(error)
        return True

    def settle(self, method_sig: tuple[int, int], delivery_tag: int, multiple: bool) -> None:
        """An ack or nack arrived: wake the waiters of every tag it covers, in one pass."""
        with self._lock:
            if not multiple:
                waiter = self._waiting.pop(delivery_tag, None)
                settled = [waiter] if waiter is not None else []
            else:  # the oldest tags first: no more of the dict is looked at than settles
                waiting, tags = self._waiting, []
                for tag in waiting:
                    if delivery_tag and tag > delivery_tag:
                        break
                    tags.append(tag)
                settled = [waiting.pop(tag) for tag in tags]
            if self._returnable:
                for tag in [t for t in self._returnable if t <= delivery_tag or not delivery_tag]:
                    if multiple or tag == delivery_tag:
                        del self._returnable[tag]
        for waiter in settled:
            waiter(method_sig)

    def __len__(self) -> int:
        return len(self._waiting)

    def fail_all(self, error: BaseException | None) -> None:
        """Every pending confirm fails with ``error`` (None: the connection ended, with its
        reason)."""
        for waiter in self.take_all():
            waiter.fail(error)

    def take_all(self) -> list[Waiter]:
        """The waiters of every pending confirm, which no ack will settle now (the broker
        closed the channel): the caller fails them."""
        with self._lock:
            waiting, self._waiting = self._waiting, {}
            self._returnable = {}
        return list(waiting.values())


#: ``(key, function, *args)``: one tuple per callback (a consumer's backlog of them is
#: what the garbage collector walks).
Callback = tuple[Any, ...]


class Inbox:
    """Callbacks for the threads in ``drain_events()``: they run one at a time, in
    arrival order, in whichever thread takes them.

    ``limit`` bounds how many may wait: at the limit :attr:`full` turns true, and the
    drainer stops reading the socket (TCP back-pressure reaches the broker) until the
    queue has drained below half, when ``on_room`` is called. ``on_empty`` is called
    when the queue empties while :attr:`wake_when_empty` is set (the drainer leaves the
    socket unread while the consumer is behind: see ``Drainer._defer_reading``).
    """

    #: A thread in ``drain_events()`` never reads the socket itself in drainer mode.
    waiter_reads = False

    def __init__(
        self,
        limit: int = 0,
        on_room: Callable[[], None] | None = None,
        on_empty: Callable[[], None] | None = None,
    ) -> None:
        self.limit = limit
        self.on_room = on_room
        self.on_empty = on_empty
        self.full = False
        self.wake_when_empty = False  # set by the drainer's thread, cleared by a take
        # Guards _items, _ended, full and _sleepers; held directly (a C call) where nobody
        # needs waking, through _ready to sleep or wake.
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._sleepers = 0  # threads asleep in wait()
        self._items: deque[Callback] = deque()
        self._ended = False
        self._run_lock = threading.RLock()  # one callback at a time, in arrival order
        self._signal: SelfPipe | None = None  # for event loops; see signal()
        self._closed = False  # close() ran: the connection was released

    # -- the reading thread ------------------------------------------------------------
    def post(self, key: Hashable, function: Callable[..., Any], *args: Any) -> None:
        """Queue ``function(*args)``; ``key`` names its consumer, for :meth:`run_matching`."""
        with self._lock:
            if self._ended:
                return
            self._items.append((key, function, *args))
            if self.limit and len(self._items) >= self.limit:
                self.full = True
            if self._sleepers:
                self._ready.notify()
        if self._signal is not None:
            self._signal.set()

    def end(self) -> None:
        """Drop what is queued and wake every waiting thread."""
        with self._ready:
            self._ended = True
            self._items.clear()
            self.full = False
            self._ready.notify_all()
        if self._signal is not None:
            self._signal.set()

    # -- waiting threads ---------------------------------------------------------------
    def ready(self) -> bool:
        return bool(self._items) or self._ended

    def wait(self, timeout: float | None) -> bool:
        """Block until something is queued or the connection ended, or ``timeout``."""
        with self._ready:
            self._sleepers += 1
            try:
                return self._ready.wait_for(self.ready, timeout)
            finally:
                self._sleepers -= 1

    def run_one(self, deadline: float | None) -> bool:
        """Run the next callback in this thread, if one is queued; return whether one ran.
        Waits for a callback another thread is running, until ``deadline``."""
        if not self._run_lock.acquire(blocking=False):
            timeout = -1 if deadline is None else max(deadline - monotonic(), 0.0)
            if not self._run_lock.acquire(timeout=timeout):
                return False
        try:
            item = self._take(None)
            if item is None:
                return False
            item[1](*item[2:])
            return True
        finally:
            self._run_lock.release()

    def run_matching(self, key: Hashable) -> None:
        """Run, in this thread, every queued callback of ``key`` (a consumer that was just
        cancelled), in order."""
        with self._run_lock:
            while (item := self._take(key)) is not None:
                item[1](*item[2:])

    def _take(self, key: Hashable | None) -> Callback | None:
        items = self._items
        if key is None and not (self.full or self.wake_when_empty):
            # The common case, without the lock, which the reading thread takes for each
            # callback it queues (waiting for it here cost a consumer a hand-over of the
            # interpreter lock per delivery): popleft() is atomic, and with neither flag
            # set a take has nothing else to do. A flag set meanwhile is seen below.
            try:
                item: Callback | None = items.popleft()
            except IndexError:
                return None
            if not (self.full or self.wake_when_empty):
                return item
            with self._lock:
                room, empty = self._after_take()
        else:
            with self._lock:
                if key is None:
                    item = items.popleft() if items else None
                else:
                    item = next((i for i in items if i[0] == key), None)
                    if item is not None:
                        items.remove(item)
                room, empty = self._after_take()
        if room and self.on_room is not None:
            self.on_room()
        if empty and self.on_empty is not None:
            self.on_empty()
        return item

    def _after_take(self) -> tuple[bool, bool]:
        """Under the lock, after a take: whether there is room again (``full`` cleared)
        and whether the queue emptied while ``wake_when_empty`` was set (cleared)."""
        room = empty = False
        if self.full and len(self._items) <= self.limit // 2:
            self.full = False
            room = True
        if not self._items and self.wake_when_empty:
            self.wake_when_empty = False
            empty = True
        return room, empty

    # -- event loops -------------------------------------------------------------------
    def signal(self) -> SelfPipe:
        """A :class:`SelfPipe` set whenever a callback is queued or the connection ends."""
        with self._ready:
            if self._signal is None:
                self._signal = SelfPipe()
                if self._closed:  # released already: closed at once (its fileno() is -1)
                    self._signal.close()
            signal = self._signal
        if self.ready():
            signal.set()
        return signal

    @property
    def watched(self) -> bool:
        """Whether an event loop asked for :meth:`signal`."""
        return self._signal is not None

    def close(self) -> None:
        with self._ready:
            signal, self._closed = self._signal, True
        if signal is not None:
            signal.close()

    def reset(self) -> None:
        """After a fork: the parent's threads and callbacks do not exist here."""
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._sleepers = 0
        self._run_lock = threading.RLock()
        self._items.clear()
        if self._signal is not None:
            self._signal.after_fork()

    def __len__(self) -> int:
        return len(self._items)
